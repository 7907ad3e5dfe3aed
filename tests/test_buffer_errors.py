"""Bad input, bad paths, failed saves and corrupt chunks: clear errors, nothing lost."""

import json
import os
import shutil

import numpy as np
import pytest
import zarr.storage

from rlbuffers import (
    BufferEmptyError,
    BufferExistsError,
    CorruptChunkError,
    FieldError,
    FieldSpec,
    FormatVersionError,
    NotABufferError,
    NotPrioritizedError,
    ReadOnlyError,
    ReplayBuffer,
)
from rlbuffers.cli import main
from rlbuffers.storage.location import LocalLocation, make_location
from rlbuffers.storage.manifest import KEEP_COMMITS_KEY
from rlbuffers.storage.zarr_tier import ZarrTier as PersistentTier
from tests.conftest import assert_rows_are, make_batch


@pytest.fixture
def buf(tmp_path, fields):
    b = ReplayBuffer.create(tmp_path / "b", capacity=10, fields=fields, chunk_transitions=4)
    b.extend(make_batch(0, 6))
    return b


def _one(i=6):
    return {k: v[0] for k, v in make_batch(i, 1).items()}


def test_unknown_and_missing_fields(buf):
    with pytest.raises(FieldError, match=r"unknown field\(s\) \['rewrd'\]"):
        buf.add(**{**_one(), "rewrd": 1.0})
    row = _one()
    del row["obs"]
    with pytest.raises(FieldError, match=r"missing field\(s\) \['obs'\]"):
        buf.add(**row)
    assert buf.total_added == 6


def test_wrong_shape_leaves_buffer_unchanged(buf):
    batch = make_batch(6, 3)
    batch["frame"] = np.zeros((3, 6, 6, 4), np.uint8)  # channels-last by mistake
    with pytest.raises(FieldError) as e:
        buf.extend(batch)
    want = "field 'frame': expected shape (B, 4, 6, 6) uint8, got (3, 6, 6, 4) uint8"
    assert want in str(e.value)
    assert buf.total_added == 6 and len(buf) == 6
    assert_rows_are(buf[:], np.arange(6))


def test_wrong_dtype_and_batch_mismatch(buf):
    batch = make_batch(6, 3)
    batch["action"] = np.full(3, 0.5, np.float32)  # whole floats would be accepted
    with pytest.raises(FieldError, match=r"field 'action': value 0.5 \(float32\) does not fit "
                       "dtype int64"):
        buf.extend(batch)
    batch = make_batch(6, 3)
    batch["reward"] = np.zeros(2, np.float32)
    with pytest.raises(FieldError, match="field 'reward': expected batch size 3, got 2"):
        buf.extend(batch)
    assert_rows_are(buf[:], np.arange(6))


def test_bad_field_names_and_specs(tmp_path):
    with pytest.raises(FieldError, match="must not start with '_'"):
        ReplayBuffer.create(tmp_path / "x", capacity=4, fields={"_x": FieldSpec((), "int8")})
    with pytest.raises(FieldError, match="episode-end flags"):
        ReplayBuffer.create(tmp_path / "y", capacity=4, fields={"done": FieldSpec((), "int8")})
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer.create(tmp_path / "z", capacity=0, fields={"a": FieldSpec((), "int8")})
    with pytest.raises(ValueError, match="codec must be one of"):
        ReplayBuffer.create(tmp_path / "w", capacity=4, fields={"a": FieldSpec((), "int8")},
                            codec="gzip")


def test_create_refuses_existing(buf, fields):
    with pytest.raises(BufferExistsError, match="overwrite=True"):
        ReplayBuffer.create(buf.path, capacity=10, fields=fields)
    buf.close()  # one writer at a time: overwrite is refused while a writer has it open
    again = ReplayBuffer.create(buf.path, capacity=5, fields=fields, overwrite=True)
    assert len(again) == 0 and again.capacity == 5


def test_index_and_sample_errors(tmp_path, fields, buf):
    with pytest.raises(IndexError, match=r"index \[6\] out of range for buffer of 6"):
        buf[6]
    empty = ReplayBuffer.create(tmp_path / "e", capacity=4, fields=fields)
    with pytest.raises(BufferEmptyError, match="holds 0 transitions"):
        empty.sample(2)
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(0)
    with pytest.raises(NotPrioritizedError):
        buf.update_priorities([0], [1.0])


def test_not_a_buffer_and_newer_format(tmp_path, buf):
    (tmp_path / "plain").mkdir()
    with pytest.raises(NotABufferError, match="no manifest.json"):
        ReplayBuffer.open(tmp_path / "plain")
    with pytest.raises(NotABufferError, match="no such directory"):
        ReplayBuffer.open(tmp_path / "missing")
    buf.save()
    m = json.loads((buf.path / "manifest.json").read_text())
    m["format_version"] = 99
    (buf.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatVersionError, match="format version 99 is newer"):
        ReplayBuffer.open(buf.path)


