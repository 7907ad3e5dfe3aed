"""Large gathers write into recycled arrays (``OutputPool``), copied in parallel parts when
large (``take_rows``): the rows are bit-identical to a row-by-row read of the column's file,
and an array (or any view, tensor or memoryview of it) that a caller still holds is never
written again."""

import contextlib
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.storage import copy_threads
from rlbuffers.storage.out_pool import MIN_BYTES, OutputPool

ROW = (64, 64)  # float32: 16 KiB a row, so 64 rows or more take the pooled path
CAPACITY = 100


def _obs(ids: np.ndarray) -> np.ndarray:
    """Distinct bits per transition id and element (NaN-free, signed zeros and denormals
    included so a float conversion on the way would show)."""
    bits = (ids[:, None, None].astype(np.uint32) * 2654435761
            + np.arange(ROW[0] * ROW[1], dtype=np.uint32).reshape(ROW) * 40503) & 0x7F7FFFFF
    bits[:, 0, 0] = 0x80000000  # -0.0
    bits[:, 0, 1] = 1  # the smallest denormal
    return bits.view(np.float32)


def _buffer(path: Path, n: int = 130, **kw) -> ReplayBuffer:
    buf = ReplayBuffer.create(path, capacity=CAPACITY, chunk_transitions=16, seed=0,
                              fields={"obs": FieldSpec(ROW, "float32"),
                                      "reward": FieldSpec((), "float32")}, **kw)
    ids = np.arange(n)
    buf.extend({"obs": _obs(ids), "reward": ids.astype(np.float32)})
    return buf


def _naive(col, slots: np.ndarray) -> np.ndarray:
    """Each row read on its own from the column's ``.npy`` file."""
    data = np.load(col.path, mmap_mode="r")
    return np.stack([np.array(data[s]) for s in slots.tolist()])


@settings(max_examples=30, deadline=None)
@given(slots=st.lists(st.integers(-CAPACITY, CAPACITY - 1), min_size=64, max_size=200),
       rounds=st.integers(1, 4), pread=st.booleans(), parallel=st.booleans())
def test_pooled_gather_equals_row_by_row_reads(tmp_path_factory, slots, rounds, pread,
                                               parallel):
    # parallel: parts of 256 KiB, so these gathers (1-3 MiB) split over the copy threads
    with (mock.patch.object(copy_threads, "COPY_PART_BYTES", 1 << 18) if parallel
          else contextlib.nullcontext()):
        check_pooled_gather(tmp_path_factory.mktemp("p") / "b", slots, rounds, pread)


def check_pooled_gather(path: Path, slots: list[int], rounds: int, pread: bool) -> None:
    buf = _buffer(path)
    col = buf._storage.working.columns["obs"]
    col.random_reads = pread  # the map or one pread per row (tiers larger than memory)
    assert col.random_reads == pread
    idx = np.array([s % CAPACITY for s in slots] if pread else slots, dtype=np.int64)
    assert len(idx) * col.spec.item_bytes >= MIN_BYTES  # the pooled path
    want = _naive(col, idx)
    for _ in range(rounds):  # later rounds reuse the dropped output
        got = col.gather(idx)
        assert got.shape == (len(idx), *ROW) and got.dtype == np.float32
        assert got.tobytes() == want.tobytes()
        del got
    buf.close()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), threads=st.integers(1, copy_threads.COPY_THREADS),
       piece=st.integers(1, 1 << 16), seed=st.integers(0, 2**32 - 1))
def test_take_in_pieces_equals_numpy_indexing(n, threads, piece, seed):
    """Any number of threads and pieces (from one piece per thread, some empty, to one per
    row) gives ``rows[slots]`` in ``out``, negative slots counting from the end as numpy's."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (50, 33, 7), dtype=np.uint8)
    slots = rng.integers(-50, 50, n)
    out = np.empty((n, 33, 7), np.uint8)
    with (mock.patch.object(copy_threads, "copy_parts", lambda nbytes: threads),
          mock.patch.object(copy_threads, "COPY_PIECE_BYTES", piece)):
        got = copy_threads.take_rows(rows, slots, out)
    assert got is out
    assert got.tobytes() == rows[slots].tobytes()


def test_copy_parts_per_part_bytes_threads_and_cpus():
    part, cpus = copy_threads.COPY_PART_BYTES, len(os.sched_getaffinity(0))
    assert copy_threads.copy_parts(0) == copy_threads.copy_parts(2 * part - 1) == 1
    assert copy_threads.copy_parts(2 * part) == min(2, cpus)
    assert copy_threads.copy_parts(100 * part) == min(copy_threads.COPY_THREADS, cpus)
    with mock.patch.object(os, "sched_getaffinity", lambda pid: {0}):
        assert copy_threads.copy_parts(100 * part) == 1


def test_gather_refuses_slots_out_of_range(tmp_path):
    buf = _buffer(tmp_path / "b")
    col = buf._storage.working.columns["obs"]
    for bad in (CAPACITY, -CAPACITY - 1):
        idx = np.r_[np.arange(70), bad]
        with pytest.raises(IndexError, match=f"slot {bad}"):
            col.gather(idx)
    with pytest.raises(IndexError):  # float slots are refused, as numpy indexing does
        col.gather(np.arange(70, dtype=np.float64))
    buf.close()


@pytest.mark.parametrize("per", [False, True])
def test_held_batches_are_never_overwritten(tmp_path, per):
    buf = _buffer(tmp_path / "b", sampler=PrioritizedSampler() if per else None)
    rng = np.random.default_rng(1)
    held = []
    for k in range(12):
        batch = buf.sample(96, rng=rng)
        ids = batch["indices"]
        assert batch["obs"].tobytes() == _obs(ids).tobytes()  # the right rows
        assert np.array_equal(batch["reward"], ids.astype(np.float32))
        if k % 3 == 0:  # kept in the three ways callers keep batches
            keep = [batch["obs"], batch["obs"][5:], torch.from_numpy(batch["obs"]),
                    memoryview(batch["obs"])][k // 3]
            held.append((keep, ids))
        del batch
    for keep, ids in held:
        arr = np.asarray(keep.numpy() if isinstance(keep, torch.Tensor) else keep)
        want = _obs(ids)[5:] if arr.shape[0] == len(ids) - 5 else _obs(ids)
        assert arr.tobytes() == want.tobytes()
    buf.close()


def test_pool_reuses_only_what_no_one_holds():
    pool = OutputPool(kept=2, min_bytes=1024)
    a = pool.empty((8, 256), np.float32)
    addr_a = a.ctypes.data
    view = a[1:]
    del a
    b = pool.empty((8, 256), np.float32)  # a is still reachable through the view
    assert b.ctypes.data != addr_a
    del view
    b_addr = b.ctypes.data
    c = pool.empty((8, 256), np.float32)  # a is free again; b is held
    assert c.ctypes.data == addr_a
    assert pool.empty((4, 256), np.float32).ctypes.data not in (addr_a, b_addr)  # other shape
    small = pool.empty((2, 2), np.float32)  # under min_bytes: never kept
    assert all(x is not small for x in pool._arrays)
    assert len(pool._arrays) == 2
    pool.clear()
    assert pool._arrays == []
