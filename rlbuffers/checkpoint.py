"""Run checkpoints, with the replay buffer's commit as the commit point of the run.

A trainer that keeps a replay buffer has two things to save per step (or generation): its own
state (models, optimizers, RNGs, counters) and the buffer. Neither write can be atomic with the
other, so the protocol orders them:

1. :meth:`Checkpoints.write` puts the trainer state in ``<root>/<prefix>-<N>/``, atomically
   (a temporary directory, every file fsynced, renamed into place, parent fsynced);
2. ``buf.save(metadata={..., "<key>": N})`` commits the buffer naming step ``N``: **this
   commit makes step N real**;
3. :meth:`Checkpoints.prune` drops checkpoints newer than the commit (a crash came between 1
   and 2) and all but the ``keep`` newest committed ones (with ``recycle=True`` the newest
   dropped one becomes the *spare*, ``<root>/<prefix>.spare``, no longer a checkpoint, whose
   files the next :meth:`Checkpoints.write` overwrites).

Page-cache pages: a file written afresh takes new page-cache pages, and on a VM whose freed
memory goes back to the host (virtio-balloon free page reporting, e.g. Firecracker), each new
page costs a host fault: 1.5 GiB written afresh took 3.2-4.6 s of kernel time here (AMD EPYC
VM, 2 cores), the same bytes written over the cached pages of an existing file 0.4 s, and
written after deleting such a file (its pages freed and taken again at once) 0.7-1.2 s. So the
``torch_files`` (the optimizer state: the bulk) bypass the page cache
(:mod:`rlbuffers.storage.direct_io`, ``O_DIRECT``). With ``recycle=True``, ``writers`` (e.g.
safetensors, which opens the file itself) write over the spare's file of the same name, whose
pages are cached, at the price of one more checkpoint's bytes on disk; it is off by default:
once the torch files bypassed the page cache it measured no gain (0.62 s per write + prune
against 0.41 s, ``tools/bench/bench_checkpoint.py``).

On resume, the buffer's last commit names the step; :meth:`Checkpoints.latest` returns the
directory of that step: the last complete (checkpoint, buffer commit) pair, after checking
every file against the crc32c recorded in ``checksums.json`` when it was written (torch's own
zip CRC32 is not computed: at ~0.5 GB/s it cost 2 s per GB of optimizer state; crc32c runs at
several GB/s). :func:`create_run` makes a new run directory atomically, so a run is either
absent or resumable.

A run directory may come from somebody else, so nothing here follows a symlink or waits on a
FIFO below the checkpoint root: every file is written as a new regular file (or over a
regular file of the spare with one link), a symlink or other non-directory at a checkpoint's
name is removed, never followed, and everything is read back with :mod:`rlbuffers.safe_load`
(JSON; torch files only with ``weights_only=True``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbuffers.errors import CorruptCheckpointError
from rlbuffers.safe_load import load_json, open_regular
from rlbuffers.storage.direct_io import DirectWriter
from rlbuffers.storage.location import fsync_path
from rlbuffers.storage.safe_files import open_inside, remove_inside, write_atomic_inside

log = logging.getLogger(__name__)

#: The trainer state file written as JSON in every checkpoint (plain data, human-readable).
STATE_JSON = "state.json"
#: ``{file name: crc32c}`` of every other file of a checkpoint.
CHECKSUMS_JSON = "checksums.json"
_BLOCK = 16 << 20


class MissingCheckpointError(CorruptCheckpointError, FileNotFoundError):
    """The buffer's commit names a step whose checkpoint directory is missing (or is not a
    directory of its own: a symlink, a file)."""


def file_crc32c(path: Path) -> int:
    """crc32c (Castagnoli) of the regular file at ``path``, read in 16 MiB blocks.

    Raises:
        CorruptCheckpointError: ``path`` is missing, a symlink, a FIFO or not a regular file.
    """
    import crc32c

    value = 0
    with os.fdopen(open_regular(path, CorruptCheckpointError), "rb") as f:
        while block := f.read(_BLOCK):
            value = crc32c.crc32c(block, value)
    return value


def _remove(path: Path) -> None:
    """Remove ``path`` whatever it is, never following a symlink (a symlink is unlinked, a
    directory removed with what it holds); nothing when it is missing."""
    remove_inside(path.parent, path.name)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def verify_checkpoint(path: Path) -> None:
    """Check every file of the checkpoint directory ``path`` against ``checksums.json``
    (checkpoints written before checksums existed have none: nothing to check).

    Raises:
        CorruptCheckpointError: ``checksums.json`` is not a JSON object of file names to
            integers, a file is missing or not a regular file, or its crc32c differs (file,
            expected and actual value named).
    """
    sums_path = Path(path) / CHECKSUMS_JSON
    if not os.path.lexists(sums_path):
        return
    for name, want in load_json(sums_path, dict, error=CorruptCheckpointError).items():
        if "/" in name or name in ("", ".", "..") or type(want) is not int:
            raise CorruptCheckpointError(f"{sums_path}: {name!r}: expected a file name of the "
                                         f"checkpoint and its crc32c, got {want!r}")
        f = Path(path) / name
        if not os.path.lexists(f):
            raise CorruptCheckpointError(f"{f}: missing from the checkpoint")
        got = file_crc32c(f)
        if got != want:
            raise CorruptCheckpointError(f"{f}: crc32c expected {want:#010x}, got {got:#010x}")


def _torch_save_without_zip_crc(obj: Any, f: Any) -> None:
    import torch  # only trainers that save torch state need it

    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6: always computes the zip CRC32
        torch.save(obj, f)
        return
    old, config.save.compute_crc32 = config.save.compute_crc32, False
    try:
        torch.save(obj, f)
    finally:
        config.save.compute_crc32 = old


def _write_file(path: Path, write: Callable[[Any], None]) -> None:
    """Write the regular file ``path`` (created or truncated; a symlink, a FIFO or a file
    with other hard links there is refused: ``UnsafePathError``) and fsync it."""
    fd = open_inside(path.parent, path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_direct(path: Path, obj: Any) -> int:
    """``torch.save`` of ``obj`` to ``path`` bypassing the page cache; returns its crc32c."""
    with DirectWriter(path) as f:
        _torch_save_without_zip_crc(obj, f)
    return f.crc32c


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace the file ``path`` with ``data`` as JSON: a temporary file of an unpredictable
    name, fsync, rename (over a symlink or FIFO at ``path``, never through it), fsync of the
    directory (``rlbuffers.storage.safe_files.write_atomic_inside``)."""
    write_atomic_inside(Path(path).parent, Path(path).name,
                        json.dumps(data, indent=1).encode())


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint directories ``<root>/<prefix>-<N>/`` of one run.

    Attributes:
        root: the directory holding them (created on first write).
        prefix: directory name before ``-N`` (e.g. ``"gen"`` or ``"step"``).
        keep: complete committed checkpoints kept by :meth:`prune` (>= 1).
        recycle: :meth:`prune` keeps the newest checkpoint it drops as the spare whose files
            the next :meth:`write` overwrites (see the module docstring); False deletes it.
    """

    root: Path
    prefix: str = "step"
    keep: int = 2
    recycle: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep: expected an integer >= 1, got {self.keep!r}")
        object.__setattr__(self, "root", Path(self.root))

    def path(self, step: int) -> Path:
        """The directory of checkpoint ``step``."""
        return self.root / f"{self.prefix}-{step}"

    @property
    def spare(self) -> Path:
        """The directory of the last dropped checkpoint, kept for :meth:`write` to overwrite
        (not a checkpoint: :meth:`steps` does not list it)."""
        return self.root / f"{self.prefix}.spare"

    def write(self, step: int, torch_files: dict[str, Any] | None = None,
              state: dict[str, Any] | None = None,
              writers: dict[str, Callable[[Path], None]] | None = None) -> Path:
        """Write checkpoint ``step`` atomically: each of ``torch_files`` (file name -> object)
        with ``torch.save``, each of ``writers`` (file name -> ``write(path)``, e.g. a
        safetensors save), and ``state`` (plain JSON data) as ``state.json``; the crc32c of
        each in ``checksums.json``; every file and the directory fsynced, then renamed over
        any older ``<prefix>-<step>``. The ``torch_files`` bypass the page cache
        (:class:`rlbuffers.storage.direct_io.DirectWriter`, their crc32c taken as they are
        written). A
        spare left by :meth:`prune` becomes the temporary directory: ``writers`` write over its
        files, and the ones not written again are removed.

        Raises:
            ValueError: ``step`` is negative. OSError: the write failed (no checkpoint
            ``step`` is left half-written).
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an integer >= 0, got {step!r}")
        final = self.path(step)
        tmp = final.with_name(final.name + ".tmp")
        self.root.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
        if self.recycle and _is_real_dir(self.spare):
            os.rename(self.spare, tmp)
            names = {*(torch_files or {}), *(writers or {}),
                     *([STATE_JSON] if state is not None else [])}
            for p in tmp.iterdir():  # only regular files of one link are written over
                st = os.lstat(p)
                if p.name not in names or not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                    _remove(p)
        else:
            if self.recycle:  # a symlink or a file at the spare's name
                _remove(self.spare)
            tmp.mkdir()
        sums = {name: _write_direct(tmp / name, obj) for name, obj in (torch_files or {}).items()}
        for name, write in (writers or {}).items():
            write(tmp / name)
            fsync_path(tmp / name)
        if state is not None:
            _write_file(tmp / STATE_JSON, lambda f: f.write(json.dumps(state).encode()))
        sums.update({p.name: file_crc32c(p) for p in sorted(tmp.iterdir())
                     if p.is_file() and not p.is_symlink() and p.name not in sums
                     and p.name != CHECKSUMS_JSON})
        sums = dict(sorted(sums.items()))
        _write_file(tmp / CHECKSUMS_JSON, lambda f: f.write(json.dumps(sums).encode()))
        fsync_path(tmp)
        _remove(final)
        os.rename(tmp, final)
        fsync_path(self.root)
        return final

    def steps(self) -> list[int]:
        """Steps of the complete checkpoint directories, ascending."""
        out = []
        for p in self.root.glob(f"{self.prefix}-*"):
            n = p.name[len(self.prefix) + 1:]
            if n.isdigit():
                out.append(int(n))
        return sorted(out)

    def prune(self, committed: int) -> None:
        """Delete temporary directories, checkpoints newer than the buffer's commit
        ``committed`` (a crash came between the checkpoint and the commit), and all but the
        ``keep`` newest committed ones; with ``recycle``, the newest of those becomes the
        spare (replacing any older spare)."""
        for tmp in self.root.glob(f"{self.prefix}-*.tmp"):
            _remove(tmp)
        steps = self.steps()
        old = [s for s in steps if s <= committed][:-self.keep]
        if self.recycle and old:
            _remove(self.spare)
            os.rename(self.path(old.pop()), self.spare)
        for s in old + [s for s in steps if s > committed]:
            _remove(self.path(s))

    def latest(self, committed: int) -> Path | None:
        """The checkpoint of the buffer's last commit ``committed`` (the step its metadata
        names): the last complete pair; None when ``committed`` is 0 (nothing done yet).

        Raises:
            MissingCheckpointError: (a CorruptCheckpointError and a FileNotFoundError) the
                commit names a step whose checkpoint is missing, or is not a directory of
                its own (a symlink, a file).
            CorruptCheckpointError: a file of it fails its recorded crc32c, or is not a
                regular file.
        """
        if committed == 0:
            return None
        path = self.path(committed)
        if not _is_real_dir(path):
            what = "is a symlink" if path.is_symlink() else "is missing" if not \
                os.path.lexists(path) else "is not a directory"
            raise MissingCheckpointError(f"{path}: the buffer's commit names step {committed}, "
                                         f"but its checkpoint {what}")
        verify_checkpoint(path)
        return path


