"""A monitor that logs the machine's capacity, each phase's peak memory, warnings before an
out-of-memory, and what memory optimisations saved. All sizes are in bytes."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbuffers.memory.capacity import capacity
from rlbuffers.memory.cgroup import CGROUP_ROOT, PROC_SELF_CGROUP, cgroup_limit_bytes
from rlbuffers.memory.limits import available_bytes, memory_limit_bytes
from rlbuffers.memory.peak import PeakMemory, _cuda_device
from rlbuffers.memory.process import peak_rss_bytes, rss_bytes

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory figures at one moment, all in bytes.

    Attributes:
        rss_bytes: resident set size of this process.
        peak_rss_bytes: largest resident set size so far.
        available_bytes: memory still available to this process (see :func:`available_bytes`).
        low: ``available_bytes`` was under the monitor's threshold.
        used_fraction: ``1 - available / limit`` (host RAM or cgroup limit).
    """

    rss_bytes: int
    peak_rss_bytes: int
    available_bytes: int
    low: bool
    used_fraction: float = 0.0

    def to_dict(self) -> dict[str, int | bool | float]:
        """Plain-data form, e.g. for a metrics line."""
        return {"rss_bytes": self.rss_bytes, "peak_rss_bytes": self.peak_rss_bytes,
                "available_bytes": self.available_bytes, "low": self.low,
                "used_fraction": self.used_fraction}


@dataclass(frozen=True)
class Usage:
    """Whose memory is how full, for a warning: ``used_bytes`` of ``total_bytes`` of
    ``whose`` (the machine's RAM, a cgroup's limit or a CUDA device), and this process's
    share (``own_bytes``: its RSS, or on a CUDA device what torch reserved)."""

    fraction: float
    used_bytes: int
    total_bytes: int
    whose: str
    own_bytes: int
    own: str = "RSS"

    def describe(self) -> str:
        """``the machine's RAM: 21.9 of 24.0 GiB in use, this process's RSS 2.8 GiB: other
        processes hold the rest`` (or ``...: this process holds most of it``)."""
        mine = ("this process holds most of it" if self.own_bytes >= self.used_bytes / 2
                else "other processes hold most of it")
        return (f"{self.whose}: {self.used_bytes / GIB:.1f} of {self.total_bytes / GIB:.1f} "
                f"GiB in use, this process's {self.own} {self.own_bytes / GIB:.1f} GiB: {mine}")


@dataclass(frozen=True)
class PhaseRecord:
    """Peak memory of one ``monitor.phase(name)`` block (bytes; CUDA 0 without a device)."""

    name: str
    peak_rss_bytes: int
    peak_extra_rss_bytes: int
    cuda_peak_bytes: int
    cuda_peak_extra_bytes: int


def _check_fractions(fractions: Sequence[float]) -> tuple[float, ...]:
    out = tuple(sorted(float(f) for f in fractions))
    if any(not 0 < f <= 1 for f in out):
        raise ValueError(f"warn_fractions: expected values in (0, 1], got {list(fractions)}")
    return out


