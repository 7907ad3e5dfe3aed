"""Tests of rlbuffers.memory.monitor: figures in bytes, cgroup limits, low-memory warnings."""

from __future__ import annotations

import logging

import numpy as np
import psutil
import pytest

from rlbuffers.memory import (
    MemoryMonitor,
    available_bytes,
    cgroup_available_bytes,
    peak_rss_bytes,
    rss_bytes,
)

MIB = 2**20


def test_rss_grows_when_memory_is_touched_and_peak_keeps_it():
    before = rss_bytes()
    block = np.ones(64 * MIB, dtype=np.uint8)  # 64 MiB, every page written
    during = rss_bytes()
    assert during - before > 48 * MIB
    # the kernel updates its high-water mark lazily, so allow a little slack
    assert peak_rss_bytes() > before + 48 * MIB
    del block


def test_rss_agrees_with_psutil():
    assert abs(rss_bytes() - psutil.Process().memory_info().rss) < 16 * MIB


def test_available_without_cgroup_is_host_available(tmp_path):
    host = psutil.virtual_memory().available
    assert cgroup_available_bytes(tmp_path) is None
    assert abs(available_bytes(tmp_path) - host) < 256 * MIB


def test_cgroup_limit_bounds_available(tmp_path):
    (tmp_path / "memory.max").write_text(f"{300 * MIB}\n")
    (tmp_path / "memory.current").write_text(f"{100 * MIB}\n")
    assert cgroup_available_bytes(tmp_path) == 200 * MIB
    assert available_bytes(tmp_path) == min(200 * MIB, psutil.virtual_memory().available)


def test_unlimited_cgroup_is_ignored(tmp_path):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("12345\n")
    assert cgroup_available_bytes(tmp_path) is None


def test_check_warns_under_threshold(tmp_path, caplog):
    (tmp_path / "memory.max").write_text(f"{150 * MIB}\n")
    (tmp_path / "memory.current").write_text(f"{100 * MIB}\n")
    monitor = MemoryMonitor(warn_below_available_bytes=64 * MIB, cgroup_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlbuffers.memory.monitor"):
        snap = monitor.check()
    assert snap.low and snap.available_bytes == 50 * MIB
    assert snap.rss_bytes > 0 and snap.peak_rss_bytes >= snap.rss_bytes - 16 * MIB
    assert any("low memory" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_check_is_quiet_above_threshold(tmp_path, caplog):
    monitor = MemoryMonitor(warn_below_available_bytes=0, cgroup_dir=tmp_path)
    with caplog.at_level(logging.DEBUG, logger="rlbuffers.memory.monitor"):
        snap = monitor.check()
    assert not snap.low
    assert snap.to_dict()["available_bytes"] == snap.available_bytes
    assert not caplog.records


def test_negative_threshold_is_rejected():
    with pytest.raises(ValueError, match="warn_below_available_bytes"):
        MemoryMonitor(warn_below_available_bytes=-1)
