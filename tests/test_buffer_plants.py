"""Planted entries in a buffer's directory (issue 44, W1 and L1/L2): a symlink to a file or
directory outside, or a FIFO, at every path rlbuffers writes in a buffer (found by listing a
small buffer with a fixed field, a ragged field and a prioritized sampler after two saves and
an open reader, plus the temporary and next-commit names). For each, a writer's open, add,
save and close and a reader's open and read either refuse with ``UnsafePathError`` (one line)
or replace the planted entry; never write through it, never hang (each case runs under an
alarm), never corrupt the last commit (the plant removed, the buffer reads back exactly the
commit it says it is at)."""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.errors import UnsafePathError

FIELDS = {"obs": FieldSpec((3,), "float32"), "tok": FieldSpec((None,), "int16")}
CAPACITY, CHUNK = 16, 4
#: rows in the buffer after the template's two saves, and after the case's save
BEFORE, AFTER = 11, 15
#: seconds a case may take before it counts as hung
ALARM = 30


def _rows(first: int, n: int) -> dict:
    ids = np.arange(first, first + n)
    return {"obs": np.repeat(ids[:, None], 3, 1).astype(np.float32),
            "tok": [np.full(i % 4, i, np.int16) for i in ids.tolist()]}


def _expect(buf: ReplayBuffer, total: int) -> None:
    rows = buf[:]
    ids = np.arange(max(0, total - CAPACITY), total)
    np.testing.assert_array_equal(rows["obs"][:, 0], ids)
    for got, i in zip(rows["tok"], ids.tolist(), strict=True):
        np.testing.assert_array_equal(got, np.full(i % 4, i, np.int16))


@contextmanager
def _alarm(seconds: int, what: str):
    """Fail the block if it runs past ``seconds``: SIGALRM (which interrupts a blocking call
    only if the kernel delivers it to the main thread, and zarr runs threads), backed by
    faulthandler's watchdog thread, which dumps every thread and ends the process a little
    later: a hang never hangs the suite."""
    def hung(signum, frame):
        raise TimeoutError(f"{what}: still running after {seconds} s (hung)")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 15, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plants") / "buf"
    with ReplayBuffer.create(path, capacity=CAPACITY, chunk_transitions=CHUNK, fields=FIELDS,
                             sampler=PrioritizedSampler(), seed=0) as buf:
        buf.extend(_rows(0, 6))
        buf.save()
        buf.extend(_rows(6, BEFORE - 6))
        buf.update_priorities(np.arange(3), np.ones(3))
        buf.save()
    return path


def _paths(template: Path) -> list[str]:
    """Every file and directory under the template (a reader open, so its lease is there),
    plus the names a save or a reader creates next."""
    with ReplayBuffer.open(template, mode="r"):
        found = sorted(str(p.relative_to(template)) for p in template.rglob("*"))
    assert any(p.startswith("readers/") and p.endswith(".lease") for p in found), found
    nxt = ["manifest.json.tmp", "history/g3.json", "history/g3.json.tmp", "versions/g3",
           "versions/g3/obs", "versions/g3/obs/zarr.json", "versions/g3/obs/c/2/0",
           "versions/g3/tok/c/3", "versions/g3/_priority/zarr.json", ".working/state.json.tmp",
           ".working/tok.ragged/c3.bin", "readers/x.lease", "readers/.tmp-stale"]
    return sorted(set(found) | set(nxt))


def test_template_lists_what_matters(template):
    paths = _paths(template)
    for p in ("manifest.json", "history/g2.json", "writer.lock", ".working/state.json",
              ".working/obs.npy", ".working/_priority.npy", ".working/tok.ragged/start.npy",
              ".working/tok.ragged/length.npy", ".working/tok.ragged/c0.bin",
              "versions/g2/obs/zarr.json", "obs/zarr.json", "readers"):
        assert p in paths, p
    assert len(paths) > 40


def _snapshot(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(path.rglob("*"))}


def _plant(case: Path, rel: str, kind: str, outside: Path) -> Path | None:
    """Replace ``case/rel`` (whatever it is) with a plant; returns the outside target."""
    path = case / rel
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return None
    target = outside / "target"
    if "." in Path(rel).name and not Path(rel).name.startswith("g"):
        target.write_bytes(b"outside file: must stay unchanged")
    else:  # a directory name: point it at a directory outside
        target.mkdir()
        (target / "keep").write_bytes(b"outside directory: must stay unchanged")
    os.symlink(target, path)
    return target


