"""Property tests of how a save groups its chunks into runs and reads them (SaveJob)."""

import threading

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rlbuffers.storage.layout import ChunkLayout
from rlbuffers.storage.save_job import SaveJob

K = 4  # rows per chunk


def _read(name: str, first: int, count: int) -> np.ndarray:
    """Row r of the column holds r (chunk c holds rows c*K .. c*K+K-1)."""
    return np.arange(first * K, (first + count) * K, dtype=np.int64)


@given(chunks=st.sets(st.integers(0, 60), max_size=40), max_chunks=st.integers(1, 9))
def test_runs_are_consecutive_bounded_and_cover_every_chunk_once(chunks, max_chunks):
    todo = sorted(chunks)
    job = SaveJob(1, {"x": todo}, None, threading.Lock(), ChunkLayout(10**6, K, {"x": K}))
    seen: list[int] = []
    runs = list(job.runs("x", max_chunks))
    for first, count in runs:
        assert 1 <= count <= max_chunks
        seen += range(first, first + count)
    assert seen == todo
    for (a, n), (b, _) in zip(runs[:-1], runs[1:], strict=True):
        assert n == max_chunks or b != a + n  # a run stops early only at a gap or the cap


@given(chunks=st.sets(st.integers(0, 20), min_size=1, max_size=15),
       overwritten=st.sets(st.integers(0, 20)), max_chunks=st.integers(1, 5))
def test_take_reads_runs_and_lays_snapshots_over_them(chunks, overwritten, max_chunks):
    todo = sorted(chunks)
    job = SaveJob(1, {"x": todo}, None, threading.Lock(), ChunkLayout(10**6, K, {"x": K}))
    job.protect(["x"], overwritten, lambda n, c, k: -_read(n, c, k))  # copied-aside contents
    for first, count in job.runs("x", max_chunks):
        rows = job.take("x", first, count, _read)
        assert len(rows) == count * K
        for c in range(first, first + count):
            got = rows[(c - first) * K : (c - first + 1) * K]
            want = -_read("x", c, 1) if c in overwritten else _read("x", c, 1)
            np.testing.assert_array_equal(got, want)
    assert not job.pending and not job.snapshots  # every chunk taken, every snapshot used


def test_snapshots_overlay_ragged_rows():
    job = SaveJob(1, {"t": [0, 1]}, None, threading.Lock(), ChunkLayout(10**6, 2, {"t": 2}))

    def read(name, first, count):
        return [np.arange(i + 1) for i in range(first * 2, (first + count) * 2)]

    job.protect(["t"], [1], lambda n, c, k: [np.zeros(7), np.zeros(8)])
    rows = job.take("t", 0, 2, read)
    assert [len(r) for r in rows] == [1, 2, 7, 8]


@given(chunks=st.sets(st.integers(0, 10), min_size=1, max_size=8),
       overwritten=st.sets(st.integers(0, 21)), m=st.integers(1, 4))
def test_protect_maps_base_chunks_to_the_stored_chunk_holding_them(chunks, overwritten, m):
    """Stored chunks of m base chunks (K rows each): overwriting base chunk b protects stored
    chunk b // m, and a failed save gives back exactly the base chunks its chunks hold."""
    todo = sorted(chunks)
    job = SaveJob(1, {"x": todo}, None, threading.Lock(), ChunkLayout(10**6, K, {"x": K * m}))

    def read(name, first, count):
        return np.arange(first * K * m, (first + count) * K * m, dtype=np.int64)

    job.protect(["x"], overwritten, lambda n, c, k: -read(n, c, k))
    hit = {b // m for b in overwritten}
    assert {c for _, c in job.snapshots} == hit & set(todo)
    for first, count in job.runs("x", 3):
        rows = job.take("x", first, count, read)
        for c in range(first, first + count):
            got = rows[(c - first) * K * m : (c - first + 1) * K * m]
            np.testing.assert_array_equal(got, -read("x", c, 1) if c in hit else read("x", c, 1))
    assert job.base_chunks("x", todo) == {b for c in todo for b in range(c * m, c * m + m)}
