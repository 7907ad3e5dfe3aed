"""Process and machine memory figures, and a monitor that warns when memory runs low.

All sizes are in bytes. ``available_bytes`` respects a cgroup v2 memory limit (containers),
where the host-wide figure from ``psutil.virtual_memory()`` would overstate what is left.
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

#: Where a cgroup v2 hierarchy exposes the limit and usage of the current container.
CGROUP_DIR = Path("/sys/fs/cgroup")
GIB = 2**30


def rss_bytes() -> int:
    """Resident set size of this process now, in bytes."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """Largest resident set size this process has had, in bytes (``ru_maxrss``).

    ``ru_maxrss`` is in KiB on Linux and in bytes on macOS; both are converted to bytes.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def cgroup_available_bytes(cgroup_dir: Path = CGROUP_DIR) -> int | None:
    """Bytes left under a cgroup v2 memory limit (``memory.max - memory.current``).

    Returns None when there is no cgroup v2 limit (files missing, unreadable, or ``max``).
    """
    try:
        limit = (cgroup_dir / "memory.max").read_text().strip()
        used = int((cgroup_dir / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    try:
        return max(0, int(limit) - used)
    except ValueError:
        return None


def available_bytes(cgroup_dir: Path = CGROUP_DIR) -> int:
    """Memory that can still be allocated without swapping, in bytes.

    The smaller of the host's available memory (``psutil.virtual_memory().available``) and
    what is left under a cgroup v2 limit, if one applies.
    """
    host = int(psutil.virtual_memory().available)
    cgroup = cgroup_available_bytes(cgroup_dir)
    return host if cgroup is None else min(host, cgroup)


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory figures at one moment, all in bytes.

    Attributes:
        rss_bytes: resident set size of this process.
        peak_rss_bytes: largest resident set size so far.
        available_bytes: memory still available to this process (see :func:`available_bytes`).
        low: ``available_bytes`` was under the monitor's threshold.
    """

    rss_bytes: int
    peak_rss_bytes: int
    available_bytes: int
    low: bool

    def to_dict(self) -> dict[str, int | bool]:
        """Plain-data form, e.g. for a metrics line."""
        return {"rss_bytes": self.rss_bytes, "peak_rss_bytes": self.peak_rss_bytes,
                "available_bytes": self.available_bytes, "low": self.low}


class MemoryMonitor:
    """Takes memory snapshots and logs a warning when available memory is low.

    Args:
        warn_below_available_bytes: threshold in bytes; :meth:`check` logs a warning (logger
            ``rlbuffers.memory.monitor``) whenever available memory is under it.
        cgroup_dir: cgroup v2 directory whose limit also bounds available memory.

    Raises:
        ValueError: a negative threshold.
    """

    def __init__(self, *, warn_below_available_bytes: int = GIB,
                 cgroup_dir: Path = CGROUP_DIR) -> None:
        if warn_below_available_bytes < 0:
            raise ValueError("warn_below_available_bytes: expected >= 0, got "
                             f"{warn_below_available_bytes}")
        self.warn_below_available_bytes = int(warn_below_available_bytes)
        self.cgroup_dir = cgroup_dir

    def check(self) -> MemorySnapshot:
        """Measure now; log a warning if available memory is under the threshold."""
        avail = available_bytes(self.cgroup_dir)
        snap = MemorySnapshot(rss_bytes=rss_bytes(), peak_rss_bytes=peak_rss_bytes(),
                              available_bytes=avail,
                              low=avail < self.warn_below_available_bytes)
        if snap.low:
            log.warning("low memory: %.2f GiB available, under the %.2f GiB threshold "
                        "(process RSS %.2f GiB)", avail / GIB,
                        self.warn_below_available_bytes / GIB, snap.rss_bytes / GIB)
        return snap
