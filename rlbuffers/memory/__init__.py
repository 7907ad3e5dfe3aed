"""Memory tools: process RSS, available memory, the memory limit, and a low-memory monitor."""

from rlbuffers.memory.limits import cgroup_limit_bytes, memory_limit_bytes
from rlbuffers.memory.monitor import (
    MemoryMonitor,
    MemorySnapshot,
    available_bytes,
    cgroup_available_bytes,
    peak_rss_bytes,
    rss_bytes,
)

__all__ = [
    "MemoryMonitor",
    "MemorySnapshot",
    "available_bytes",
    "cgroup_available_bytes",
    "cgroup_limit_bytes",
    "memory_limit_bytes",
    "peak_rss_bytes",
    "rss_bytes",
]