def load_state(path: Path) -> dict[str, Any]:
    """The JSON trainer state of the checkpoint directory ``path``.

    Raises:
        CorruptCheckpointError: ``state.json`` is missing, not a regular file, or not a JSON
            object (one line naming it).
    """
    return dict(load_json(Path(path) / STATE_JSON, dict, error=CorruptCheckpointError))


def create_run(run_dir: str | os.PathLike[str], config: dict[str, Any],
               create: Callable[[Path], None]) -> Path:
    """Make a new run directory atomically: ``config.json`` and whatever ``create(dir)``
    writes (e.g. the replay buffer) are built in a hidden sibling and renamed into place, so
    ``run_dir`` is either absent or complete (a leftover sibling of a crashed creation is
    removed here).

    Raises:
        FileExistsError: ``run_dir`` exists and is not empty.
    """
    run = Path(run_dir)
    if run.exists() and any(run.iterdir()):
        raise FileExistsError(f"run_dir: {run} already holds a run (resume it, or pick "
                              "another directory)")
    run.parent.mkdir(parents=True, exist_ok=True)
    for old in run.parent.glob(f".{run.name}.creating-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = run.parent / f".{run.name}.creating-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    write_json_atomic(tmp / "config.json", config)
    create(tmp)
    fsync_path(tmp)
    os.rename(tmp, run)  # onto a missing or empty directory
    fsync_path(run.parent)
    return run
