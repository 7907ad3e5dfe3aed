"""Package names imported on first use: the value is the real one and is kept in the package;
an unknown name is an AttributeError naming the package."""

import subprocess
import sys

import pytest


def test_names_resolve_to_the_real_objects_and_stay():
    code = ("import sys, rlbuffers\n"
            "assert 'rlbuffers.buffer' not in sys.modules\n"
            "from rlbuffers.buffer import ReplayBuffer\n"
            "assert rlbuffers.ReplayBuffer is ReplayBuffer\n"
            "assert 'ReplayBuffer' in vars(rlbuffers)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_names_are_attribute_errors():
    import rlbuffers
    import rlbuffers.memory
    import rlbuffers.stream

    for mod in (rlbuffers, rlbuffers.stream, rlbuffers.memory):
        with pytest.raises(AttributeError, match=f"module '{mod.__name__}' has no attribute"):
            mod.no_such_name  # noqa: B018
