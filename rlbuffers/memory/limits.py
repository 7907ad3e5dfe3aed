"""How much memory this process may use: the ceiling (host RAM or cgroup limit) and what is
still available now. All sizes are in bytes; cgroups are read by :mod:`.cgroup` only."""

from __future__ import annotations

from pathlib import Path

import psutil

from rlbuffers.memory.cgroup import (
    CGROUP_ROOT,
    PROC_SELF_CGROUP,
    cgroup_available_bytes,
    cgroup_limit_bytes,
)

__all__ = ["available_bytes", "cgroup_limit_bytes", "memory_limit_bytes"]


def memory_limit_bytes(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """The most memory this process may use: the host's total RAM, or its cgroup's limit if
    smaller. This is the ceiling, including the page cache a memory cgroup charges."""
    host = int(psutil.virtual_memory().total)
    cgroup = cgroup_limit_bytes(proc_cgroup, root)
    return host if cgroup is None else min(host, cgroup)


def available_bytes(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """Memory that can still be allocated without swapping, in bytes: the smaller of the
    host's available memory (``psutil.virtual_memory().available``) and what is left under
    the cgroup limits (see :func:`rlbuffers.memory.cgroup.cgroup_available_bytes`)."""
    host = int(psutil.virtual_memory().available)
    cgroup = cgroup_available_bytes(proc_cgroup, root)
    return host if cgroup is None else min(host, cgroup)
