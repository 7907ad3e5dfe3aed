"""Every exception class of :mod:`rlbuffers.errors` (what the public API raises) is exported
from the package, so ``except rlbuffers.SnapshotReclaimedError`` works without knowing the
module."""

import inspect

import rlbuffers
from rlbuffers import errors


def test_every_error_class_is_exported_from_the_package():
    classes = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException)
               and obj.__module__ == errors.__name__}
    assert {"SnapshotReclaimedError", "CorruptCheckpointError", "RLBuffersError"} <= classes
    assert sorted(classes - set(rlbuffers.__all__)) == []
    for name in classes:
        assert getattr(rlbuffers, name) is getattr(errors, name)
