"""Larger than RAM: a replay buffer whose working tier is larger than the memory its process
may use is filled, saved, reopened (twice: reusing the working tier, and rebuilding it from
the saved Zarr group after deleting it) and sampled, all without ENOMEM.

The cycle runs in a child process inside a memory cgroup created for it (cgroup v1
``memory.limit_in_bytes`` or v2 ``memory.max``, whichever this machine has). The cgroup caps
resident memory including page cache, but lets the kernel evict clean file pages, so the
memory-mapped working tier can exceed the cap. (``RLIMIT_AS`` would cap the mapped address
space instead, and a working tier bigger than the cap could not be mapped at all; the script
falls back to it only when no cgroup can be created, and says so.) As a control, a child that
keeps the same transitions in a numpy array in RAM (what in-memory buffers do) runs under the
same cap.

Run: ``python -m tools.bench.bench_larger_than_ram [--working-gb 6] [--cap-gb 2]``. Writes the
``larger_than_ram`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.report import stamp, table, write_section

ROW_BYTES = 4 * 84 * 84 + 8 + 4 + 1 + 1


# -- the capped child ---------------------------------------------------------------------------
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _throughput(fn, max_calls: int, budget_s: float = 15.0) -> float:
    """Calls per second of ``fn``: ``max_calls`` calls, or fewer (>= 3) past ``budget_s``."""
    t = time.perf_counter()
    calls = 0
    while calls < max_calls and (calls < 3 or time.perf_counter() - t < budget_s):
        fn()
        calls += 1
    return calls / (time.perf_counter() - t)


def child_buffer(n: int, workdir: Path, frames: int, runs: int) -> dict:
    """Fill, save, reopen and sample an ``n``-transition Pong buffer; return measurements."""
    from rlbuffers import PrioritizedSampler, ReplayBuffer
    from tools.bench.atari import pong_transitions, tiled
    from tools.bench.bench_buffer import FIELDS, PeakRSS

    src = pong_transitions(frames)
    r: dict = {"n": n, "frames": frames}
    path = workdir / "buf"
    buf = ReplayBuffer.create(path, capacity=n, fields=FIELDS, overwrite=True, seed=0,
                              sampler=PrioritizedSampler())
    t = time.perf_counter()
    with PeakRSS() as m:
        for a in range(0, n, 1000):
            buf.extend(tiled(src, a, min(1000, n - a)))
    r["fill_s"], r["fill_rss_mb"] = time.perf_counter() - t, m.extra / 2**20
    with PeakRSS() as m:
        rep = buf.save()
    r.update(save_s=rep.seconds, save_rss_mb=m.extra / 2**20, stored_bytes=rep.bytes_written,
             raw_bytes=rep.raw_bytes)
    ids = np.arange(0, n, 7)
    buf.update_priorities(ids, (ids % 13).astype(np.float64) + 1.0)
    buf.save()
    expected = buf.sample(256, rng=np.random.default_rng(1))["indices"]
    buf.close()
    t = time.perf_counter()
    buf = ReplayBuffer.open(path)
    r["open_s"] = time.perf_counter() - t
    got = buf.sample(256, rng=np.random.default_rng(1))["indices"]
    r["priorities_survive"] = bool(np.array_equal(expected, got))
    r["uniform_per_s"], r["prio_per_s"] = _sample_rates(buf, runs)
    r.update(_gather_alternatives(path / ".working" / "obs.npy", runs))
    r["rss_after_sampling_mb"] = _status_kb("VmRSS") / 1024
    buf.close()
    shutil.rmtree(path / ".working")
    t = time.perf_counter()
    with PeakRSS() as m:
        buf = ReplayBuffer.open(path)
    r["rebuild_s"], r["rebuild_rss_mb"] = time.perf_counter() - t, m.extra / 2**20
    last = buf[n - 1]
    r["rebuilt_ok"] = bool(np.array_equal(last["obs"], tiled(src, n - 1, 1)["obs"][0]))
    buf.close()
    r["peak_rss_mb"] = _status_kb("VmHWM") / 1024
    return r


def _sample_rates(buf, runs: int) -> tuple[float, float]:
    """Median sample(256)/s, uniform (rng-drawn indices through ``buf[...]``) and prioritized."""
    rng = np.random.default_rng(0)
    n = len(buf)
    uni, pri = [], []
    _throughput(lambda: buf.sample(256), 20)
    for _ in range(runs):
        uni.append(_throughput(lambda: buf[rng.integers(0, n, 256)], 100))
        pri.append(_throughput(lambda: buf.sample(256), 100))
    return statistics.median(uni), statistics.median(pri)


def _gather_alternatives(npy: Path, runs: int) -> dict:
    """Two other ways to gather 256 random obs rows from the same working-tier file: a memory
    map advised ``MADV_RANDOM`` (no readahead), and one ``preadv`` per row (sorted)."""
    import mmap

    view = np.lib.format.open_memmap(npy, mode="r")
    view._mmap.madvise(mmap.MADV_RANDOM)
    n, row = len(view), view[0].nbytes
    fd = os.open(npy, os.O_RDONLY)
    rng = np.random.default_rng(2)

    def pread_gather() -> np.ndarray:
        out = np.empty((256, *view.shape[1:]), view.dtype)
        for j, i in enumerate(np.sort(rng.integers(0, n, 256)).tolist()):
            os.preadv(fd, [memoryview(out[j]).cast("B")], view.offset + i * row)
        return out

    madv = [_throughput(lambda: view[rng.integers(0, n, 256)], 100) for _ in range(runs)]
    pread = [_throughput(pread_gather, 100) for _ in range(runs)]
    os.close(fd)
    return {"madv_random_per_s": statistics.median(madv), "pread_per_s": statistics.median(pread)}


def child_numpy(n: int) -> dict:
    """The control: hold the same ``n`` transitions in RAM (fails under the cap)."""
    obs = np.zeros((n, 4, 84, 84), np.uint8)
    for a in range(0, n, 1000):
        obs[a : a + 1000] = a % 251  # touch every page, as filling a buffer does
    return {"n": n, "peak_rss_mb": _status_kb("VmHWM") / 1024}


# -- the parent: cgroup, children, report ----------------------------------------------------
def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(directory, version) of this process's memory cgroup, if one is writable."""
    with open("/proc/self/cgroup") as f:
        lines = [ln.strip().split(":", 2) for ln in f]
    for _, ctrl, rel in lines:
        if "memory" in ctrl.split(","):
            d = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            if os.access(d, os.W_OK):
                return d, "v1"
    for _, ctrl, rel in lines:
        if ctrl == "":
            for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                d = base / rel.lstrip("/")
                if (d / "cgroup.controllers").exists() and os.access(d, os.W_OK):
                    if "memory" in (d / "cgroup.controllers").read_text().split():
                        return d, "v2"
    return None


