"""Hostile and careless input on disk (issue 32, part B): a tampered ``manifest.json`` is one
``ManifestError`` (key, expected, actual) from the API, ``inspect``, ``verify`` and ``repair``,
raised before anything is written or deleted; no path derived from a manifest leaves the buffer
directory; symlinks inside the buffer are not followed for writes; a read-only filesystem is
named as such."""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest

from rlbuffers import (
    FieldSpec,
    ManifestError,
    NotABufferError,
    ReadOnlyError,
    ReplayBuffer,
    UnsafePathError,
)
from rlbuffers.cli import main
from rlbuffers.maintenance.inspection import inspect_path
from rlbuffers.maintenance.repair import repair

FIELDS = {"obs": FieldSpec((3,), "float32"), "done": FieldSpec((), "bool")}


def _saved(path, saves=1, keep=2):
    with ReplayBuffer.create(path, capacity=16, fields=FIELDS, chunk_transitions=4,
                             keep_commits=keep) as buf:
        for i in range(saves):
            buf.extend({"obs": np.full((5, 3), i, np.float32), "done": np.zeros(5, bool)})
            buf.save()
    return path


def _tree(path):
    """Every file below ``path`` with its bytes (what must not change)."""
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _edit(path, change):
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _rename_field(m, old, new):
    m["fields"][new] = m["fields"].pop(old)
    m["field_chunk_transitions"][new] = m["field_chunk_transitions"].pop(old)
    m["chunks"][new] = m["chunks"].pop(old)


def _cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("name", ["../../victim", "/abs/victim"])
def test_field_name_from_manifest_cannot_write_outside_the_buffer(tmp_path, name, capsys):
    """S2: with ``.working`` absent, a field named ``../../victim`` used to rebuild the working
    tier at ``.working/../../victim.npy``, overwriting a user's file before the error."""
    path = _saved(tmp_path / "a" / "buf")
    victim = tmp_path / "victim.npy"
    victim.write_bytes(b"precious")
    shutil.rmtree(path / ".working")
    _edit(path, lambda m: _rename_field(m, "obs", name))
    before = _tree(tmp_path)
    for mode in ("r+", "r"):
        with pytest.raises(ManifestError, match=r"key 'fields\..*victim'") as e:
            ReplayBuffer.open(path, mode=mode)
        assert "must not start with" in e.value.expected
    with pytest.raises(ManifestError):
        repair(path)
    assert _cli(capsys, "verify", str(path))[0] == 2
    assert _tree(tmp_path) == before and victim.read_bytes() == b"precious"


def test_older_manifest_than_versions_on_disk_is_refused_before_deleting(tmp_path, capsys):
    """D4: a manifest restored from an older commit used to pass ``verify``, then ``open(r+)``
    deleted every newer chunk version as uncommitted."""
    path = _saved(tmp_path / "buf", saves=1)
    old = (path / "manifest.json").read_bytes()
    with ReplayBuffer.open(path) as buf:
        for i in range(3):
            buf.extend({"obs": np.full((5, 3), i, np.float32), "done": np.zeros(5, bool)})
            buf.save()
    (path / "manifest.json").write_bytes(old)
    before = _tree(path)
    code, err = _cli(capsys, "verify", str(path))
    assert code == 2 and err.count("\n") == 0
    assert "key 'generation'" in err and "hold commit 4" in err and "got 1" in err
    assert _cli(capsys, "inspect", str(path))[0] == 2
    for mode in ("r+", "r"):
        with pytest.raises(ManifestError, match="restore history/g4.json"):
            ReplayBuffer.open(path, mode=mode)
    assert _tree(path) == before


def test_a_crashed_save_one_commit_ahead_still_opens(tmp_path):
    """The one legitimate case of ``versions/`` ahead of the manifest: the commit after it,
    staged by a save that crashed before its commit point (removed on the writer's open)."""
    path = _saved(tmp_path / "buf", saves=2)
    shutil.copytree(path / "versions" / "g2", path / "versions" / "g3")
    with ReplayBuffer.open(path) as buf:
        assert buf.commit == 2
    assert not (path / "versions" / "g3").exists()


