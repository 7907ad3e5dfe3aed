"""ZarrStorage against TorchRL's own storages (issue 46): extend, sample (uniform and
prioritized), save (``dumps``: full, then after +2% more rows) and resume (a new storage +
``loads``, then one sample), with peak RSS, each system in a fresh subprocess. Each ``dumps``
is also timed together with an fsync of every file and directory it wrote (``dumps + fsync``):
ZarrStorage's commit fsyncs before it returns, TorchRL's ``dumps`` does not, so this is the
peer at the same durability.

Systems: ``LazyTensorStorage`` (rows in RAM) and ``LazyMemmapStorage`` (rows in a memory map)
saved with TorchRL's ``ReplayBuffer.dumps`` / ``loads``, and ``ZarrStorage`` (rows in the
buffer's working tier; ``dumps`` = an incremental, atomic commit + a pointer file). Sizes: (a)
Atari frames, uint8 ``[4, 84, 84]`` (28 KB rows; a few rectangles of grey levels per frame, so
they compress as frames do), (b) float32 rows of 256 KB (random normals: incompressible, the
worst case for the compressed commit). Every run extends in batches of ``--batch`` rows,
draws 64 batches of 256 rows, saves, adds 2%, saves again, then resumes in a new process.

    python -m tools.bench.bench_torchrl [--atari-rows 100000] [--float-rows 10000] [--runs 3]
                                        [--no-write]

Writes the ``torchrl`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tools.bench.report import run_sampled, stamp, table, write_section

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("LazyTensorStorage", "LazyMemmapStorage", "ZarrStorage")
SIZES = {"atari": ((4, 84, 84), "uint8"), "float": ((65536,), "float32")}
SAMPLE_BATCH, SAMPLES = 256, 64


class PeakRss:
    """This process's largest RSS (bytes) while the ``with`` block runs, sampled every 5 ms."""

    def __enter__(self) -> PeakRss:
        mem = psutil.Process().memory_info()
        self.peak, self._stop = mem.rss, threading.Event()
        self.before = self.peak
        #: largest anonymous RSS (RSS less file-backed and shared pages: the process's own
        #: allocations, not the memory-mapped rows the kernel may drop)
        self.anon_peak = mem.rss - mem.shared
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.005):
            self._sample(proc)

    def _sample(self, proc: psutil.Process) -> None:
        mem = proc.memory_info()
        self.peak = max(self.peak, mem.rss)
        self.anon_peak = max(self.anon_peak, mem.rss - mem.shared)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self._sample(psutil.Process())


