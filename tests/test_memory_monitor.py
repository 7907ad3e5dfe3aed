"""Tests of the memory figures, the one cgroup reader, PeakMemory and MemoryMonitor: every
figure is checked against a known allocation or a made-up cgroup, never against itself."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import numpy as np
import pytest
import torch

from rlbuffers.memory import (
    MemoryMonitor,
    PeakMemory,
    available_bytes,
    cgroup_available_bytes,
    cgroup_limit_bytes,
    memory_limit_bytes,
    peak_rss_bytes,
    rss_bytes,
    tensor_summary,
)
from rlbuffers.memory.process import reset_peak_rss, reuse_heap, trim_heap

MIB = 2**20
LOGGER = "rlbuffers.memory.monitor"


def touch(n_bytes):
    """An array of ``n_bytes`` with every page written."""
    return np.ones(n_bytes, dtype=np.uint8)


def test_rss_moves_by_a_known_allocation_and_back():
    before = rss_bytes()
    block = touch(64 * MIB)
    assert 56 * MIB < rss_bytes() - before < 80 * MIB
    del block
    assert rss_bytes() - before < 16 * MIB  # numpy returns a block this large to the OS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_trim_heap_returns_freed_heap_blocks_held_below_a_live_one():
    """800 KB blocks (below the 1 MiB mmap threshold of conftest: heap) freed under live ones
    stay resident until trim_heap() releases them."""
    blocks = [np.ones(100_000) for _ in range(500)]  # 400 MB in the heap
    pins = [np.ones(90_000) for _ in range(3)]  # live blocks above them: no automatic trim
    del blocks
    before = rss_bytes()
    assert trim_heap() is True
    assert before - rss_bytes() > 300 * MIB
    assert all(p.sum() == 90_000 for p in pins)


REUSE = """
import numpy as np
from rlbuffers.memory.process import reuse_heap, rss_bytes, trim_heap
MIB = 2**20
assert reuse_heap({arg}) is {ret}
pin = np.ones(1000)
block = np.ones(12 * MIB)  # 96 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
before_free = rss_bytes()
del block
kept = rss_bytes()
grown = []
for _ in range(4):  # allocate and free a block of that size, over and over
    start = rss_bytes()
    again = np.ones(12 * MIB)
    grown.append(rss_bytes() - start)
    del again
trim_heap()
print(before_free, kept, rss_bytes(), *grown)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_reuse_heap_keeps_large_freed_blocks_until_trim():
    """reuse_heap(): a freed 96 MiB block stays resident, and a loop that allocates and frees
    blocks of that size is served from resident heap pages (RSS does not grow per block);
    trim_heap() then returns them. Without it, glibc maps every block afresh and unmaps it on
    free. The first block after the free may take new pages: any small allocation made in
    between (reading /proc for RSS) is carved from the freed chunk, so the heap's top serves
    the next one; from then on the two freed blocks coalesce and are reused. Fresh
    interpreters: conftest's allocator settings must not leak in."""
    import subprocess

    # Only what finds the interpreter and the package: variables earlier tests' libraries
    # leave in this process's environment (Ray's, torch's, allocator settings) stay out.
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}

    def run(arg, ret):
        out = subprocess.run([sys.executable, "-c", REUSE.format(arg=arg, ret=ret)],
                             capture_output=True, text=True, check=True, env=env).stdout
        before_free, kept, trimmed, *grown = (int(x) / MIB for x in out.split())
        return before_free, kept, trimmed, grown

    before_free, kept, trimmed, grown = run("", True)
    assert kept > before_free - 8  # the freed block stayed resident
    assert all(g < 8 for g in grown[1:]), grown  # later blocks reuse resident pages
    assert trimmed < kept - 80  # trim_heap gave it back
    before_free, kept, _, grown = run("1 << 20", True)  # 1 MiB: every block is mmapped again
    assert kept < before_free - 80
    assert all(g > 80 for g in grown), grown
    with pytest.raises(ValueError, match=r"max_block_bytes: expected an int in \[1, "
                                         r"2\*\*31 - 1\], got 4294967296"):
        reuse_heap(2**32)