TAMPER = [
    ("capacity", 1e15), ("capacity", 10**15), ("capacity", -1), ("capacity", 0),
    ("capacity", "16"), ("chunk_transitions", 0), ("chunk_transitions", True),
    ("generation", -1), ("format_version", "3"), ("total_added", -5), ("episodes", 10**6),
    ("keep_generations", 0), ("committed_at", float("nan")), ("cursor", 99),
    ("fields", {}), ("fields", {"obs": {"shape": [3], "dtype": "<f16", "codec": "zstd"}}),
    ("fields", {"obs": {"shape": [0], "dtype": "<f4", "codec": "zstd"}}),
    ("fields", {"obs": {"shape": [3], "dtype": "<f4", "codec": "gzip"}}),
    ("fields", {"obs": {"shape": "3", "dtype": "<f4", "codec": "zstd"}}),
    ("fields", {"obs": {"shape": [2**40, 2**40], "dtype": "<f4", "codec": "zstd"}}),
    ("internal", {"episode": {"shape": [], "dtype": "<i8"}}),
    ("field_chunk_transitions", {"obs": 3}), ("chunks", {"obs": [[99, 1, 10]]}),
    ("chunks", {"obs": [[0, 7, 10]]}), ("chunks", {"obs": [[0, 1]]}),
    ("sampler", {"type": "nope"}), ("rng", {"bit_generator": "default_rng"}),
    ("metadata", []), ("buffer_id", 5),
]


@pytest.mark.parametrize(("key", "value"), TAMPER, ids=[f"{k}={v!r:.30}" for k, v in TAMPER])
def test_tampered_manifest_is_one_manifest_error_everywhere(tmp_path, key, value, capsys):
    """U1, C2: every read (API, inspect, verify, repair) refuses it with ManifestError naming
    the key; the CLI exits 2 with one line; nothing on disk changes."""
    path = _saved(tmp_path / "buf")
    _edit(path, lambda m: m.update({key: value}))
    before = _tree(path)
    with pytest.raises(ManifestError) as e:
        ReplayBuffer.open(path)
    assert e.value.key.split(".")[0] in (key, "fields", "field_chunk_transitions", "chunks"), \
        e.value
    for mode in ("r",):
        with pytest.raises(ManifestError):
            ReplayBuffer.open(path, mode=mode)
    with pytest.raises(ManifestError):
        inspect_path(path, verify=True)
    with pytest.raises(ManifestError):
        repair(path)
    for argv in (["inspect", str(path)], ["verify", str(path)], ["inspect", "--json", str(path)]):
        code, err = _cli(capsys, *argv)
        assert code == 2 and err.startswith("rlbuffers: error: ") and "\n" not in err, err
        assert "malformed manifest (key " in err
    assert _tree(path) == before


def test_manifest_error_is_a_not_a_buffer_error_and_reads_json_safely(tmp_path):
    path = _saved(tmp_path / "buf")
    (path / "manifest.json").write_text("[" * 100_000)  # RecursionError in json
    with pytest.raises(ManifestError, match="unreadable JSON"):
        ReplayBuffer.open(path, mode="r")
    (path / "manifest.json").write_text('{"format": "rlbuffers", "format_version": 3, '
                                        '"capacity": ' + "9" * 5000 + "}")  # int too long
    with pytest.raises(NotABufferError):
        ReplayBuffer.open(path, mode="r")


def test_read_only_filesystem_is_named(tmp_path, monkeypatch):
    """U2: a writer on a read-only filesystem used to fail with FileExistsError: .working."""
    path = _saved(tmp_path / "buf")
    real_open, root = os.open, str(path)

    def read_only_open(p, flags, *args, **kw):  # what a read-only mount does
        inside = str(p).startswith(root) or kw.get("dir_fd") is not None  # safe_files
        if inside and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
        return real_open(p, flags, *args, **kw)

    monkeypatch.setattr(os, "open", read_only_open)
    before = _tree(path)
    with pytest.raises(ReadOnlyError, match=r"filesystem is read-only.*mode='r'"):
        ReplayBuffer.open(path)
    with ReplayBuffer.open(path, mode="r") as ro:  # readers work
        assert len(ro) == 5 and ro[4]["obs"].tolist() == [0, 0, 0]
    monkeypatch.undo()
    assert _tree(path) == before