def fsync_tree(root: str) -> None:
    """fsync every file under ``root`` and every directory (``root`` included): what makes a
    save that wrote them durable (the ``dumps + fsync`` columns)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rows(size: str, n: int, seed: int):
    """``n`` rows of size ``size`` as a TensorDict (same content for every system)."""
    import numpy as np
    import torch
    from tensordict import TensorDict

    shape, dtype = SIZES[size]
    rng = np.random.default_rng(seed)
    if size == "atari":
        obs = np.zeros((n, *shape), np.uint8)
        for i in range(n):
            for _ in range(6):
                y, x = rng.integers(0, 76, 2)
                obs[i, :, y:y + 8, x:x + 8] = rng.integers(0, 256)
    else:
        obs = rng.standard_normal((n, *shape), dtype=np.float32)
    return TensorDict({"obs": torch.from_numpy(obs),
                       "action": torch.from_numpy(rng.integers(0, 6, n)),
                       "reward": torch.from_numpy(rng.standard_normal(n).astype(np.float32))},
                      batch_size=[n])


def make(system: int, capacity: int, where: str, prioritized: bool, memmap_dir: str = "memmap",
         codec: str = "blosc-lz4"):
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

    from rlbuffers.integrations.torchrl import ZarrPrioritizedSampler, ZarrStorage

    if system == 0:
        storage = LazyTensorStorage(capacity)
    elif system == 1:
        storage = LazyMemmapStorage(capacity, scratch_dir=os.path.join(where, memmap_dir))
    else:
        storage = ZarrStorage(os.path.join(where, "zarr"), capacity, seed=0, codec=codec)
    sampler = ZarrPrioritizedSampler(capacity, 0.6, 0.4) if prioritized else None
    return TensorDictReplayBuffer(storage=storage, sampler=sampler) if sampler else \
        TensorDictReplayBuffer(storage=storage)


def child(system: int, size: str, n: int, batch: int, where: str, phase: str,
          codec: str = "blosc-lz4") -> dict:
    """One run's phase in this process: ``fill`` (extend, sample, save, +2%, save) or
    ``resume`` (new storage + loads + one sample)."""
    import torch
    from torchrl.data import TensorDictReplayBuffer  # imported before any clock starts

    import rlbuffers.integrations.torchrl.sampler  # noqa: F401

    torch.set_num_threads(1)
    data = rows(size, batch, 0)
    ckpt = os.path.join(where, "ckpt")
    prio = system == 2
    if phase == "resume":
        t = time.perf_counter()
        rb = make(system, n, where, prio, memmap_dir="memmap-resumed", codec=codec)
        rb.loads(ckpt)
        rb.sample(SAMPLE_BATCH)
        return {"resume_s": time.perf_counter() - t, "len": len(rb)}
    rb = make(system, n, where, prio, codec=codec)
    t = time.perf_counter()
    for _ in range(n // batch):
        rb.extend(data)
    out = {"extend_s": time.perf_counter() - t}
    def draw_ms(buffer: TensorDictReplayBuffer) -> float:
        times = []
        for _ in range(SAMPLES):
            t = time.perf_counter()
            buffer.sample(SAMPLE_BATCH)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    # uniform: TorchRL's default RandomSampler, through a TensorDictReplayBuffer, for all
    out["sample_ms"] = draw_ms(TensorDictReplayBuffer(storage=rb.storage))
    if prio:
        out["prio_sample_ms"] = draw_ms(rb)
    with PeakRss() as rss:
        t = time.perf_counter()
        rb.dumps(ckpt)
        out["save_full_s"] = time.perf_counter() - t
        fsync_tree(ckpt)  # the same save made durable (ZarrStorage's commit fsyncs already)
        out["save_full_sync_s"] = time.perf_counter() - t
    out["save_full_rss_mb"] = rss.peak / 2**20
    extra = rows(size, max(1, n // 50), 1)
    rb.extend(extra)  # +2% (overwrites the oldest 2% of a full ring)
    with PeakRss() as rss:
        t = time.perf_counter()
        rb.dumps(ckpt)  # TorchRL's: into the same directory again, page-cached files
        out["save_2pct_s"] = time.perf_counter() - t
        fsync_tree(ckpt)
        out["save_2pct_sync_s"] = time.perf_counter() - t
    out["save_2pct_rss_mb"] = rss.peak / 2**20
    out["save_2pct_extra_mb"] = (rss.peak - rss.before) / 2**20
    out["save_2pct_anon_mb"] = rss.anon_peak / 2**20
    if system == 2:
        rb.storage.close()
    return out


def run(system: int, size: str, n: int, batch: int, where: str, phase: str,
        codec: str = "blosc-lz4") -> dict:
    """:func:`child` in a fresh subprocess, its RSS sampled from outside."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tools.bench.bench_torchrl", "--child", str(system),
           "--size", size, "--rows", str(n), "--batch", str(batch), "--where", where,
           "--phase", phase, "--codec", codec]
    res = run_sampled(cmd, env)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd}: exit {res.returncode}\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out[f"{phase}_peak_rss_mb"] = res.peak_rss_bytes / 2**20
    return out


def measure(size: str, n: int, batch: int, runs: int, systems: tuple[int, ...] = (0, 1, 2),
            codec: str = "blosc-lz4") -> dict[int, dict[str, float]]:
    results: dict[int, list[dict]] = {s: [] for s in systems}
    for r in range(runs):
        order = systems if r % 2 == 0 else systems[::-1]  # alternate who goes first
        for system in order:
            where = tempfile.mkdtemp(prefix="rlb-bench-torchrl-", dir=os.environ.get("TMPDIR"))
            try:
                out = run(system, size, n, batch, where, "fill", codec)
                out.update(run(system, size, n, batch, where, "resume", codec))
            finally:
                shutil.rmtree(where, ignore_errors=True)
            results[system].append(out)
            print(size, SYSTEMS[system], json.dumps(out), flush=True)
    return {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            for s, rs in results.items()}