def _session(case: Path) -> list[str]:
    """What a writer and a reader do; the errors they raised (only UnsafePathError may be)."""
    errors = []
    try:
        with ReplayBuffer.open(case) as w:
            w.extend(_rows(BEFORE, AFTER - BEFORE))
            w.update_priorities(np.arange(2), np.full(2, 2.0))
            w.save()
    except UnsafePathError as e:
        assert "\n" not in str(e) and str(case) in str(e), str(e)
        errors.append(f"writer: {e}")
    try:
        with ReplayBuffer.open(case, mode="r") as ro:
            ro[:]
    except UnsafePathError as e:
        assert "\n" not in str(e), str(e)
        errors.append(f"reader: {e}")
    return errors


def _restore(case: Path, rel: str, template: Path) -> None:
    """Remove the plant if it is still there and put the template's entry back."""
    path = case / rel
    if not (path.is_symlink() or (path.exists() and not (path.is_dir() or path.is_file()))):
        return
    path.unlink()
    src = template / rel
    if src.is_dir():
        shutil.copytree(src, path, symlinks=True)
    elif src.is_file():
        shutil.copy2(src, path)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_plants_everywhere_are_refused_or_replaced(template, tmp_path, kind, caplog):
    caplog.set_level(logging.WARNING)
    outcomes = {}
    for i, rel in enumerate(_paths(template)):
        if kind == "fifo" and (template / rel).is_dir() and rel != "readers":
            continue  # a FIFO instead of a directory of chunks: covered by the symlink case
        case = tmp_path / f"c{i}" / "buf"
        shutil.copytree(template, case, symlinks=True)
        for lease in (case / "readers").glob("*.lease"):
            lease.unlink()  # the listing reader's: closed
        ReplayBuffer.open(case).close()  # new inodes: the copy's state.json vouches again
        outside = tmp_path / f"c{i}" / "outside"
        outside.mkdir()
        target = _plant(case, rel, kind, outside)
        before = _snapshot(target) if target is not None else None
        with _alarm(ALARM, f"{kind} at {rel}"):
            errors = _session(case)
        if target is not None:
            assert _snapshot(target) == before, f"{rel}: written through"
            assert sorted(os.listdir(outside)) == ["target"], f"{rel}: wrote outside"
        _restore(case, rel, template)
        with _alarm(ALARM, f"{kind} at {rel}: reopen"):
            with ReplayBuffer.open(case, mode="r") as ro:
                assert ro.commit in (2, 3), rel
                _expect(ro, BEFORE if ro.commit == 2 else AFTER)
            if not errors:
                assert ro.commit == 3, rel
        outcomes[rel] = errors
    refused = {rel: e for rel, e in outcomes.items() if e}
    # the plants a session meets and cannot replace are refused; every other one is replaced
    assert refused, outcomes
    assert len(refused) < len(outcomes), outcomes


# -- regressions of issue 44 (each failed before the fix) ----------------------------------

def _small(path: Path, n: int = 6) -> None:
    with ReplayBuffer.create(path, capacity=CAPACITY, chunk_transitions=CHUNK,
                             fields=FIELDS) as buf:
        buf.extend(_rows(0, n))
        buf.save()


def _outside_file(tmp_path: Path) -> Path:
    target = tmp_path / "outside.bin"
    target.write_bytes(b"somebody else's file")
    return target


@pytest.mark.parametrize("rel", [".working/tok.ragged/c1.bin", ".working/obs.npy",
                                 ".working/tok.ragged/start.npy", ".working/state.json"])
def test_symlink_in_the_working_tier_is_replaced_not_written_through(tmp_path, rel):
    """W1: a symlink planted in the default working tier was written through (completing the
    chunk truncated and rewrote the target outside the buffer)."""
    path = tmp_path / "buf"
    _small(path)
    target = _outside_file(tmp_path)
    os.remove(path / rel)
    os.symlink(target, path / rel)
    with _alarm(ALARM, rel), ReplayBuffer.open(path) as buf:
        buf.extend(_rows(6, 4))  # completes chunk 1 (slots 4-7) and writes chunk 2
        buf.save()
    assert target.read_bytes() == b"somebody else's file"
    assert not (path / rel).is_symlink()
    with ReplayBuffer.open(path, mode="r") as ro:
        _expect(ro, 10)


def test_symlink_planted_while_open_is_refused(tmp_path):
    path = tmp_path / "buf"
    _small(path)
    target = _outside_file(tmp_path)
    with ReplayBuffer.open(path) as buf:  # a clean reopen: c2.bin is not open yet
        os.remove(path / ".working" / "tok.ragged" / "c2.bin")
        os.symlink(target, path / ".working" / "tok.ragged" / "c2.bin")
        with pytest.raises(UnsafePathError, match=r"c2\.bin: is a symlink"):
            buf.extend(_rows(6, 4))
    assert target.read_bytes() == b"somebody else's file"
    with ReplayBuffer.open(path, mode="r") as ro:
        _expect(ro, 6)


