"""Memory tools: process RSS, available memory, and a low-memory monitor."""

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
    "peak_rss_bytes",
    "rss_bytes",
]
