"""Commits as snapshots: a reader holds one commit whatever the writer does; the newest
``keep_commits`` commits stay readable; older ones are reclaimed with their bytes
reported; a chunk the commit lists but storage lost is corrupt, never zeros."""

import json
import os

import numpy as np
import pytest

from rlbuffers import CorruptChunkError, ReplayBuffer
from rlbuffers.cli import main
from rlbuffers.errors import SnapshotReclaimedError
from rlbuffers.storage.location import make_location
from rlbuffers.storage.zarr_tier import ZarrTier
from tests.conftest import assert_rows_are, make_batch


def _writer(path, fields, keep=2):
    return ReplayBuffer.create(path, capacity=12, fields=fields, chunk_transitions=4,
                               keep_commits=keep)


def test_reader_keeps_its_commit_while_the_writer_saves(tmp_path, fields):
    path = tmp_path / "b"
    w = _writer(path, fields, keep=3)
    w.extend(make_batch(0, 8))
    w.save()
    ro = ReplayBuffer.open(path, mode="r")
    w.extend(make_batch(8, 6))  # overwrites slots 8..11 and 0..1
    w.save()
    assert ro.commit == 1
    assert_rows_are(ro[:], np.arange(8))  # the snapshot, not a mix
    assert_rows_are(ro[np.array([0, 7])], np.array([0, 7]))
    ro.refresh()
    assert (ro.commit, ro.total_added) == (2, 14)
    assert_rows_are(ro[:], np.arange(2, 14))
    ro.close()
    w.close()


def test_kept_commits_open_and_older_ones_are_reclaimed(tmp_path, fields):
    path = tmp_path / "b"
    w = _writer(path, fields, keep=2)
    reports = []
    for g in range(4):
        w.extend(make_batch(5 * g, 5))
        reports.append(w.save(metadata={"g": g + 1}))
    assert [r.commit for r in reports] == [1, 2, 3, 4]
    assert reports[-1].bytes_reclaimed > 0  # chunk versions only commit 2 used
    with ReplayBuffer.open(path, mode="r", commit=3) as old:
        assert (old.metadata, old.total_added) == ({"g": 3}, 15)
        assert_rows_are(old[:], np.arange(3, 15))
    with pytest.raises(SnapshotReclaimedError, match=r"commit 2 is not kept; kept: 3..4"):
        ReplayBuffer.open(path, mode="r", commit=2)
    with pytest.raises(ValueError, match="'r' with commit"):
        ReplayBuffer.open(path, commit=3)
    assert sorted(os.listdir(path / "history")) == ["g3.json", "g4.json"]
    w.close()


def _without_leases(monkeypatch):
    """A reader that cannot take a lease (a read-only filesystem, a URL buffer): its commit is
    kept for keep_commits saves only (tests/test_reader_leases.py covers leased readers)."""
    from rlbuffers.storage.lease import ReaderLease

    monkeypatch.setattr(ReaderLease, "take", classmethod(lambda cls, loc, commit: None))


def test_reader_whose_commit_was_reclaimed_is_told_to_refresh(tmp_path, fields, monkeypatch):
    _without_leases(monkeypatch)
    path = tmp_path / "b"
    w = _writer(path, fields, keep=1)
    w.extend(make_batch(0, 12))
    w.save()
    ro = ReplayBuffer.open(path, mode="r")
    w.extend(make_batch(12, 12))  # every chunk rewritten: commit 1's versions all go
    w.save()
    with pytest.raises(SnapshotReclaimedError, match="call refresh"):
        ro[:]
    ro.refresh()
    assert_rows_are(ro[:], np.arange(12, 24))
    ro.close()
    w.close()


def test_commit_reclaimed_between_the_check_and_the_read_is_told_to_refresh(
        tmp_path, fields, monkeypatch):
    """The writer may delete a chunk version after the reader checked it is there and before
    zarr opens it (zarr then raises ArrayNotFoundError, an OSError): the reader still says
    SnapshotReclaimedError, and refresh() reads the new commit."""
    from rlbuffers.storage.zarr_tier import ZarrTier

    _without_leases(monkeypatch)
    path = tmp_path / "b"
    w = _writer(path, fields, keep=1)
    w.extend(make_batch(0, 12))
    w.save()
    ro = ReplayBuffer.open(path, mode="r")
    w.extend(make_batch(12, 12))
    w.save()
    real = ZarrTier._check_present
    monkeypatch.setattr(ZarrTier, "_check_present", lambda *a: None)  # the check passed
    with pytest.raises(SnapshotReclaimedError, match="call refresh"):
        ro[:]
    monkeypatch.setattr(ZarrTier, "_check_present", real)
    ro.refresh()
    assert_rows_are(ro[:], np.arange(12, 24))
    ro.close()
    w.close()


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_missing_or_truncated_chunk_is_corrupt_not_zeros(tmp_path, fields, capsys, damage):
    path = tmp_path / "b"
    with _writer(path, fields) as w:
        w.extend(make_batch(0, 10))
        w.save()
    chunk = path / ZarrTier.open(make_location(path)).chunk_path("tokens", 1)
    if damage == "delete":
        os.remove(chunk)
    else:
        chunk.write_bytes(chunk.read_bytes()[:-3])
    reason = "missing" if damage == "delete" else "truncated"
    with ReplayBuffer.open(path, mode="r") as ro, pytest.raises(CorruptChunkError, match=reason):
        ro[5]
    assert main(["inspect", str(path), "--json", "--verify"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(c["field"], c["chunk"]) for c in report["corrupt"]] == [("tokens", 1)]
    assert reason in report["corrupt"][0]["reason"]
    os.remove(path / ".working" / "state.json")  # the writer's rebuild reads every chunk
    with pytest.raises(CorruptChunkError, match=reason):
        ReplayBuffer.open(path)


def test_bad_keep_commits_is_named(tmp_path, fields):
    with pytest.raises(ValueError, match="keep_commits: expected a positive integer, got 0"):
        ReplayBuffer.create(tmp_path / "b", capacity=4, fields=fields, keep_commits=0)


def test_inspect_a_kept_commit(tmp_path, fields, capsys):
    path = tmp_path / "b"
    with _writer(path, fields, keep=2) as w:
        for g in range(3):
            w.extend(make_batch(4 * g, 4))
            w.save(metadata={"g": g + 1})
    assert main(["inspect", str(path), "--json", "--commit", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["commit"], r["total_added"], r["metadata"]) == (2, 8, {"g": 2})
    assert main(["inspect", str(path), "--commit", "1"]) == 2
    assert "commit 1 is not kept" in capsys.readouterr().err