@pytest.mark.parametrize("rel", ["manifest.json.tmp", "history/g2.json.tmp",
                                 ".working/state.json.tmp"])
def test_symlink_at_an_old_temporary_name_is_not_written_through(tmp_path, rel):
    """W1: ``LocalLocation.write_atomic`` wrote ``<name>.tmp`` with a plain ``open()`` that
    followed a symlink planted there."""
    path = tmp_path / "buf"
    _small(path)
    target = _outside_file(tmp_path)
    os.symlink(target, path / rel)
    with ReplayBuffer.open(path) as buf:
        buf.extend(_rows(6, 2))
        buf.save()
    assert target.read_bytes() == b"somebody else's file"
    with ReplayBuffer.open(path, mode="r") as ro:
        _expect(ro, 8)


@pytest.mark.parametrize("state", [
    {"dirty_chunks": [0, "a"]}, {"dirty_chunks": [True]}, {"dirty_chunks": [10**9]},
    {"dirty_chunks": {"0": 1}}, {"dirty_chunks": [1, 1]}, {"commit": "1"},
    {"layout": "16x4"}, {"buffer_id": 7}, {"dirty_chunks": [None, 1.5]}])
def test_invalid_working_state_rebuilds_the_tier(tmp_path, state, caplog):
    """E2: a ``state.json`` with mixed types in ``dirty_chunks`` crashed ``open`` in
    ``sorted()``; any invalid state is now logged and the tier rebuilt from the commit."""
    import json

    path = tmp_path / "buf"
    _small(path)
    file = path / ".working" / "state.json"
    good = json.loads(file.read_text())
    file.write_text(json.dumps({**good, **state}))
    with open(path / ".working" / "obs.npy", "r+b") as f:  # a stale row the rebuild fixes
        f.seek(-12, os.SEEK_END)
        f.write(b"\xff" * 12)
    caplog.set_level(logging.WARNING)
    with ReplayBuffer.open(path) as buf:
        _expect(buf, 6)
    key = next(iter(state))
    assert any(f"key '{key}'" in r.getMessage() and "rebuilt" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("rel", [".working/tok.ragged/c2.bin", ".working/obs.npy",
                                 ".working/tok.ragged/length.npy"])
def test_regular_file_replacing_a_working_file_is_not_trusted(tmp_path, rel, caplog):
    """Fuzzer finding (tools/fuzz/fuzz_leases.py): a regular file planted in place of a
    working-tier file (here a copy of the original with other bytes) was trusted, and the
    next save committed its bytes for rows of the last commit."""
    path = tmp_path / "buf"
    _small(path, 10)  # chunk 2 holds rows 8, 9: the next add makes it dirty
    data = bytearray((path / rel).read_bytes())
    data[-8:] = b"\x07" * 8
    (tmp_path / "planted").write_bytes(bytes(data))
    os.replace(tmp_path / "planted", path / rel)  # another file (inode) at the same name
    caplog.set_level(logging.WARNING)
    with ReplayBuffer.open(path) as buf:
        buf.extend(_rows(10, 1))
        buf.save()
    assert any("replaced since state.json" in r.getMessage() for r in caplog.records)
    with ReplayBuffer.open(path, mode="r") as ro:
        _expect(ro, 11)


@pytest.mark.parametrize("rel", [".working/tok.ragged/c2.bin", ".working/obs.npy"])
def test_a_state_without_its_file_digest_is_not_trusted(tmp_path, rel, caplog):
    """Fuzzer finding (tools/fuzz/fuzz_leases.py, 10-minute run): a ``state.json`` whose
    ``files`` digest was removed was trusted as written by an older rlbuffers, so a file
    planted in place of a working-tier file reached the next commit."""
    import json

    path = tmp_path / "buf"
    _small(path, 10)
    file = path / ".working" / "state.json"
    state = json.loads(file.read_text())
    del state["files"]
    file.write_text(json.dumps(state))
    data = bytearray((path / rel).read_bytes())
    data[-8:] = b"\x07" * 8
    (tmp_path / "planted").write_bytes(bytes(data))
    os.replace(tmp_path / "planted", path / rel)
    caplog.set_level(logging.INFO)
    with ReplayBuffer.open(path) as buf:
        buf.extend(_rows(10, 1))
        buf.save()
    assert any("records no digest" in r.getMessage() for r in caplog.records)
    with ReplayBuffer.open(path, mode="r") as ro:
        _expect(ro, 11)