def test_peak_rss_keeps_a_freed_allocation_until_reset():
    before = rss_bytes()
    del_block = touch(96 * MIB)
    del del_block
    assert peak_rss_bytes() > before + 88 * MIB
    assert reset_peak_rss()  # Linux >= 4.0, which CI runs
    assert peak_rss_bytes() < rss_bytes() + 16 * MIB


def sampled_at_least(n_bytes):
    """An ``on_sample`` callback and the event it sets once a sample reaches ``n_bytes``."""
    seen = threading.Event()
    return (lambda rss: seen.set() if rss >= n_bytes else None), seen


def test_peak_memory_measures_a_known_allocation_freed_inside_the_block():
    with PeakMemory() as outer:
        block = touch(64 * MIB)  # a new process peak: read from the high-water mark
        del block
        start = rss_bytes()
        on_sample, seen = sampled_at_least(start + 36 * MIB)
        with PeakMemory(on_sample=on_sample) as inner:  # under the process's peak: samples
            block = touch(40 * MIB)
            assert seen.wait(10)  # the sampler has seen the block before it is freed
            del block
    assert 56 * MIB < outer.peak_extra_rss_bytes < 96 * MIB
    assert outer.peak_extra_bytes == outer.peak_extra_rss_bytes
    assert 34 * MIB < inner.peak_extra_rss_bytes < 56 * MIB


CHILD_PHASES = """
import numpy as np
from rlbuffers.memory import PeakMemory
from rlbuffers.memory.process import rss_bytes
print(rss_bytes(), flush=True)
block = np.ones(160 * 2**20, dtype=np.uint8)
del block
for _ in range(3):  # phases after the peak, as a trainer's monitor runs them
    with PeakMemory():
        small = np.ones(8 * 2**20, dtype=np.uint8)
        del small
"""