def section(args, figures: dict[str, dict[int, dict[str, float]]], total_s: float) -> str:
    heads = ["size", "storage", "extend s", "sample ms (uniform)", "sample ms (prioritized)",
             "dumps s (full)", "dumps s (+2%)", "dumps + fsync s (full / +2%)",
             "LazyMemmap dumps (first, full / again, +2%) / this +2%",
             "LazyMemmap dumps + fsync (first / again, +2%) / this +2% + fsync", "resume s",
             "peak RSS MB (fill run)", "RSS MB during +2% save (rise)",
             "anon RSS MB during +2% save"]
    body = []
    for size, med in figures.items():
        n = args.atari_rows if size == "atari" else args.float_rows
        shape, dtype = SIZES[size]
        label = f"{dtype} {list(shape)} x {n:,}"
        mm, mm_full = med[1]["save_2pct_s"], med[1]["save_full_s"]
        mm_sync, mm_full_sync = med[1]["save_2pct_sync_s"], med[1]["save_full_sync_s"]
        for s in med:
            m = med[s]
            prio = (f"{m['prio_sample_ms']:.2f}" if "prio_sample_ms" in m else
                    "n/a (needs torchrl._torchrl)")
            name = SYSTEMS[s] + (f" (codec={args.codec})" if s == 2 else "")
            body.append([label, name, f"{m['extend_s']:.2f}", f"{m['sample_ms']:.2f}",
                         prio, f"{m['save_full_s']:.2f}", f"{m['save_2pct_s']:.3f}",
                         f"{m['save_full_sync_s']:.2f} / {m['save_2pct_sync_s']:.3f}",
                         (f"{mm_full / m['save_2pct_s']:.1f}x / {mm / m['save_2pct_s']:.1f}x"
                          if s == 2 else ""),
                         (f"{mm_full_sync / m['save_2pct_sync_s']:.1f}x / "
                          f"{mm_sync / m['save_2pct_sync_s']:.1f}x" if s == 2 else ""),
                         f"{m['resume_s']:.2f}", f"{m['fill_peak_rss_mb']:,.0f}",
                         f"{m['save_2pct_rss_mb']:,.0f} ({m['save_2pct_extra_mb']:+,.0f})",
                         f"{m['save_2pct_anon_mb']:,.0f}"])
    reduced = (args.atari_rows < 100_000 or args.float_rows < 10_000)
    return (
        f"## {args.title}\n\n"
        f"{stamp()} `python -m tools.bench.bench_torchrl --atari-rows {args.atari_rows} "
        f"--float-rows {args.float_rows} --runs {args.runs} --batch {args.batch} --codec "
        f"{args.codec} --sizes {args.sizes} --systems {args.systems} --section {args.section}`"
        "; total "
        f"{total_s:,.0f} s; load average (1 min) {args.load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; torchrl {_version('torchrl')}, tensordict "
        f"{_version('tensordict')}, torch {_version('torch')}. "
        + ("**Reduced sizes** (the issue's are 100,000 Atari rows and 10,000 float rows): "
           "they did not fit the session's time on this shared 2-core machine. "
           if reduced else "")
        + "Each system's fill run (extend in batches, 64 draws of 256 rows, `rb.dumps`, "
        "+2% rows, `rb.dumps` again) and its resume run (a new storage + `rb.loads` + one "
        f"draw) in fresh subprocesses; medians of {args.runs} runs, the systems alternating. "
        "ZarrStorage's `dumps` is an incremental atomic commit plus a pointer file; TorchRL's "
        "writes every row into page-cached files without fsync, so each `dumps` is also "
        "timed together with an fsync of every file and directory under the checkpoint "
        "directory (`dumps + fsync`: the peer at ZarrStorage's durability; for ZarrStorage "
        "that adds only the pointer file's fsync); the full save's fsync precedes the +2% "
        "rows, so the repeat `dumps` no longer overlaps the first one's writeback. "
        "Uniform draws: TorchRL's `RandomSampler` + `storage.get`; "
        "prioritized: `ZarrPrioritizedSampler` (TorchRL's own `PrioritizedSampler` cannot run "
        "here: its compiled `torchrl._torchrl` does not load beside torch 2.13.0). Peak RSS "
        "of the fill run is sampled from outside every 50 ms; the save's from inside every "
        "5 ms (memory-mapped pages count in RSS for both LazyMemmapStorage and ZarrStorage's "
        "working tier; the rise is the save's own allocation; anon RSS is RSS less "
        "file-backed and shared pages, i.e. the process's own heap).\n\n"
        + table(heads, body) + "\n"
    )


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atari-rows", type=int, default=100_000)
    ap.add_argument("--float-rows", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=1000, help="rows per extend")
    ap.add_argument("--runs", type=int, default=3, help="runs per system (>= 3 for the docs)")
    ap.add_argument("--no-write", action="store_true", help="print, don't write the docs")
    ap.add_argument("--codec", default="blosc-lz4", help="ZarrStorage's codec (its default)")
    ap.add_argument("--sizes", default="atari,float", help="which sizes, comma-separated")
    ap.add_argument("--systems", default="0,1,2", help=f"which of {SYSTEMS} (indices)")
    ap.add_argument("--section", default="torchrl", help="docs/benchmarks.md section")
    ap.add_argument("--title", default="TorchRL storages: ZarrStorage vs LazyTensorStorage / "
                    "LazyMemmapStorage", help="the section's heading")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default="atari", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--where", default="", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="fill", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.size, args.rows, args.batch, args.where,
                               args.phase, args.codec)))
        return
    t0 = time.perf_counter()
    args.load_start = os.getloadavg()[0]
    systems = tuple(int(x) for x in args.systems.split(","))
    rows_of = {"atari": (args.atari_rows, min(args.batch, args.atari_rows)),
               "float": (args.float_rows, min(args.batch // 10 or 1, args.float_rows))}
    figures = {size: measure(size, *rows_of[size], args.runs, systems, args.codec)
               for size in args.sizes.split(",")}
    body = section(args, figures, time.perf_counter() - t0)
    print(body)
    if not args.no_write:
        write_section(args.section, body)


if __name__ == "__main__":
    main()
