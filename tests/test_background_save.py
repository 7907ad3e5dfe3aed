"""Background saves: the commit is the buffer as of the save call, while adds, samples and
priority updates go on; a second save waits for the first; a failed one loses nothing."""

import time

import numpy as np
import pytest

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.storage.persistent import PersistentTier
from tests.conftest import assert_rows_are, make_batch


@pytest.fixture
def slow_stage(monkeypatch):
    """Make every chunk write take 20 ms so the save is still running while we add."""
    real = PersistentTier.stage_chunks

    def slow(self, generation, name, c, data):
        time.sleep(0.02 * -(-len(data) // self.chunks[name]))
        return real(self, generation, name, c, data)

    monkeypatch.setattr(PersistentTier, "stage_chunks", slow)


def test_commit_is_the_snapshot_at_save_time(tmp_path, fields, slow_stage):
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=40, fields=fields, chunk_transitions=4, seed=5)
    buf.extend(make_batch(0, 30))
    fut = buf.save(background=True, metadata={"total": 30})
    expected_sample = None
    # overwrite chunks the save has not read yet, wrap the ring, sample, while it runs
    for k in range(4):
        buf.extend(make_batch(30 + 5 * k, 5))
        assert_rows_are(buf[:], np.arange(max(0, 35 + 5 * k - 40), 35 + 5 * k))
        buf.sample(8)
    assert not fut.done()  # the adds really overlapped the save
    report = fut.result()
    assert report.generation == 1 and buf.generation == 1
    with ReplayBuffer.open(path, mode="r") as ro:
        assert (ro.total_added, ro.metadata) == (30, {"total": 30})
        assert_rows_are(ro[:], np.arange(30))
        expected_sample = ro.sample(16)["indices"]
    buf.save()
    buf.close()
    with ReplayBuffer.open(path) as b:
        assert_rows_are(b[:], np.arange(10, 50))
    # the RNG state committed by the background save is the one at its call
    fresh = ReplayBuffer.create(tmp_path / "c", capacity=40, fields=fields, chunk_transitions=4,
                                seed=5)
    fresh.extend(make_batch(0, 30))
    np.testing.assert_array_equal(fresh.sample(16)["indices"], expected_sample)


def test_priority_updates_during_background_save(tmp_path, slow_stage):
    fields = {"x": FieldSpec((), "int64")}
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=64, fields=fields, chunk_transitions=4,
                              sampler=PrioritizedSampler(alpha=1.0))
    buf.extend({"x": np.arange(64)})
    buf.update_priorities(np.arange(64), np.full(64, 2.0))
    fut = buf.save(background=True)
    buf.update_priorities(np.arange(64), np.arange(64, dtype=float))  # all chunks, mid-save
    fut.result()
    with ReplayBuffer.open(path, mode="r") as ro:
        s = ro.sample(2000)
        assert np.allclose(s["weights"], 1.0)  # equal priorities 2.0: the snapshot, not 0..63
    buf.save()
    buf.close()
    with ReplayBuffer.open(path) as b:
        s = b.sample(20000)
        assert 0 not in s["x"]  # priority 0 (+eps) is now committed for id 0
        assert np.mean(s["x"]) > 40


def test_second_save_waits_and_generations_are_ordered(tmp_path, fields, slow_stage):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=40, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 20))
    first = buf.save(background=True)
    buf.extend(make_batch(20, 3))
    second = buf.save(background=True)
    assert first.done()
    assert (first.result().generation, second.result().generation) == (1, 2)
    buf.close()
    with ReplayBuffer.open(tmp_path / "b") as b:
        assert_rows_are(b[:], np.arange(23))


def test_failed_background_save_keeps_changes_pending(tmp_path, fields, monkeypatch):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=20, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 10))

    def broken(self, *a, **k):
        raise OSError(28, "No space left on device")

    real = PersistentTier.stage_chunks
    monkeypatch.setattr(PersistentTier, "stage_chunks", broken)
    fut = buf.save(background=True)
    with pytest.raises(OSError, match="No space left"):
        fut.result()
    assert buf.generation == 0
    monkeypatch.setattr(PersistentTier, "stage_chunks", real)
    assert buf.save().generation == 1
    buf.close()
    with ReplayBuffer.open(tmp_path / "b") as b:
        assert_rows_are(b[:], np.arange(10))
