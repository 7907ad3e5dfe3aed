"""The saver: everything one buffer's saves share. It owns the lock that writers hold, the
base chunks changed since the last commit (per column), the save in flight
(:class:`~rlbuffers.storage.save_job.SaveJob`) and the background-save thread, and it makes
sure a failed background save is never lost silently: its error is raised by the save's
future, or, if nobody asked the future, by the next ``save``, ``wait`` or ``close``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlbuffers.deprecation import renamed_attribute
from rlbuffers.storage.manifest import Manifest
from rlbuffers.storage.persistent import PersistentTier
from rlbuffers.storage.save_job import SAVE_RUN_BYTES, SaveJob, rows_nbytes
from rlbuffers.storage.working import WorkingTier

log = logging.getLogger(__name__)

#: The savers of open writable buffers (weakly held): at interpreter exit their background saves
#: are finished (see :func:`_finish_saves_at_exit`).
exit_watch: weakref.WeakSet[Saver] = weakref.WeakSet()
_failed_at_exit: list[str] = []


def _finish_saves_at_exit() -> None:
    """Wait for every background save still running when the main thread ends, before
    ``concurrent.futures`` shuts its executors down (after that, the save's own thread pools
    refuse work and the save fails: "cannot schedule new futures after shutdown"). Registered
    with ``threading._register_atexit`` after ``concurrent.futures.thread`` registered its own
    hook, so it runs first (those hooks run last-registered first). A failure nobody saw is
    printed and makes the exit status 1 (:func:`_exit_status`)."""
    for saver in list(exit_watch):
        try:
            saver.wait()
        except BaseException as e:
            msg = (f"rlbuffers: error: a background save of {saver.tier.loc} failed at exit "
                   f"({type(e).__name__}: {e}); nothing of it was committed")
            log.error("%s", msg)
            _failed_at_exit.append(msg)


def _exit_status() -> None:
    """Exit with status 1 if a background save failed at exit (atexit cannot change the
    status otherwise): flush logging and the standard streams, then ``os._exit(1)``."""
    if _failed_at_exit:
        print("\n".join(_failed_at_exit), file=sys.stderr)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)


threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]
atexit.register(_exit_status)


@dataclass(frozen=True)
class SaveReport:
    """What one :meth:`ReplayBuffer.save` did.

    Attributes:
        commit: the commit number now on disk.
        chunks_written: stored chunks encoded and written (all fields).
        bytes_written: compressed bytes written, checksums included.
        raw_bytes: uncompressed bytes those chunks hold.
        seconds: wall time of the save.
        bytes_reclaimed: stored bytes deleted because only commits older than the kept ones
            used them.
    """

    commit: int
    chunks_written: int
    bytes_written: int
    raw_bytes: int
    seconds: float
    bytes_reclaimed: int = 0

    generation = renamed_attribute("generation", "commit")

    def __str__(self) -> str:
        """One human line: ``commit 3: 12 chunks, 4.1 MiB written (9.8 MiB raw) in 0.81 s``
        (and ``, 1.2 MiB reclaimed`` when older chunk versions were deleted)."""
        line = (f"commit {self.commit}: {self.chunks_written:,} chunk"
                f"{'' if self.chunks_written == 1 else 's'}, {_mib(self.bytes_written)} written "
                f"({_mib(self.raw_bytes)} raw) in {self.seconds:.2f} s")
        return line + (f", {_mib(self.bytes_reclaimed)} reclaimed" if self.bytes_reclaimed
                       else "")


def _mib(n: int) -> str:
    """Bytes as ``KiB``/``MiB``/``GiB`` with one decimal (``B`` below 1 KiB)."""
    if n < 1024:
        return f"{n} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if n < 1024 * scale or unit == "GiB":
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class SaveFuture(Future):  # type: ignore[type-arg]
    """The future of a background save. Asking it for its result or exception counts as
    having seen a failure, which the saver then does not raise a second time."""

    observed = False

    def result(self, timeout: float | None = None) -> SaveReport:
        self.observed = True
        return super().result(timeout)  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        return super().exception(timeout)


class Saver:
    """Saves of one writable buffer from its working tier into its persistent tier."""

    def __init__(self, tier: PersistentTier, working: WorkingTier) -> None:
        self.tier, self.working = tier, working
        self.layout = tier.manifest.layout
        self.lock = threading.Lock()  # guards working-tier writes against a background save
        self.dirty: dict[str, set[int]] = {n: set() for n in tier.manifest.specs}
        self._job: SaveJob | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: SaveFuture | None = None

    def touch(self, names: Iterable[str], base_chunks: set[int]) -> None:
        """Before writing ``base_chunks`` of columns ``names`` (hold :attr:`lock`): copy aside
        what a running save still needs, record the chunks as changed in ``state.json`` and in
        the dirty sets."""
        names = list(names)
        if self._job is not None:
            self._job.protect(names, base_chunks, self._read_stored)
        self.working.mark_dirty(self.tier.manifest.commit, base_chunks)
        for name in names:
            self.dirty[name] |= base_chunks

    def save(self, manifest: Manifest, *, full: bool, background: bool) -> SaveReport | SaveFuture:
        """Commit ``manifest`` (its commit number and time are set here) with every chunk changed
        since the last commit (``full``: every filled chunk).

        Returns:
            a :class:`SaveReport`, or with ``background`` a :class:`SaveFuture` of one.

        Raises:
            OSError: the save failed; the previous commit is intact and the changes stay
            pending. Also the error of an earlier background save nobody has seen.
        """
        self.wait()
        with self.lock:
            job = self._start(manifest, full)
        if not background:
            return self._run(job)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rlbuffers-save")
        fut = self._pending = SaveFuture()
        fut.set_running_or_notify_cancel()
        self._executor.submit(self._run_into, job, fut)
        return fut

    def wait(self) -> None:
        """Block until a background save finishes.

        Raises:
            Exception: the background save's error, unless its future already reported it
            (raised once; the changes it could not commit are pending again).
        """
        fut, self._pending = self._pending, None
        if fut is None:
            return
        concurrent.futures.wait([fut])
        if not fut.observed:
            error = fut.exception()
            if error is not None:
                raise error

    def close(self) -> None:
        """Wait for a background save and stop the save thread (then raise what :meth:`wait`
        raises)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None

    def _start(self, manifest: Manifest, full: bool) -> SaveJob:
        if full:
            base = self.layout.filled_base_chunks(manifest.ring.size)
            todo = {n: self.layout.stored_of(n, base) for n in self.dirty}
        else:
            todo = {n: self.layout.stored_of(n, cs) for n, cs in self.dirty.items()}
        self.dirty = {n: set() for n in self.dirty}
        self._job = SaveJob(self.tier.manifest.commit + 1, todo, manifest, self.lock,
                            self.layout)
        return self._job

    def _read_stored(self, name: str, first: int, count: int) -> Any:
        """Rows of stored chunks ``[first, first + count)`` of ``name`` from the working tier."""
        a, _ = self.layout.stored_slots(name, first)
        _, b = self.layout.stored_slots(name, first + count - 1)
        return self.working.columns[name].read_range(a, b)

    def _run_into(self, job: SaveJob, fut: SaveFuture) -> None:
        try:
            fut.set_result(self._run(job))
        except BaseException as e:
            log.error("background save of %s failed (%s: %s); its changes stay pending",
                      self.tier.loc, type(e).__name__, e)
            fut.set_exception(e)

    def _after_failure(self, job: SaveJob) -> None:
        """A save failed: unless its commit's rename had already happened, its changes are
        pending again and what it staged is dropped (left for the next save if even that
        cannot be told)."""
        try:
            done = self.tier.committed(job.commit)
        except Exception:
            done = None
        if done:
            return
        for name, cs in job.todo.items():
            self.dirty[name] |= job.base_chunks(name, cs)
        if done is False:
            try:
                self.tier.abort()
            except Exception as e:
                log.warning("%s: could not drop the failed save's chunks (%s); the next save "
                            "does", self.tier.loc, e)

    def _after_commit(self, gen: int) -> int:
        """Reclaim old commits and record the working tier's state. Failures are logged, not
        raised: the commit stands, the next save reclaims, and a stale ``state.json`` only
        makes the next open rebuild more chunks. Returns the bytes reclaimed."""
        reclaimed = 0
        try:
            reclaimed = self.tier.apply(gen)
            self.working.flush()
            with self.lock:
                self.working.write_state(gen, set().union(*self.dirty.values()))
        except Exception as e:
            log.warning("%s: commit %d is committed, but finishing it failed (%s: %s); "
                        "the next save retries", self.tier.loc, gen, type(e).__name__, e)
        return reclaimed

    def _run(self, job: SaveJob) -> SaveReport:
        t0 = time.perf_counter()
        tier, gen = self.tier, job.commit
        chunks = nbytes = raw = 0
        try:
            tier.abort()
            for name in job.todo:
                chunk_bytes = (self.layout.stored_chunk_rows[name]
                               * tier.specs[name].estimate_bytes())
                for first, count in job.runs(name, max(1, SAVE_RUN_BYTES // chunk_bytes)):
                    data = job.take(name, first, count, self._read_stored)
                    nbytes += tier.stage_chunks(gen, name, first, data)
                    raw += rows_nbytes(data)
                    chunks += count
            tier.commit(job.manifest.replace(commit=gen, committed_at=time.time()))
        except BaseException:
            job.abandon()
            with self.lock:
                self._job = None
                self._after_failure(job)
            raise
        with self.lock:
            self._job = None
        reclaimed = self._after_commit(gen)
        report = SaveReport(gen, chunks, nbytes, raw, time.perf_counter() - t0, reclaimed)
        log.info("%s: %s", tier.loc, report)
        return report
