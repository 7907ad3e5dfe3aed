"""Property tests of how a save groups chunks into runs (SaveJob.runs)."""

import threading

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rlbuffers import save_job
from rlbuffers.save_job import SaveJob, concat_rows

CHUNK_ROWS = 4


def _rows(name: str, c: int) -> np.ndarray:
    return np.full((CHUNK_ROWS, 3), c, dtype=np.int64)  # 96 bytes per chunk


@given(chunks=st.sets(st.integers(0, 60), max_size=40), budget=st.integers(1, 500))
def test_runs_cover_every_chunk_once_in_consecutive_bounded_runs(chunks, budget):
    todo = sorted(chunks)
    job = SaveJob(1, {"x": todo}, {}, threading.Lock())
    old, save_job.SAVE_RUN_BYTES = save_job.SAVE_RUN_BYTES, budget
    try:
        runs = list(job.runs("x", _rows))
    finally:
        save_job.SAVE_RUN_BYTES = old
    seen = []
    for first, run in runs:
        ids = [int(rows[0, 0]) for rows in run]
        assert ids == list(range(first, first + len(run)))  # consecutive, starting at first
        assert (len(run) - 1) * 96 < budget or len(run) == 1  # closes once it reaches the budget
        merged = concat_rows(run)
        assert merged.shape == (CHUNK_ROWS * len(run), 3)
        seen += ids
    assert seen == todo
    assert not job.pending  # every chunk was taken


def test_concat_rows_of_ragged_chunks_keeps_order():
    run = [[np.arange(2), np.arange(3)], [np.arange(1)]]
    assert [len(r) for r in concat_rows(run)] == [2, 3, 1]