def test_blocks_never_lower_the_process_peak_seen_from_outside():
    """The kernel's high-water mark is never reset by a block, so the process's peak that a
    parent reads when it exits (``wait4``'s ``ru_maxrss``, what ``/usr/bin/time`` prints)
    keeps an allocation made before later blocks."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", CHILD_PHASES], stdout=subprocess.PIPE,
                         text=True)
    baseline = int(p.stdout.readline())
    p.stdout.close()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == 0
    assert usage.ru_maxrss * 1024 > baseline + 150 * MIB
    high = peak_rss_bytes()
    with PeakMemory():
        pass
    assert peak_rss_bytes() >= high


def test_nested_peak_counts_in_the_outer_block():
    with PeakMemory() as outer:
        block = touch(40 * MIB)
        del block
        with PeakMemory() as inner:
            block = touch(96 * MIB)
            del block
        with PeakMemory():
            pass
    assert 88 * MIB < inner.peak_extra_rss_bytes < 120 * MIB
    assert 88 * MIB < outer.peak_extra_rss_bytes < 120 * MIB


def write_v2(root, rel, limit, current):
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{current}\n")


def cgroup_file(tmp_path, text):
    proc = tmp_path / "proc_cgroup"
    proc.write_text(text)
    return proc


def test_cgroup_v2_takes_the_tightest_level_of_the_chain(tmp_path):
    write_v2(tmp_path, "a", 300 * MIB, 250 * MIB)  # parent: tighter
    write_v2(tmp_path, "a/b", 500 * MIB, 100 * MIB)
    proc = cgroup_file(tmp_path, "0::/a/b\n")
    assert cgroup_limit_bytes(proc, tmp_path) == 300 * MIB
    assert cgroup_available_bytes(proc, tmp_path) == 50 * MIB
    assert available_bytes(proc, tmp_path) == 50 * MIB  # far under the host's
    assert memory_limit_bytes(proc, tmp_path) == 300 * MIB


def test_cgroup_v1_and_unlimited_levels(tmp_path):
    d = tmp_path / "memory" / "job"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{200 * MIB}\n")
    (d / "memory.usage_in_bytes").write_text(f"{120 * MIB}\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc = cgroup_file(tmp_path, "4:memory:/job\n1:cpu:/\n")
    assert cgroup_limit_bytes(proc, tmp_path) == 200 * MIB
    assert cgroup_available_bytes(proc, tmp_path) == 80 * MIB
    write_v2(tmp_path, "free", "max", 5)
    proc = cgroup_file(tmp_path, "0::/free\n")
    assert cgroup_limit_bytes(proc, tmp_path) is None
    assert cgroup_available_bytes(proc, tmp_path) is None
    assert cgroup_limit_bytes(tmp_path / "missing", tmp_path) is None


@pytest.fixture
def fake_cgroup(tmp_path):
    """A v2 cgroup of 1000 MiB; returns (set_used(mib), monitor kwargs)."""
    write_v2(tmp_path, "job", 1000 * MIB, 0)
    proc = cgroup_file(tmp_path, "0::/job\n")

    def set_used(mib):
        (tmp_path / "job" / "memory.current").write_text(f"{mib * MIB}\n")
    return set_used, {"proc_cgroup": proc, "cgroup_root": tmp_path}


def warnings_in(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_fraction_warnings_fire_once_per_level_with_gib_figures_and_whose(fake_cgroup, caplog):
    """Issue 45: a fraction that falls and rises again around a level (a neighbour filling
    the memory) is warned once per level, with the cgroup's GiB figures and this process's
    share; the cgroup here is made up, so the process's RSS is a small part of 900 MiB."""
    set_used, kw = fake_cgroup
    monitor = MemoryMonitor(warn_below_available_bytes=0, **kw)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        set_used(100)
        assert monitor.check().used_fraction == pytest.approx(0.1)
        assert warnings_in(caplog) == []
        set_used(900)
        monitor.check()
        monitor.check()
        assert len(warnings_in(caplog)) == 1 and "level 85%" in warnings_in(caplog)[0]
        set_used(960)
        monitor.check()
        assert "level 95%" in warnings_in(caplog)[-1]
        for used in (100, 900, 960, 100, 980):  # down and up again: nothing more
            set_used(used)
            monitor.check()
    said = warnings_in(caplog)
    assert len(said) == 2, said
    assert said[0].startswith("memory 90% full (warning level 85%, said once): this cgroup's "
                              "memory limit (the container's, page cache included): 0.9 of "
                              "1.0 GiB in use, this process's RSS ")
    assert "other processes hold most of it" in said[0] or rss_bytes() > 450 * MIB
    assert "0.9 of 1.0 GiB in use" in said[1] and "level 95%" in said[1]


def test_a_warning_says_when_this_process_holds_the_memory(fake_cgroup, caplog):
    """A cgroup of twice the process's RSS, 90% used: the process holds most of it."""
    _, kw = fake_cgroup
    rss = rss_bytes()
    write_v2(kw["cgroup_root"], "job", 2 * rss, int(1.8 * rss))
    monitor = MemoryMonitor(warn_below_available_bytes=0, log_capacity=False, **kw)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.check()
    said = warnings_in(caplog)
    assert len(said) == 1 and "this process holds most of it" in said[0], said


def test_low_memory_warning_names_the_threshold(fake_cgroup, caplog):
    set_used, kw = fake_cgroup
    set_used(950)
    monitor = MemoryMonitor(warn_below_available_bytes=64 * MIB, warn_fractions=[1.0], **kw)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        snap = monitor.check()
    assert snap.low and snap.available_bytes == 50 * MIB
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.check()  # still low: not said again
    said = warnings_in(caplog)
    assert len(said) == 1 and said[0].startswith(
        "low memory (said once): 0.05 GiB available, under the 0.06 GiB threshold; this "
        "cgroup's memory limit"), said


def test_phase_records_a_known_allocation_and_warns_before_oom(fake_cgroup, caplog):
    set_used, kw = fake_cgroup
    monitor = MemoryMonitor(warn_below_available_bytes=0, **kw)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with monitor.phase("generate") as peak:
            block = touch(64 * MIB)
            peak.sample()  # under an earlier process peak, the phase's peak is its samples'
            set_used(970)  # the cgroup fills up during the phase
            del block
        with monitor.phase("train"):
            pass
    assert 56 * MIB < monitor.phases["generate"].peak_extra_rss_bytes < 96 * MIB
    assert monitor.phases["train"].peak_extra_rss_bytes < 16 * MIB
    assert any("97%" in m for m in warnings_in(caplog))
    metrics = monitor.to_metrics()
    assert metrics["phase/generate/peak_extra_rss_bytes"] > 56 * MIB
    json.dumps(metrics)
    restored = MemoryMonitor(log_capacity=False, **kw)
    restored.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert restored.phases == monitor.phases