def test_symlinked_working_dir_is_refused_unless_given(tmp_path):
    """A symlinked ``.working`` used to be followed for writes and deletes."""
    path = _saved(tmp_path / "buf")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "obs.npy").write_bytes(b"user data")
    shutil.rmtree(path / ".working")
    os.symlink(outside, path / ".working")
    with pytest.raises(UnsafePathError, match=r"\.working: is a symlink.*working_dir="):
        ReplayBuffer.open(path)
    assert (outside / "obs.npy").read_bytes() == b"user data"
    mine = tmp_path / "mine"  # an explicit working_dir is the user's choice
    with ReplayBuffer.open(path, working_dir=mine) as buf:
        assert len(buf) == 5 and (mine / "obs.npy").exists()


def test_symlinked_history_or_versions_are_not_written_through(tmp_path):
    path = _saved(tmp_path / "buf", saves=2)
    for name in ("history", "versions"):
        outside = tmp_path / f"outside-{name}"
        shutil.move(path / name, outside)
        os.symlink(outside, path / name)
        before = _tree(outside)
        with pytest.raises(UnsafePathError, match="outside|is a symlink"):
            with ReplayBuffer.open(path) as buf:
                buf.extend({"obs": np.ones((4, 3), np.float32), "done": np.zeros(4, bool)})
                buf.save()
        assert _tree(outside) == before
        os.remove(path / name)
        shutil.move(outside, path / name)
    with ReplayBuffer.open(path, mode="r") as ro:  # the last commit is intact
        assert ro.commit == 2 and len(ro) == 10


def test_chunk_size_changed_under_a_working_tier(tmp_path):
    """Fuzzer finding: ``chunk_transitions`` 4 -> 2 under a trusted working tier made a ragged
    read mmap a values file of another chunking (ValueError: cannot mmap an empty file)."""
    path = tmp_path / "buf"
    with ReplayBuffer.create(path, capacity=16, chunk_transitions=4,
                             fields={"tok": FieldSpec((None,), "int16"),
                                     "obs": FieldSpec((3,), "float32")}) as buf:
        buf.extend({"tok": [np.full(i % 3, i, np.int16) for i in range(7)],
                    "obs": np.ones((7, 3), np.float32)})
        buf.save()
    _edit(path, lambda m: m.update(chunk_transitions=2))
    with pytest.raises(ManifestError, match=r"key 'field_chunk_transitions.tok'.*ragged"):
        ReplayBuffer.open(path, mode="r")
    fixed = _saved(tmp_path / "fixed")  # no ragged field: valid, but the tier is rebuilt
    _edit(fixed, lambda m: m.update(chunk_transitions=2))
    with ReplayBuffer.open(fixed) as buf:
        assert buf.chunk_transitions == 2 and buf[:]["obs"].tolist() == [[0, 0, 0]] * 5
    state = json.loads((fixed / ".working" / "state.json").read_text())
    assert state["layout"] == [16, 2]


def test_explicit_working_dir_holding_other_files_is_never_emptied(tmp_path):
    """fuzz_sb3_kwargs findings: a ``working_dir=`` that was the buffer's parent deleted the
    committed buffer, and one holding other files was emptied, when the working tier was
    (re)built there."""
    path = _saved(tmp_path / "buf")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    def files():  # the lock file names its last holder: not data
        return {p: b for p, b in _tree(tmp_path).items() if p.name != "writer.lock"}

    for wdir in (tmp_path, mine, path):
        before = files()
        with pytest.raises(UnsafePathError, match="not a working tier's files"):
            ReplayBuffer.open(path, working_dir=wdir)
        assert files() == before, wdir
    with ReplayBuffer.open(path, mode="r") as ro:
        assert len(ro) == 5
    fresh = tmp_path / "fresh"
    with ReplayBuffer.open(path, working_dir=fresh) as buf:  # a new directory: used
        assert len(buf) == 5
    with ReplayBuffer.open(path, working_dir=fresh) as buf:  # its own tier: reused
        assert len(buf) == 5
    (fresh / "obs.npy").write_bytes(b"junk")  # a broken tier of its own: rebuilt
    with ReplayBuffer.open(path, working_dir=fresh) as buf:
        assert buf[4]["obs"].tolist() == [0, 0, 0]
