"""Heavy optional packages (torch, transformers, gymnasium, stable-baselines3, moto...) that
the ``dev`` extra installs. A test module that needs one calls :func:`require` before importing
it: in a local environment without the package, the module is skipped with a reason that says
what to install; under CI (``RLBUFFERS_REQUIRE_ALL=1``, set by ``.ci/run``) a missing package
is an error, so nothing is skipped silently there."""

from __future__ import annotations

import importlib
import os

import pytest


def require(*modules: str) -> None:
    """Import ``modules`` or skip the calling test module (error under CI).

    Raises:
        ImportError: a module is missing and ``RLBUFFERS_REQUIRE_ALL`` is set.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if os.environ.get("RLBUFFERS_REQUIRE_ALL"):
                raise
            pytest.skip(f"needs {name} ({e}); install the test dependencies with "
                        "pip install -c constraints.txt -e '.[dev]'", allow_module_level=True)
