"""Exact round trips of every field kind through add/extend, save, open and rebuild."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.maintenance.export import export_commit
from rlbuffers.maintenance.inspection import inspect_path
from tests.conftest import assert_rows_are, make_batch


def test_add_then_read_every_kind(tmp_path, fields):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=20, fields=fields, chunk_transitions=4)
    one = make_batch(0, 5)
    for i in range(5):
        buf.add(**{k: v[i] for k, v in one.items()})
    assert len(buf) == 5
    assert_rows_are(buf[:], np.arange(5))
    row = buf[3]
    np.testing.assert_array_equal(row["obs"], [3, -3, 1.5])
    np.testing.assert_array_equal(row["tokens"], np.arange(3, dtype=np.int32) + 3)


def test_ring_wraparound_keeps_newest(tmp_path, fields):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=10, fields=fields, chunk_transitions=3)
    buf.extend(make_batch(0, 7))
    buf.extend(make_batch(7, 8))  # 15 added, capacity 10 -> ids 5..14
    assert len(buf) == 10 and buf.total_added == 15
    assert_rows_are(buf[:], np.arange(5, 15))
    assert_rows_are(buf[np.array([0, -1, 4])], np.array([5, 14, 9]))
    assert_rows_are(buf[2:8:2], np.array([7, 9, 11]))


def test_extend_larger_than_capacity(tmp_path, fields):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=6, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 3))
    buf.extend(make_batch(3, 14))
    assert buf.total_added == 17
    assert_rows_are(buf[:], np.arange(11, 17))


@pytest.mark.parametrize("codec", ["blosc-zstd", "blosc-lz4", "zstd", "none"])
def test_save_open_exact(tmp_path, fields, codec):
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=12, fields=fields, chunk_transitions=5, codec=codec)
    buf.extend(make_batch(0, 9))
    buf.save()
    buf.extend(make_batch(9, 7))  # wraps the ring; ids 4..15
    report = buf.save(metadata={"step": 16})
    assert report.commit == 2 and report.chunks_written > 0 and report.bytes_written > 0
    buf.close()
    with ReplayBuffer.open(path) as again:
        assert (len(again), again.total_added, again.metadata) == (12, 16, {"step": 16})
        assert_rows_are(again[:], np.arange(4, 16))


def _committed(path, fields, n: int) -> None:
    """A closed buffer (capacity 12, chunks of 5) whose last commit holds ids ``0 .. n-1``."""
    with ReplayBuffer.create(path, capacity=12, fields=fields, chunk_transitions=5) as buf:
        buf.extend(make_batch(0, n))
        buf.save()


def test_rebuild_from_persistent_tier_alone(tmp_path, fields):
    path = tmp_path / "b"
    _committed(path, fields, 17)
    shutil.rmtree(path / ".working")
    moved = tmp_path / "moved"
    shutil.copytree(path, moved)  # a buffer copied elsewhere (no working tier) opens too
    for p in (path, moved):
        with ReplayBuffer.open(p) as b:
            assert_rows_are(b[:], np.arange(5, 17))


def test_working_tier_of_another_boot_is_rebuilt(tmp_path, fields):
    # Saves do not fsync the working tier: after an OS crash its pages may be stale, so a tier
    # whose state.json was written in another boot is rebuilt from the persistent tier.
    path = tmp_path / "b"
    _committed(path, fields, 12)
    work = path / ".working"
    np.lib.format.open_memmap(work / "action.npy", mode="r+")[:] = -1  # lost pages
    with ReplayBuffer.open(path) as b:  # same boot: the tier is trusted as it is
        assert (b[:]["action"] == -1).all()
    state = json.loads((work / "state.json").read_text())
    assert state["boot_id"]
    (work / "state.json").write_text(json.dumps({**state, "boot_id": "an-earlier-boot"}))
    with ReplayBuffer.open(path) as b:
        assert_rows_are(b[:], np.arange(12))


def test_unsaved_changes_are_discarded_on_reopen(tmp_path, fields):
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=10, fields=fields, chunk_transitions=4)
    buf.extend(make_batch(0, 6))
    buf.save()
    buf.extend(make_batch(6, 7))  # overwrites committed slots in the working tier
    buf.close()
    with ReplayBuffer.open(path) as b:
        assert b.total_added == 6
        assert_rows_are(b[:], np.arange(6))


def test_incremental_save_writes_only_changed_chunks(tmp_path, fields):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=100, fields=fields, chunk_transitions=10)
    buf.extend(make_batch(0, 100))
    full = buf.save()
    buf.extend(make_batch(100, 3))  # slots 0..2 -> chunk 0 only
    inc = buf.save()
    # Ragged fields (tokens, points) keep 10-transition chunks. The fixed fields (frame, obs,
    # reward, action, terminated, and the internal episode id) are each smaller in all than one
    # chunk of the largest field (points: 10 x 256 guessed rows x 16 bytes), so each is stored
    # as one chunk of all 100 transitions.
    n_ragged, n_fixed = 2, 6
    assert full.chunks_written == n_ragged * 10 + n_fixed * 1
    assert inc.chunks_written == n_ragged + n_fixed  # chunk 0 of every field
    assert buf.save().chunks_written == 0
    assert buf.save(full=True).chunks_written == n_ragged * 10 + n_fixed


def test_read_only_mode(tmp_path, fields):
    path = tmp_path / "b"
    with ReplayBuffer.create(path, capacity=10, fields=fields, chunk_transitions=4) as buf:
        buf.extend(make_batch(0, 13))
        buf.save()
    ro = ReplayBuffer.open(path, mode="r")
    assert_rows_are(ro[:], np.arange(3, 13))
    assert set(ro.sample(5)) >= set(fields) | {"indices", "weights"}


def plain_zarr_column(buf: str, name: str):
    """The recipe of docs/format.md: a column of the last commit with plain zarr + json."""
    m = json.loads(Path(f"{buf}/manifest.json").read_text())
    base = zarr.open_array(f"{buf}/{name}", mode="r")
    out = base[:]  # the fill value where no chunk was ever written
    for c, g, _ in m["chunks"][name]:
        arr = base if g == 0 else zarr.open_array(f"{buf}/versions/g{g}/{name}", mode="r")
        k = arr.chunks[0]
        out[c * k:(c + 1) * k] = arr[c * k:(c + 1) * k]
    order = (m["cursor"] - m["size"] + np.arange(m["size"])) % m["capacity"]
    return out[order]  # oldest first


def test_plain_zarr_reads_the_committed_data(tmp_path, fields):
    path = tmp_path / "b"
    with ReplayBuffer.create(path, capacity=10, fields=fields, chunk_transitions=4) as buf:
        buf.extend(make_batch(0, 7))
        buf.save()
        buf.extend(make_batch(7, 6))  # wraps: chunk versions of two commits
        buf.save()
    np.testing.assert_array_equal(plain_zarr_column(path, "obs"), make_batch(3, 10)["obs"])
    tokens = plain_zarr_column(path, "tokens")
    for raw, want in zip(tokens, make_batch(3, 10)["tokens"], strict=True):
        np.testing.assert_array_equal(np.frombuffer(raw, dtype=np.int32), want)
    # export: the same commit as one plain array per field
    committed = json.loads((path / "manifest.json").read_text())["chunks"]
    assert export_commit(path, tmp_path / "plain") == {
        "commit": 2, "chunks": sum(len(rows) for rows in committed.values())}
    group = zarr.open_group(tmp_path / "plain", mode="r")
    m = group.attrs["rlbuffers"]["manifest"]
    order = (m["cursor"] - m["size"] + np.arange(m["size"])) % m["capacity"]
    np.testing.assert_array_equal(group["obs"][:][order], make_batch(3, 10)["obs"])


def test_episode_ids_follow_terminated_flags(tmp_path, fields):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=50, fields=fields, chunk_transitions=8)
    buf.extend(make_batch(0, 20, done_every=5))
    assert buf.episodes == 4
    buf.save()
    buf.close()
    assert ReplayBuffer.open(tmp_path / "b").episodes == 4


def test_small_fields_store_several_base_chunks_per_chunk(tmp_path):
    """Atari-like rows: obs (4,096 bytes) keeps 16-transition chunks of 64 KiB; 8-byte actions
    store 64 KiB / (16 x 8) = 512 base chunks per chunk; 1-byte flags would take 4,096, capped
    at the capacity (1,250 base chunks). A +2% save writes one chunk of each small field."""
    fields = {"obs": FieldSpec((4, 4, 16, 16), "uint8"), "action": FieldSpec((), "int64"),
              "terminated": FieldSpec((), "bool")}
    path = tmp_path / "b"
    buf = ReplayBuffer.create(path, capacity=20_000, fields=fields, chunk_transitions=16)
    ids = np.arange(20_000)
    batch = {"obs": (ids % 251).astype(np.uint8)[:, None, None, None, None]
             + np.zeros((1, 4, 4, 16, 16), np.uint8),
             "action": ids.astype(np.int64), "terminated": ids % 100 == 99}
    buf.extend(batch)
    buf.save()
    report = inspect_path(path)["fields"]
    assert [report[n]["chunk_transitions"] for n in fields] == [16, 8192, 20_000]
    assert [report[n]["chunks"] for n in fields] == [1250, 3, 1]
    buf.extend({k: v[:400] for k, v in batch.items()})  # slots 0..399: 25 obs chunks
    inc = buf.save()
    assert inc.chunks_written == 25 + 1 + 1 + 1  # obs, action, terminated, episode id
    buf.close()
    with ReplayBuffer.open(path) as b:
        got = b[:]
    want = np.concatenate([ids[400:], ids[:400]])
    np.testing.assert_array_equal(got["action"], want)
    np.testing.assert_array_equal(got["obs"][:, 0, 0, 0, 0], want % 251)
    np.testing.assert_array_equal(got["terminated"], want % 100 == 99)
