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
(:mod:`rlbuffers.direct_io`, ``O_DIRECT``). With ``recycle=True``, ``writers`` (e.g.
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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbuffers.direct_io import DirectWriter
from rlbuffers.errors import CorruptCheckpointError
from rlbuffers.storage.location import fsync_path

log = logging.getLogger(__name__)

#: The trainer state file written as JSON in every checkpoint (plain data, human-readable).
STATE_JSON = "state.json"
#: ``{file name: crc32c}`` of every other file of a checkpoint.
CHECKSUMS_JSON = "checksums.json"
_BLOCK = 16 << 20


def file_crc32c(path: Path) -> int:
    """crc32c (Castagnoli) of the file at ``path``, read in 16 MiB blocks."""
    import crc32c

    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = crc32c.crc32c(block, value)
    return value


def verify_checkpoint(path: Path) -> None:
    """Check every file of the checkpoint directory ``path`` against ``checksums.json``
    (checkpoints written before checksums existed have none: nothing to check).

    Raises:
        CorruptCheckpointError: a file is missing or its crc32c differs (file, expected and
            actual value named).
    """
    sums_path = Path(path) / CHECKSUMS_JSON
    if not sums_path.exists():
        return
    for name, want in json.loads(sums_path.read_text()).items():
        f = Path(path) / name
        if not f.is_file():
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
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_direct(path: Path, obj: Any) -> int:
    """``torch.save`` of ``obj`` to ``path`` bypassing the page cache; returns its crc32c."""
    with DirectWriter(path) as f:
        _torch_save_without_zip_crc(obj, f)
    return f.crc32c


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace the file ``path`` with ``data`` as JSON: temporary file, fsync, rename, fsync of
    the directory."""
    tmp = path.with_name(path.name + ".tmp")
    _write_file(tmp, lambda f: f.write(json.dumps(data, indent=1).encode()))
    os.replace(tmp, path)
    fsync_path(path.parent)


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
        (:class:`rlbuffers.direct_io.DirectWriter`, their crc32c taken as they are written). A
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
        shutil.rmtree(tmp, ignore_errors=True)
        if self.recycle and self.spare.is_dir():
            os.rename(self.spare, tmp)
            names = {*(torch_files or {}), *(writers or {}),
                     *([STATE_JSON] if state is not None else [])}
            for p in tmp.iterdir():
                if p.name not in names:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            tmp.mkdir(parents=True)
        sums = {name: _write_direct(tmp / name, obj) for name, obj in (torch_files or {}).items()}
        for name, write in (writers or {}).items():
            write(tmp / name)
            fsync_path(tmp / name)
        if state is not None:
            _write_file(tmp / STATE_JSON, lambda f: f.write(json.dumps(state).encode()))
        sums.update({p.name: file_crc32c(p) for p in sorted(tmp.iterdir())
                     if p.is_file() and p.name not in sums and p.name != CHECKSUMS_JSON})
        sums = dict(sorted(sums.items()))
        _write_file(tmp / CHECKSUMS_JSON, lambda f: f.write(json.dumps(sums).encode()))
        fsync_path(tmp)
        shutil.rmtree(final, ignore_errors=True)
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
            shutil.rmtree(tmp, ignore_errors=True)
        steps = self.steps()
        old = [s for s in steps if s <= committed][:-self.keep]
        if self.recycle and old:
            shutil.rmtree(self.spare, ignore_errors=True)
            os.rename(self.path(old.pop()), self.spare)
        for s in old + [s for s in steps if s > committed]:
            shutil.rmtree(self.path(s), ignore_errors=True)

    def latest(self, committed: int) -> Path | None:
        """The checkpoint of the buffer's last commit ``committed`` (the step its metadata
        names): the last complete pair; None when ``committed`` is 0 (nothing done yet).

        Raises:
            FileNotFoundError: the commit names a step whose checkpoint is missing.
            CorruptCheckpointError: a file of it fails its recorded crc32c.
        """
        if committed == 0:
            return None
        path = self.path(committed)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: the buffer's commit names step {committed}, "
                                    "but its checkpoint is missing")
        verify_checkpoint(path)
        return path


def load_state(path: Path) -> dict[str, Any]:
    """The JSON trainer state of the checkpoint directory ``path``."""
    return dict(json.loads((path / STATE_JSON).read_text()))


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