class MemoryMonitor:
    """Memory figures, phase peaks and early warnings for a training loop.

    Args:
        warn_below_available_bytes: :meth:`check` logs a warning (once in the monitor's
            life) when available memory is under this many bytes (>= 0).
        warn_fractions: fractions of the memory limit (host RAM or cgroup limit; or of the
            CUDA ``device``'s memory, whichever is fuller) whose crossing logs a warning,
            once per level in the monitor's life, from :meth:`check` and from the sampling
            thread of each phase (each in (0, 1]). Warnings give the GiB figures, whose
            memory it is and this process's share (other processes may be filling it).
        device: CUDA device whose ``max_memory_allocated`` each phase records (None: RSS only).
        sample_interval_s: seconds between RSS samples inside a phase.
        log_capacity: log :func:`capacity` (RAM, cgroup limit, CPUs, CUDA devices) now.
        proc_cgroup, cgroup_root: where cgroups are read (tests pass made-up ones).

    Raises:
        ValueError: a negative threshold or a fraction outside (0, 1].
    """

    def __init__(self, *, warn_below_available_bytes: int = GIB,
                 warn_fractions: Sequence[float] = (0.85, 0.95), device: Any = None,
                 sample_interval_s: float = 0.01, log_capacity: bool = True,
                 proc_cgroup: Path = PROC_SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> None:
        if warn_below_available_bytes < 0:
            raise ValueError("warn_below_available_bytes: expected >= 0, got "
                             f"{warn_below_available_bytes}")
        self.warn_below_available_bytes = int(warn_below_available_bytes)
        self.warn_fractions = _check_fractions(warn_fractions)
        self.device = device
        self._cuda = _cuda_device(device)
        self.sample_interval_s = sample_interval_s
        self._cgroup = (proc_cgroup, cgroup_root)
        self._level = 0  # how many warn_fractions have been reached (each warned once)
        self._warned_low = False  # the low-memory warning is said once
        self._lock = threading.Lock()
        self.phases: dict[str, PhaseRecord] = {}
        self.savings: dict[str, int] = {}
        self.capacity = capacity(*self._cgroup)
        if log_capacity:
            self._log_capacity()

    def _log_capacity(self) -> None:
        c = self.capacity
        limit = c["cgroup_limit_bytes"]
        log.info("memory capacity: RAM %.2f GiB total, %.2f GiB available, cgroup limit %s, "
                 "%d CPUs", c["ram_total_bytes"] / GIB, c["ram_available_bytes"] / GIB,
                 "none" if limit is None else f"{limit / GIB:.2f} GiB", c["cpu_count"])
        for d in c["cuda"]:
            log.info("memory capacity: %s (%s) %.2f GiB total, %.2f GiB free", d["device"],
                     d["name"], d["total_bytes"] / GIB, d["free_bytes"] / GIB)

    def _usage(self, avail: int) -> Usage:
        """How full the memory is: the RAM limit's (host RAM, or the cgroup's limit when it is
        smaller), or the CUDA device's when that is fuller."""
        limit = memory_limit_bytes(*self._cgroup)
        used = min(1.0, max(0.0, 1 - avail / limit)) if limit else 0.0
        cgroup = cgroup_limit_bytes(*self._cgroup)
        whose = "the machine's RAM" if cgroup is None or cgroup > limit else \
            "this cgroup's memory limit (the container's, page cache included)"
        usage = Usage(used, max(0, limit - avail), limit, whose, rss_bytes())
        if self._cuda is not None:
            torch = sys.modules["torch"]
            free, total = torch.cuda.mem_get_info(self._cuda)
            if total and 1 - free / total > used:
                usage = Usage(1 - free / total, total - free, total,
                              f"CUDA device {self._cuda}'s memory",
                              int(torch.cuda.memory_reserved(self._cuda)),
                              "memory reserved by torch")
        return usage

    def _warn_fractions(self, usage: Usage) -> None:
        """Warn once per level of :attr:`warn_fractions` (the first time the used fraction
        reaches it in this monitor's life: a fraction that goes down and up again around a
        level is not repeated)."""
        with self._lock:
            level = sum(usage.fraction >= f for f in self.warn_fractions)
            crossed, self._level = level > self._level, max(level, self._level)
        if crossed:
            log.warning("memory %.0f%% full (warning level %.0f%%, said once): %s; an "
                        "out-of-memory error may follow", usage.fraction * 100,
                        self.warn_fractions[level - 1] * 100, usage.describe())

    def check(self) -> MemorySnapshot:
        """Measure now; warn (once per monitor) if available memory is under the threshold,
        and once per level of ``warn_fractions`` reached."""
        avail = available_bytes(*self._cgroup)
        usage = self._usage(avail)
        snap = MemorySnapshot(rss_bytes=rss_bytes(), peak_rss_bytes=peak_rss_bytes(),
                              available_bytes=avail,
                              low=avail < self.warn_below_available_bytes,
                              used_fraction=usage.fraction)
        with self._lock:
            warn_low, self._warned_low = snap.low and not self._warned_low, \
                self._warned_low or snap.low
        if warn_low:
            log.warning("low memory (said once): %.2f GiB available, under the %.2f GiB "
                        "threshold; %s", avail / GIB, self.warn_below_available_bytes / GIB,
                        usage.describe())
        self._warn_fractions(usage)
        return snap

    def _used_fraction(self, avail: int) -> float:
        """Used fraction of the RAM limit, or of the CUDA device's memory if that is higher."""
        return self._usage(avail).fraction

    def _on_sample(self, _rss: int) -> None:
        self._warn_fractions(self._usage(available_bytes(*self._cgroup)))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PeakMemory]:
        """Record the peak memory of the block as phase ``name`` (see :class:`PeakMemory`);
        a phase run again keeps the largest peak. Checks warnings while it runs and at exit.
        """
        peak = PeakMemory(device=self.device, sample_interval_s=self.sample_interval_s,
                          on_sample=self._on_sample)
        try:
            with peak:
                yield peak
        finally:
            self.check()
            old = self.phases.get(name)
            rec = PhaseRecord(name, peak.peak_rss_bytes, peak.peak_extra_rss_bytes,
                              peak.cuda_peak_bytes, peak.cuda_peak_extra_bytes)
            if old is not None:
                rec = PhaseRecord(name, *(max(a, b) for a, b in
                                          zip(_fields(old), _fields(rec), strict=True)))
            self.phases[name] = rec
            log.debug("phase %s: peak RSS %.1f MiB (+%.1f MiB)", name,
                      rec.peak_rss_bytes / 2**20, rec.peak_extra_rss_bytes / 2**20)

    def record_saving(self, name: str, bytes_saved: int) -> None:
        """Log (and add to ``to_metrics()``) the bytes an optimisation saved, e.g. the
        ``[B, T, V]`` logits chunked log-probs avoided; repeated names add up.

        Raises:
            ValueError: ``bytes_saved`` < 0.
        """
        if bytes_saved < 0:
            raise ValueError(f"bytes_saved: expected >= 0, got {bytes_saved}")
        self.savings[name] = self.savings.get(name, 0) + int(bytes_saved)
        log.info("memory saved by %s: %.1f MiB", name, bytes_saved / 2**20)

    def to_metrics(self) -> dict[str, float | int | bool]:
        """Flat plain dict for a JSONL metrics line: the current snapshot, ``phase/NAME/...``
        peaks and ``saved/NAME_bytes``."""
        out: dict[str, float | int | bool] = dict(self.check().to_dict())
        for name, rec in self.phases.items():
            out[f"phase/{name}/peak_rss_bytes"] = rec.peak_rss_bytes
            out[f"phase/{name}/peak_extra_rss_bytes"] = rec.peak_extra_rss_bytes
            if self.device is not None:
                out[f"phase/{name}/cuda_peak_bytes"] = rec.cuda_peak_bytes
        for name, saved in self.savings.items():
            out[f"saved/{name}_bytes"] = saved
        return out

    def tensor_summary(self, *, top_k: int = 10) -> Any:
        """Live torch tensors by device, dtype and owner; see
        :func:`rlbuffers.memory.census.tensor_summary` (needs torch)."""
        from rlbuffers.memory.census import tensor_summary
        return tensor_summary(top_k=top_k)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: phase peaks and savings (JSON-ready)."""
        return {"phases": {k: list(_fields(v)) for k, v in self.phases.items()},
                "savings": dict(self.savings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore phase peaks and savings from :meth:`state_dict`."""
        self.phases = {k: PhaseRecord(k, *v) for k, v in state["phases"].items()}
        self.savings = {k: int(v) for k, v in state["savings"].items()}


def _fields(rec: PhaseRecord) -> tuple[int, int, int, int]:
    return (rec.peak_rss_bytes, rec.peak_extra_rss_bytes, rec.cuda_peak_bytes,
            rec.cuda_peak_extra_bytes)
