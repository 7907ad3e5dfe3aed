"""Background saves: the commit is the buffer as of the save call, while adds, samples and
priority updates go on; a second save waits for the first; a failed one loses nothing and is
never silent."""

import concurrent.futures
import threading

import numpy as np
import pytest

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.storage.zarr_tier import ZarrTier
from tests.conftest import assert_rows_are, make_batch


@pytest.fixture
def slow_stage(monkeypatch):
    """Hold every chunk write of a background save until the test opens the gate, so what the
    test does meanwhile certainly overlaps the save. Returns the gate (a threading.Event)."""
    gate = threading.Event()
    real = ZarrTier.stage_chunks

    def held(self, commit, name, c, data):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(timeout=60), "the test never opened the gate"
        return real(self, commit, name, c, data)

    monkeypatch.setattr(ZarrTier, "stage_chunks", held)
    return gate


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
    slow_stage.set()
    report = fut.result()
    assert report.commit == 1 and buf.commit == 1
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
    assert not fut.done()
    slow_stage.set()
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


def test_second_save_waits_and_commits_are_ordered(tmp_path, fields, slow_stage,
                                                       monkeypatch):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=40, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 20))
    first = buf.save(background=True)
    buf.extend(make_batch(20, 3))
    real_wait, running_when_waited = concurrent.futures.wait, []

    def wait(fs, *a, **k):  # the second save waits here: the first is still held at the gate
        running_when_waited.append(not first.done())
        slow_stage.set()
        return real_wait(fs, *a, **k)

    monkeypatch.setattr(concurrent.futures, "wait", wait)
    second = buf.save(background=True)
    assert running_when_waited == [True]
    assert first.done()
    assert (first.result().commit, second.result().commit) == (1, 2)
    buf.close()
    with ReplayBuffer.open(tmp_path / "b") as b:
        assert_rows_are(b[:], np.arange(23))


def test_failed_background_save_keeps_changes_pending(tmp_path, fields, monkeypatch):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=20, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 10))

    def broken(self, *a, **k):
        raise OSError(28, "No space left on device")

    real = ZarrTier.stage_chunks
    monkeypatch.setattr(ZarrTier, "stage_chunks", broken)
    fut = buf.save(background=True)
    with pytest.raises(OSError, match="No space left"):
        fut.result()
    assert buf.commit == 0
    monkeypatch.setattr(ZarrTier, "stage_chunks", real)
    assert buf.save().commit == 1
    buf.close()
    with ReplayBuffer.open(tmp_path / "b") as b:
        assert_rows_are(b[:], np.arange(10))


def _broken_background_save(buf, monkeypatch):
    def broken(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ZarrTier, "stage_chunks", broken)
    buf.save(background=True)  # nobody asks its future


@pytest.mark.parametrize("then", ["close", "wait_for_save", "save"])
def test_unseen_background_failure_raises_at_the_next_call(tmp_path, fields, monkeypatch, then):
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=20, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 10))
    buf.save()
    buf.extend(make_batch(10, 5))
    _broken_background_save(buf, monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        getattr(buf, then)()
    monkeypatch.undo()
    if then == "close":  # raised after releasing its files: the buffer is closed
        with pytest.raises(ValueError, match="closed"):
            buf.sample(1)
    else:  # raised once; the failed save's changes are still pending
        buf.wait_for_save()
        assert buf.save().commit == 2
        buf.close()
    with ReplayBuffer.open(path, mode="r") as ro:
        want = np.arange(15) if then != "close" else np.arange(10)
        assert_rows_are(ro[:], want)


def test_background_failure_seen_through_the_future_is_not_raised_again(
        tmp_path, fields, monkeypatch):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=20, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 10))
    monkeypatch.setattr(ZarrTier, "stage_chunks",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(5, "I/O error")))
    fut = buf.save(background=True)
    assert isinstance(fut.exception(), OSError)
    monkeypatch.undo()
    buf.close()  # no second report of the same failure
