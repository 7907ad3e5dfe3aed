"""The one reader of memory cgroups (v1 and v2): limit and usage of this process's cgroup.

All sizes are in bytes. A process is bounded by its own cgroup and by every ancestor up to
the hierarchy's root, so each figure is the tightest over that chain. ``/proc/self/cgroup``
names the cgroup: ``0::/path`` for the v2 unified hierarchy (files ``memory.max``,
``memory.current`` under ``root/path``), ``N:memory:/path`` for the v1 memory controller
(``memory.limit_in_bytes``, ``memory.usage_in_bytes`` under ``root/memory/path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: v1 reports "no limit" as a number near 2**63 (rounded to pages); treat anything this big so.
_UNLIMITED_BYTES = 2**62

_FILES = {2: ("memory.max", "memory.current"), 1: ("memory.limit_in_bytes",
                                                   "memory.usage_in_bytes")}


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup directory on the chain from this process's cgroup up to the root.

    Attributes:
        version: 1 or 2.
        path: the directory.
        limit_bytes: its memory limit, None when unlimited or unreadable.
        usage_bytes: memory charged to it (page cache included), None when unreadable.
    """

    version: int
    path: Path
    limit_bytes: int | None
    usage_bytes: int | None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2): no limit
        return None
    value = int(text)
    return None if value >= _UNLIMITED_BYTES else value


def _leaf_dirs(proc_cgroup: Path, root: Path) -> list[tuple[int, Path, Path]]:
    """(version, hierarchy root, leaf directory) of each memory hierarchy of this process."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            found.append((2, root, root / rel.lstrip("/")))
        elif "memory" in controllers.split(","):
            found.append((1, root / "memory", root / "memory" / rel.lstrip("/")))
    return found


def cgroup_levels(proc_cgroup: Path = PROC_SELF_CGROUP,
                  root: Path = CGROUP_ROOT) -> list[CgroupLevel]:
    """Every memory cgroup level that bounds this process, leaf first.

    Args:
        proc_cgroup: the ``/proc/<pid>/cgroup`` file to read (tests pass a made-up one).
        root: where the cgroup hierarchies are mounted.

    Returns:
        The levels whose limit or usage could be read; empty outside any cgroup.
    """
    levels = []
    for version, top, leaf in _leaf_dirs(proc_cgroup, root):
        limit_name, usage_name = _FILES[version]
        d = leaf
        while True:
            level = CgroupLevel(version, d, _read_int(d / limit_name), _read_int(d / usage_name))
            if level.limit_bytes is not None or level.usage_bytes is not None:
                levels.append(level)
            if d == top or top not in d.parents:
                break
            d = d.parent
    return levels


def cgroup_limit_bytes(proc_cgroup: Path = PROC_SELF_CGROUP,
                       root: Path = CGROUP_ROOT) -> int | None:
    """Tightest memory limit over this process's cgroup chain (v1 or v2), in bytes, or None
    when there is none or it cannot be read."""
    limits = [lv.limit_bytes for lv in cgroup_levels(proc_cgroup, root)
              if lv.limit_bytes is not None]
    return min(limits) if limits else None


def cgroup_available_bytes(proc_cgroup: Path = PROC_SELF_CGROUP,
                           root: Path = CGROUP_ROOT) -> int | None:
    """Bytes left under the tightest cgroup limit (``limit - usage`` at each limited level),
    or None when no level has both a limit and a usage.

    Usage includes page cache, which the kernel reclaims before an OOM kill, so this is a
    lower bound on what can still be allocated.
    """
    left = [max(0, lv.limit_bytes - lv.usage_bytes) for lv in cgroup_levels(proc_cgroup, root)
            if lv.limit_bytes is not None and lv.usage_bytes is not None]
    return min(left) if left else None