class MemoryCap:
    """A child memory cgroup limited to ``cap_bytes`` (or RLIMIT_AS if none can be made)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap = cap_bytes
        self.dir: Path | None = None
        self.version = "none"
        found = _own_memory_cgroup()
        if found:
            parent, self.version = found
            d = parent / f"rlb-larger-than-ram-{os.getpid()}"
            try:
                d.mkdir()
                limit = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
                (d / limit).write_text(str(cap_bytes))
                if self.version == "v2":
                    (d / "memory.swap.max").write_text("0")
                self.dir = d
            except OSError:
                shutil.rmtree(d, ignore_errors=True)
        knob = "memory.limit_in_bytes" if self.dir and self.version == "v1" else "memory.max"
        self.how = (
            f"cgroup {self.version} `{knob}`" if self.dir
            else "`RLIMIT_AS` (no writable memory cgroup)"
        )

    def preexec(self) -> None:
        """Runs in the child between fork and exec: join the cgroup (or set RLIMIT_AS)."""
        if self.dir is not None:
            (self.dir / "cgroup.procs").write_text(str(os.getpid()))
        else:
            resource.setrlimit(resource.RLIMIT_AS, (self.cap, self.cap))

    def stats(self) -> dict:
        if self.dir is None:
            return {}
        if self.version == "v1":
            text = (self.dir / "memory.oom_control").read_text()
            oom = dict(ln.split() for ln in text.splitlines())
            return {"cg_peak_mb": int((self.dir / "memory.max_usage_in_bytes").read_text()) / 2**20,
                    "cg_failcnt": int((self.dir / "memory.failcnt").read_text()),
                    "cg_oom_kills": int(oom.get("oom_kill", 0))}
        ev = dict(ln.split() for ln in (self.dir / "memory.events").read_text().splitlines())
        peak = self.dir / "memory.peak"
        return {"cg_peak_mb": int(peak.read_text()) / 2**20 if peak.exists() else float("nan"),
                "cg_failcnt": int(ev.get("max", 0)), "cg_oom_kills": int(ev.get("oom_kill", 0))}

    def close(self) -> None:
        if self.dir is not None:
            for _ in range(50):
                try:
                    self.dir.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def run_capped(cap_bytes: int, args: list[str]) -> tuple[int, dict, dict, str]:
    """Run this script's child mode in a fresh cap; returns (exit code, result, cap stats, how)."""
    cap = MemoryCap(cap_bytes)
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        cmd = [sys.executable, "-m", "tools.bench.bench_larger_than_ram", "--child-out", str(out),
               *args]
        p = subprocess.run(cmd, preexec_fn=cap.preexec, cwd=Path(__file__).resolve().parents[2])
        text = out.read_text()
        return p.returncode, json.loads(text) if text else {}, cap.stats(), cap.how
    finally:
        out.unlink(missing_ok=True)
        cap.close()


