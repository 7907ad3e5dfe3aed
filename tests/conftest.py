"""Shared helpers for the buffer tests."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rlbuffers import FieldSpec
from rlbuffers.memory.process import set_mmap_threshold

# glibc serves blocks >= 1 MiB by mmap and returns them when freed: whether RSS falls after a
# free must not depend on what earlier tests allocated (the memory tests measure known
# allocations).
set_mmap_threshold(1 << 20)


@pytest.fixture(autouse=True)
def _malloc_defaults():
    """A trainer run in-process calls ``reuse_heap`` (1 GiB thresholds): restore the 1 MiB
    mmap threshold and glibc's 128 KiB trim threshold for the next test."""
    yield
    import ctypes
    import sys

    if set_mmap_threshold(1 << 20) and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD

FIELD_KINDS = {
    "frame": FieldSpec((4, 6, 6), "uint8"),
    "obs": FieldSpec((3,), "float32"),
    "reward": FieldSpec((), "float32"),
    "action": FieldSpec((), "int64"),
    "terminated": FieldSpec((), "bool"),
    "tokens": FieldSpec((None,), "int32"),
    "points": FieldSpec((None, 2), "float64"),
}


@pytest.fixture(autouse=True)
def _drop_trainer_log_handler():
    """A trainer's ``main`` points the root logger at stderr through ``tqdm.write``
    (``trainers.config.TqdmHandler``, which writes to whatever ``sys.stderr`` is then): drop it
    after the test, so a later test's captured stderr holds only its own output."""
    yield
    root = logging.getLogger()
    for h in [h for h in root.handlers if type(h).__name__ == "TqdmHandler"]:
        root.removeHandler(h)


def make_batch(first_id: int, n: int, *, done_every: int = 0) -> dict:
    """``n`` transitions whose every field encodes its transition id, so contents can be checked
    against ids without trusting the code under test."""
    ids = np.arange(first_id, first_id + n)
    return {
        "frame": (ids[:, None, None, None] % 251 + np.zeros((n, 4, 6, 6))).astype(np.uint8),
        "obs": np.stack([ids, -ids, ids * 0.5], axis=1).astype(np.float32),
        "reward": (ids * 0.25).astype(np.float32),
        "action": ids.astype(np.int64),
        "terminated": (ids % done_every == done_every - 1) if done_every else np.zeros(n, bool),
        "tokens": [np.arange(i % 7, dtype=np.int32) + i for i in ids],
        "points": [np.full((i % 3, 2), i, dtype=np.float64) for i in ids],
    }


def assert_rows_are(rows: dict, ids: np.ndarray) -> None:
    """``rows`` (from ``buf[...]``) hold exactly the transitions with these ids."""
    expected = make_batch(0, int(ids.max()) + 1) if len(ids) else make_batch(0, 0)
    for name in FIELD_KINDS:
        if name == "terminated":
            continue
        got = rows[name]
        if isinstance(got, list):
            assert len(got) == len(ids)
            for g, i in zip(got, ids, strict=True):
                np.testing.assert_array_equal(g, expected[name][i])
                assert g.dtype == FIELD_KINDS[name].dtype
        else:
            np.testing.assert_array_equal(got, np.asarray(expected[name])[ids])
            assert got.dtype == FIELD_KINDS[name].dtype


@pytest.fixture
def fields() -> dict:
    return dict(FIELD_KINDS)
