"""What the library logs reads as what happened: one human line per commit (not a repr), and
a new buffer is created without the crash-recovery lines a reopened one may print."""

from __future__ import annotations

import logging

import numpy as np

from rlbuffers import FieldSpec, ReplayBuffer, SaveReport

FIELDS = {"x": FieldSpec((3,), "float32"), "tokens": FieldSpec((None,), "int32")}


def _fill(buf: ReplayBuffer, n: int) -> None:
    for i in range(n):
        buf.add(x=np.full(3, i, np.float32), tokens=np.arange(i % 4 + 1, dtype=np.int32))


def test_save_report_reads_as_one_human_line():
    assert str(SaveReport(3, 12, 4_300_000, 10_300_000, 0.812)) == (
        "commit 3: 12 chunks, 4.1 MiB written (9.8 MiB raw) in 0.81 s")
    assert str(SaveReport(1, 1, 360, 324, 0.07, bytes_reclaimed=5 * 2**30)) == (
        "commit 1: 1 chunk, 360 B written (324 B raw) in 0.07 s, 5.0 GiB reclaimed")


def test_a_commit_logs_one_human_line(tmp_path, caplog):
    # the saver's own logger: a trainer run earlier in this process may have quietened it
    caplog.set_level(logging.INFO, logger="rlbuffers.storage.saver")
    with ReplayBuffer.create(tmp_path / "b", capacity=64, fields=FIELDS, seed=0) as buf:
        _fill(buf, 10)
        report = buf.save()
    lines = [r.getMessage() for r in caplog.records if "commit 1:" in r.getMessage()]
    assert lines == [f"{tmp_path / 'b'}: {report}"]
    assert not any("SaveReport(" in r.getMessage() for r in caplog.records)


def test_a_new_buffer_is_created_without_recovery_lines(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="rlbuffers")
    with ReplayBuffer.create(tmp_path / "b", capacity=64, fields=FIELDS, seed=0,
                             chunk_transitions=8) as buf:
        assert len(buf) == 0
        _fill(buf, 20)
        first = buf.sample(8, rng=np.random.default_rng(1))
        buf.save()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "unusable" in m or "restoring" in m or "rebuild" in m]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the new tier really is empty and usable: what was added reads back after a reopen
    with ReplayBuffer.open(tmp_path / "b", mode="r") as buf:
        again = buf.sample(8, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(first["x"], again["x"])
    assert [t.tolist() for t in first["tokens"]] == [t.tolist() for t in again["tokens"]]


def test_a_reopened_writer_says_which_chunks_it_restores(tmp_path, caplog):
    with ReplayBuffer.create(tmp_path / "b", capacity=64, fields=FIELDS, seed=0,
                             chunk_transitions=8) as buf:
        _fill(buf, 20)
        buf.save()
        _fill(buf, 5)  # added after the commit: discarded on open, its chunk restored
    caplog.set_level(logging.INFO, logger="rlbuffers")
    with ReplayBuffer.open(tmp_path / "b") as buf:
        assert len(buf) == 20
    restoring = [r.getMessage() for r in caplog.records if "restoring" in r.getMessage()]
    assert restoring == [f"{tmp_path / 'b'}: restoring 2 chunk(s) of the working tier from "
                         "commit 1"]