def test_capacity_is_logged_and_savings_are_metrics(fake_cgroup, caplog):
    _, kw = fake_cgroup
    with caplog.at_level(logging.INFO, logger=LOGGER):
        monitor = MemoryMonitor(**kw)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "cgroup limit 0.98 GiB" in text and "CPUs" in text
    assert monitor.capacity["cgroup_limit_bytes"] == 1000 * MIB
    monitor.record_saving("chunked_logprobs", 3 * MIB)
    monitor.record_saving("chunked_logprobs", 1 * MIB)
    assert monitor.to_metrics()["saved/chunked_logprobs_bytes"] == 4 * MIB
    with pytest.raises(ValueError, match="bytes_saved: expected >= 0, got -1"):
        monitor.record_saving("x", -1)


def test_tensor_summary_groups_by_owner():
    model = torch.nn.Linear(96, 80)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 96)).sum().backward()
    opt.step()
    marker = torch.zeros(777, 333)
    summary = tensor_summary(top_k=100_000)
    mine = {(tuple(t["shape"]), t["owner"]) for t in summary.top}
    assert ((80, 96), "parameter") in mine and ((80, 96), "gradient") in mine
    assert ((80, 96), "optimizer_state") in mine and ((777, 333), "other") in mine
    by_owner = {g["owner"]: g["bytes"] for g in summary.groups if g["dtype"] == "torch.float32"}
    assert by_owner["optimizer_state"] >= 2 * (80 * 96 + 80) * 4
    assert summary.total_bytes >= marker.numel() * 4 + 4 * (80 * 96 + 80) * 4
    assert tensor_summary(top_k=1).top[0]["bytes"] >= marker.numel() * 4


@pytest.mark.parametrize("kwargs, match", [
    ({"warn_below_available_bytes": -1}, "warn_below_available_bytes: expected >= 0, got -1"),
    ({"warn_fractions": [0.5, 1.5]}, r"warn_fractions: expected values in \(0, 1\]"),
])
def test_bad_monitor_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryMonitor(**kwargs)


def test_bad_peak_and_census_arguments_are_named():
    with pytest.raises(ValueError, match="sample_interval_s: expected > 0, got 0"):
        PeakMemory(sample_interval_s=0)
    with pytest.raises(ValueError, match="top_k: expected >= 0, got -1"):
        tensor_summary(top_k=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_phase_records_cuda_max_memory_allocated():
    monitor = MemoryMonitor(device="cuda:0", log_capacity=False)
    assert monitor.capacity["cuda"][0]["total_bytes"] > 0
    with monitor.phase("gpu"):
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:0")
        del x
    assert monitor.phases["gpu"].cuda_peak_extra_bytes >= 64 * MIB


def test_a_fuller_cuda_device_is_named_with_torchs_share(fake_cgroup, caplog, monkeypatch):
    """The CUDA branch of the warnings, with made-up device figures (no GPU needed): 90 of
    100 GiB in use on the device, 80 GiB of it reserved by this process's torch."""
    set_used, kw = fake_cgroup
    set_used(100)
    monitor = MemoryMonitor(warn_below_available_bytes=0, log_capacity=False, **kw)
    monitor._cuda = "cuda:0"  # as a monitor made with device="cuda:0" holds it
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 80 * gib)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert monitor.check().used_fraction == pytest.approx(0.9)
    assert warnings_in(caplog) == [
        "memory 90% full (warning level 85%, said once): CUDA device cuda:0's memory: 90.0 of "
        "100.0 GiB in use, this process's memory reserved by torch 80.0 GiB: this process "
        "holds most of it; an out-of-memory error may follow"]