def _as_legacy(path, version):
    """Lay a saved buffer out as formats 1-2 did: chunk files in ``<field>/`` itself, no chunk
    table, no kept history (format 1: no per-field chunk sizes either)."""
    m = json.loads((path / "manifest.json").read_text())
    for name, rows in m["chunks"].items():
        for c, g, _ in rows:
            src = path / "versions" / f"g{g}" / name / "c" / str(c)
            dst = path / name / "c" / str(c)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(src, dst)
    shutil.rmtree(path / "versions")
    shutil.rmtree(path / "history")
    for key in ("chunks", KEEP_COMMITS_KEY) + (("field_chunk_transitions",) if version < 2
                                                  else ()):
        del m[key]
    m["format_version"] = version
    (path / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(path / ".working")  # force a rebuild from the persistent tier


@pytest.mark.parametrize("version", [1, 2])
def test_format_1_and_2_buffers_still_open_and_upgrade_on_save(tmp_path, version):
    # Format 1 chunked every field by chunk_transitions and had no field_chunk_transitions.
    # A buffer whose fields are all 8-byte scalars is laid out that way by later formats too.
    fields = {"x": FieldSpec((), np.int64)}
    path = tmp_path / "old"
    b = ReplayBuffer.create(path, capacity=12, fields=fields, chunk_transitions=4)
    b.extend({"x": np.arange(10, dtype=np.int64)})
    b.save()
    b.close()
    m = json.loads((path / "manifest.json").read_text())
    assert set(m["field_chunk_transitions"].values()) == {4}
    _as_legacy(path, version)
    with ReplayBuffer.open(path, mode="r") as ro:
        np.testing.assert_array_equal(ro[:]["x"], np.arange(10))
    back = ReplayBuffer.open(path)
    assert len(back) == 10
    np.testing.assert_array_equal(back[np.arange(10)]["x"], np.arange(10))
    back.extend({"x": np.arange(10, 14, dtype=np.int64)})  # overwrites chunk 0 (slots 0, 1)
    assert back.save().commit == 2
    back.close()
    m = json.loads((path / "manifest.json").read_text())
    assert m["format_version"] == 3
    with ReplayBuffer.open(path, mode="r") as ro:
        np.testing.assert_array_equal(ro[:]["x"], np.arange(2, 14))


def test_read_only_refuses_writes(buf):
    buf.save()
    ro = ReplayBuffer.open(buf.path, mode="r")
    with pytest.raises(ReadOnlyError):
        ro.add(**_one())
    with pytest.raises(ReadOnlyError):
        ro.save()


def test_failed_save_keeps_last_commit_and_retries(buf, monkeypatch):
    buf.save()
    buf.extend(make_batch(6, 6))  # wraps: overwrites committed slots 0..1
    real = PersistentTier.stage_chunks
    calls = {"n": 0}

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(PersistentTier, "stage_chunks", flaky)
    with pytest.raises(OSError, match="No space left"):
        buf.save()
    assert not (buf.path / ".staging").exists() or not any((buf.path / ".staging").iterdir())
    with ReplayBuffer.open(buf.path, mode="r") as ro:  # the last commit, untouched
        assert ro.commit == 1
        assert_rows_are(ro[:], np.arange(6))
    report = buf.save()  # the pending changes are still there
    assert report.commit == 2
    buf.close()
    with ReplayBuffer.open(buf.path) as b:
        assert_rows_are(b[:], np.arange(2, 12))


def _corrupt_first_chunk(path, field):
    tier = PersistentTier.open(make_location(path))
    chunk_file = path / tier.chunk_path(field, 0)
    data = bytearray(chunk_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk_file.write_bytes(bytes(data))


def test_corrupt_chunk_named_by_verify_and_reads(buf, capsys):
    buf.save()
    buf.close()
    _corrupt_first_chunk(buf.path, "obs")
    assert main(["inspect", str(buf.path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "field 'obs' chunk 0" in out
    with ReplayBuffer.open(buf.path, mode="r") as ro, pytest.raises(CorruptChunkError) as e:
        ro[0]
    assert (e.value.field, e.value.chunk) == ("obs", 0)
    os.remove(buf.path / ".working" / "state.json")  # force a rebuild, which reads chunk 0
    with pytest.raises(CorruptChunkError, match="field 'obs': chunk 0 is corrupt"):
        ReplayBuffer.open(buf.path)


def test_closed_buffer(buf):
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.sample(1)


def test_io_errors_are_not_reported_as_corruption(buf, capsys, monkeypatch):
    """A chunk that cannot be read (permission, network) raises an OSError naming the cause,
    and ``inspect --verify`` fails with an I/O error, not a list of 'corrupt' chunks."""
    buf.save()
    buf.close()
    real_get = zarr.storage.LocalStore.get

    async def denied(self, key, *a, **k):
        if str(self.root).endswith("/obs") and key.startswith("c/"):
            raise PermissionError(13, "Permission denied", key)
        return await real_get(self, key, *a, **k)

    monkeypatch.setattr(zarr.storage.LocalStore, "get", denied)
    with ReplayBuffer.open(buf.path, mode="r") as ro, pytest.raises(PermissionError) as e:
        ro[0]
    assert not isinstance(e.value, CorruptChunkError)
    assert main(["inspect", str(buf.path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "I/O error" in err and "Permission denied" in err and "corrupt" not in err


def test_save_io_errors_name_the_path(buf, monkeypatch):
    """ENOSPC or EIO from write() / fsync() carries no file name: the save adds the path it
    was writing, keeps the errno, and the next save (space freed) commits."""
    real_set = zarr.storage.LocalStore.set

    async def full_disk(self, key, *a, **k):
        if key.startswith("c/"):
            raise OSError(28, "No space left on device")
        return await real_set(self, key, *a, **k)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", full_disk)
    with pytest.raises(OSError, match="No space left on device") as e:
        buf.save()
    assert e.value.errno == 28 and str(buf.path) in e.value.filename
    assert str(buf.path) in str(e.value)
    monkeypatch.setattr(zarr.storage.LocalStore, "set", real_set)

    def eio(self, rel):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(LocalLocation, "sync_tree", eio)
    with pytest.raises(OSError, match="Input/output error") as e:
        buf.save()
    assert e.value.errno == 5 and e.value.filename.endswith("versions/g1")
    monkeypatch.undo()
    assert buf.save().commit == 1
    buf.close()
