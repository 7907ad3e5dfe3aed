"""Deterministic crash and I/O-error injection (tests/faults.py): a save, and a buffer's
creation, are cut at every one of their filesystem operations in turn. After each cut the
buffer must open at exactly the previous or the new commit, never a mix, and a retry must
succeed."""

import errno
import shutil

import numpy as np
import pytest

from rlbuffers import FieldSpec, NotABufferError, PrioritizedSampler, ReplayBuffer
from rlbuffers.maintenance.inspection import inspect_path
from tests.faults import FaultInjector, SimulatedCrash

FIELDS = {"x": FieldSpec((2,), "int64"), "tokens": FieldSpec((None,), "int32"),
          "terminated": FieldSpec((), "bool")}
CAPACITY, CHUNK = 16, 4


def batch(first: int, n: int) -> dict:
    ids = np.arange(first, first + n)
    return {"x": np.stack([ids, -ids], 1), "tokens": [np.full(i % 5, i, np.int32) for i in ids],
            "terminated": ids % 7 == 6}


def check(buf: ReplayBuffer, total: int) -> None:
    """``buf`` holds exactly the newest transitions of the first ``total``."""
    ids = np.arange(max(0, total - CAPACITY), total)
    assert (buf.total_added, len(buf), buf.metadata) == (total, len(ids), {"total": total})
    rows = buf[:]
    np.testing.assert_array_equal(rows["x"][:, 0], ids)
    for got, i in zip(rows["tokens"], ids, strict=True):
        np.testing.assert_array_equal(got, np.full(i % 5, i, np.int32))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A buffer with two commits (10 then 14 transitions), so a save also reclaims one."""
    path = tmp_path_factory.mktemp("template") / "buf"
    with ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS, chunk_transitions=CHUNK,
                             sampler=PrioritizedSampler(), seed=1) as buf:
        buf.extend(batch(0, 10))
        buf.save(metadata={"total": 10})
        buf.extend(batch(10, 4))
        buf.save(metadata={"total": 14})
    return path


def _save_under(injector: FaultInjector, path) -> tuple[int | None, BaseException | None]:
    """Open ``path``, add 6 transitions (the ring wraps) and save with ``injector`` on."""
    buf = ReplayBuffer.open(path)
    buf.extend(batch(14, 6))
    s = buf.sample(4)
    buf.update_priorities(s["indices"], np.arange(4.0))
    try:
        with injector.installed():
            return buf.save(metadata={"total": 20}).commit, None
    except (SimulatedCrash, OSError) as e:
        return None, e
    finally:
        if not injector.crashed:
            buf.close()
        else:  # the "dead" process's writer lock: the kernel releases a dead process's flock
            buf._lock.release()


def _after(path) -> int:
    """Open the buffer as a reader and as a writer; both see one whole commit. Returns it."""
    report = inspect_path(path, verify=True)
    assert report["corrupt"] == []
    with ReplayBuffer.open(path, mode="r") as ro:
        gen, total = ro.commit, ro.total_added
        assert (gen, total) in ((2, 14), (3, 20))
        check(ro, total)
    with ReplayBuffer.open(path) as rw:
        assert rw.commit == gen
        check(rw, total)
        assert not [d for d in (path / "versions").iterdir() if int(d.name[1:]) > gen]
        if gen == 2:  # the retry
            rw.extend(batch(14, 6))
            assert rw.save(metadata={"total": 20}).commit == 3
            check(rw, 20)
    return gen


def _ops_of_one_save(template, tmp_path) -> int:
    counter = FaultInjector()
    shutil.copytree(template, tmp_path / "count")
    assert _save_under(counter, tmp_path / "count") == (3, None)
    kinds = {op.split()[0] for op in counter.ops}
    assert {"write", "fsync", "rename", "unlink", "mkdir"} <= kinds, kinds
    return counter.count


def test_crash_at_every_operation_of_a_save(template, tmp_path):
    n = _ops_of_one_save(template, tmp_path)
    outcomes = {2: 0, 3: 0}
    for k in range(1, n + 1):
        path = tmp_path / f"k{k}"
        shutil.copytree(template, path)
        gen, error = _save_under(FaultInjector(at=k, mode="crash"), path)
        assert gen is None and isinstance(error, SimulatedCrash), (k, gen, error)
        outcomes[_after(path)] += 1
        shutil.rmtree(path)
    # cuts before the manifest's rename keep the old commit; cuts after it keep the new one
    assert outcomes[2] > 0 and outcomes[3] > 0, outcomes
    print(f"save: {n} operations, crash at each: old commit {outcomes[2]}, new {outcomes[3]}")


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_io_error_at_every_operation_of_a_save(template, tmp_path, code):
    n = _ops_of_one_save(template, tmp_path)
    raised = 0
    for k in range(1, n + 1):
        path = tmp_path / f"k{k}"
        shutil.copytree(template, path)
        gen, error = _save_under(FaultInjector(at=k, mode="error", error=code), path)
        assert (gen == 3) != (error is not None), (k, gen, error)
        if error is not None:
            raised += 1
            assert isinstance(error, OSError) and error.errno == code
        _after(path)
        shutil.rmtree(path)
    assert raised > 0


def test_crash_at_every_operation_of_create(tmp_path):
    counter = FaultInjector()
    with counter.installed():
        ReplayBuffer.create(tmp_path / "count", capacity=CAPACITY, fields=FIELDS).close()
    for k in range(1, counter.count + 1):
        path = tmp_path / f"k{k}"
        try:
            with FaultInjector(at=k, mode="crash").installed():
                ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS)
        except SimulatedCrash:
            pass
        try:  # either a whole empty buffer, or nothing that stops a new create
            with ReplayBuffer.open(path) as buf:
                assert (buf.commit, len(buf)) == (0, 0)
        except NotABufferError:
            ReplayBuffer.create(path, capacity=CAPACITY, fields=FIELDS).close()
        with ReplayBuffer.open(path) as buf:
            buf.extend(batch(0, 3))
            assert buf.save(metadata={"total": 3}).commit == 1
