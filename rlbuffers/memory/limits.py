"""How much memory this process may use at most: the host's RAM or its cgroup's limit.

All sizes are in bytes. Unlike :func:`rlbuffers.memory.available_bytes` (what is free now),
this is the ceiling, including the page cache that a memory cgroup charges to the process.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def cgroup_limit_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"),
                       root: Path = CGROUP_ROOT) -> int | None:
    """Memory limit of this process's cgroup (v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``), or None when there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            limits.append(_read_int(root / rel / "memory.max"))
        elif "memory" in controllers.split(","):  # v1 memory controller
            limits.append(_read_int(root / "memory" / rel / "memory.limit_in_bytes"))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def memory_limit_bytes() -> int:
    """The most memory this process may use: the host's total RAM, or its cgroup's limit if
    smaller (v1 reports "no limit" as a huge number, which the host's RAM then caps)."""
    host = int(psutil.virtual_memory().total)
    cgroup = cgroup_limit_bytes()
    return host if cgroup is None else min(host, cgroup)