def _report(args, rc, r, cg, how, rc_np, np_r, cg_np) -> str:
    gb = r.get("n", 0) * ROW_BYTES / 1e9
    rows = [
        ["working tier", f"{gb:.2f} GB ({args.n:,} transitions)"],
        ["memory cap", f"{args.cap_gb:.1f} GiB via {how}"],
        ["child exit code / OOM kills in the cgroup", f"{rc} / {cg.get('cg_oom_kills', '-')}"],
        ["fill (s, peak extra RSS MB)", f"{r['fill_s']:.1f} s, {r['fill_rss_mb']:.0f} MB"],
        ["full save (s, peak extra RSS MB)", f"{r['save_s']:.1f} s, {r['save_rss_mb']:.0f} MB"],
        ["stored / raw bytes", f"{r['stored_bytes'] / 1e6:.1f} MB / {r['raw_bytes'] / 1e9:.2f} GB"
                               f" ({r['raw_bytes'] / max(r['stored_bytes'], 1):.0f}x)"],
        ["open, working tier reused (ms)", f"{r['open_s'] * 1000:.1f}"],
        ["open after deleting the working tier: rebuild (s, peak extra RSS MB)",
         f"{r['rebuild_s']:.1f} s, {r['rebuild_rss_mb']:.0f} MB; data equal: {r['rebuilt_ok']}"],
        ["uniform sample(256)/s (random rows over the whole tier)", f"{r['uniform_per_s']:.1f}"],
        ["prioritized sample(256)/s", f"{r['prio_per_s']:.1f}"],
        ["baseline, obs rows only: mmap advised MADV_RANDOM, sample(256)/s",
         f"{r['madv_random_per_s']:.1f}"],
        ["baseline, obs rows only: one preadv per row in one thread, sample(256)/s",
         f"{r['pread_per_s']:.1f}"],
        ["priorities + RNG survive save/open (same sample)", str(r["priorities_survive"])],
        ["process peak RSS (VmHWM, incl. mapped file pages) MB", f"{r['peak_rss_mb']:.0f}"],
        ["cgroup peak usage (incl. page cache) MB / limit hits",
         f"{cg.get('cg_peak_mb', float('nan')):.0f} / {cg.get('cg_failcnt', '-')}"],
    ]
    control = (
        f"Control, same cap: a numpy array of the same {args.n:,} observations in RAM "
        f"(as in-memory buffers hold them) exited with code {rc_np}"
        + (" (killed by the cgroup's OOM killer)" if rc_np in (-9, 137) else "")
        + (f", OOM kills {cg_np.get('cg_oom_kills')}" if cg_np else "")
        + (f"; it reached {np_r['peak_rss_mb']:.0f} MB" if np_r else "") + "."
    )
    return (
        "## Larger than RAM: working tier bigger than the memory cap\n\n"
        f"{stamp()} `python -m tools.bench.bench_larger_than_ram --working-gb {args.working_gb:g}"
        f" --cap-gb {args.cap_gb:g}`. One child process under a {args.cap_gb:g} GiB cap fills a "
        f"prioritized buffer of real Pong transitions ({r['frames']:,} collected, tiled), saves "
        "it, updates priorities and saves again, reopens it and draws the same sample as before "
        "closing, measures sampling (medians of "
        f"{args.runs} runs of 100 calls), then deletes the working tier and reopens (rebuilt "
        "chunk by chunk from the Zarr group). Uniform sampling reads random rows spread over "
        "the whole working tier, so most of them come from disk, not page cache.\n\n"
        + table(["what", "measured"], rows) + "\n\n" + control
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--working-gb", type=float, default=6.0)
    ap.add_argument("--cap-gb", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--frames", type=int, default=3000, help="real Pong transitions collected")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-kind", default="buffer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.n = int(args.working_gb * 1e9 // ROW_BYTES)
    if args.child_out:
        if args.child_kind == "numpy":
            Path(args.child_out).write_text(json.dumps(child_numpy(args.n)))
        else:
            r = child_buffer(args.n, Path(args.dir), args.frames, args.runs)
            Path(args.child_out).write_text(json.dumps(r))
        return
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="rlb-ltr-"))
    cap = int(args.cap_gb * 2**30)
    common = ["--working-gb", str(args.working_gb), "--runs", str(args.runs),
              "--frames", str(args.frames), "--dir", str(workdir)]
    try:
        rc, r, cg, how = run_capped(cap, [*common, "--child-kind", "buffer"])
        print("buffer child:", rc, r, cg, flush=True)
        rc_np, np_r, cg_np, _ = run_capped(cap, [*common, "--child-kind", "numpy"])
        print("numpy child:", rc_np, np_r, cg_np, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if rc != 0 or not r:
        sys.exit(f"the capped buffer child failed with exit code {rc} ({cg})")
    body = _report(args, rc, r, cg, how, rc_np, np_r, cg_np)
    write_section("larger_than_ram", body)
    print(body)


if __name__ == "__main__":
    main()
