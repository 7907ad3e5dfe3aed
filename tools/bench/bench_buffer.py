"""Replay-buffer benchmark (issue 2 targets) on real Pong transitions (uint8 4x84x84).

For each buffer size: fill time; full save (wall, peak extra RSS, stored bytes); save after
adding 2% more transitions (wall, bytes, ratio to a full save); ``open()`` time; uniform and
prioritized ``sample(256)`` throughput against numpy fancy indexing of an in-RAM copy of the
same arrays, run side by side in this process. Medians over ``--runs`` repetitions.

Run: ``python -m tools.bench.bench_buffer`` (default sizes 20k and 80k transitions: 0.56 and
2.26 GB). Writes the ``buffer`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from tools.bench.atari import pong_transitions, tiled
from tools.bench.report import stamp, table, write_section

FIELDS = {
    "obs": FieldSpec((4, 84, 84), "uint8"),
    "action": FieldSpec((), "int64"),
    "reward": FieldSpec((), "float32"),
    "terminated": FieldSpec((), "bool"),
    "truncated": FieldSpec((), "bool"),
}
ROW_BYTES = 4 * 84 * 84 + 8 + 4 + 1 + 1


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Samples RSS and anonymous RSS every 2 ms in a thread; reports peaks above the start."""

    def __enter__(self) -> PeakRSS:
        self.proc = psutil.Process()
        self.base, self.base_anon = self.proc.memory_info().rss, _rss_anon()
        self.peak, self.peak_anon = self.base, self.base_anon
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.peak_anon = max(self.peak_anon, _rss_anon())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.extra = self.peak - self.base
        self.extra_anon = self.peak_anon - self.base_anon


def fill(buf: ReplayBuffer, src: dict, start: int, n: int, batch: int = 1000) -> None:
    for a in range(start, start + n, batch):
        buf.extend(tiled(src, a, min(batch, start + n - a)))


def throughput(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls / (time.perf_counter() - t)


def bench_size(n: int, src: dict, runs: int, workdir: Path) -> dict:
    path = workdir / f"buf{n}"
    r: dict = {"n": n, "gb": n * ROW_BYTES / 1e9}
    buf = ReplayBuffer.create(path, capacity=n, fields=FIELDS, overwrite=True, seed=0)
    t = time.perf_counter()
    fill(buf, src, 0, n)
    r["fill_s"] = time.perf_counter() - t
    full, rss, rss_anon = [], [], []
    for i in range(runs):
        with PeakRSS() as m:
            rep = buf.save(full=i > 0)  # the first save is full because everything is new
        full.append(rep)
        rss.append(m.extra)
        rss_anon.append(m.extra_anon)
    r["full_s"] = statistics.median(x.seconds for x in full)
    r["full_bytes"] = full[-1].bytes_written
    r["raw_bytes"] = full[-1].raw_bytes
    r["save_rss_mb"] = max(rss) / 2**20
    r["save_anon_mb"] = max(rss_anon) / 2**20
    inc, inc_rss = [], []
    for i in range(runs):
        fill(buf, src, n + i * (n // 50), n // 50)
        with PeakRSS() as m:
            inc.append(buf.save())
        inc_rss.append(m.extra)
    r["inc_s"] = statistics.median(x.seconds for x in inc)
    r["inc_bytes"] = statistics.median(x.bytes_written for x in inc)
    r["inc_rss_mb"] = max(inc_rss) / 2**20
    buf.close()
    opens = []
    for _ in range(max(runs, 5)):
        t = time.perf_counter()
        b = ReplayBuffer.open(path)
        opens.append(time.perf_counter() - t)
        b.close()
    r["open_s"] = statistics.median(opens)
    r.update(bench_sampling(path, runs))
    shutil.rmtree(path)
    return r


def bench_sampling(path: Path, runs: int) -> dict:
    buf = ReplayBuffer.open(path)
    ram = {k: np.asarray(buf[:][k]) for k in FIELDS}  # the in-RAM copy numpy indexes
    rng = np.random.default_rng(0)
    size = len(buf)

    def numpy_sample() -> dict:
        idx = rng.integers(0, size, 256)
        return {k: v[idx] for k, v in ram.items()}

    calls = 300
    for _ in range(2):  # warm: map the working tier's pages (in page cache) into the process
        throughput(lambda: buf.sample(256), calls)
        throughput(numpy_sample, calls)
    ours, base = [], []
    for _ in range(runs):
        ours.append(throughput(lambda: buf.sample(256), calls))
        base.append(throughput(numpy_sample, calls))
    buf.close()
    ram.clear()
    pr_path = path.with_name(path.name + "_per")
    per = ReplayBuffer.create(pr_path, capacity=size, fields=FIELDS, overwrite=True,
                              sampler=PrioritizedSampler(), chunk_transitions=buf.chunk_transitions)
    src_buf = ReplayBuffer.open(path, mode="r+")
    for a in range(0, size, 2000):
        per.extend({k: v for k, v in src_buf[a : a + 2000].items()})
    src_buf.close()
    per.update_priorities(np.arange(size), rng.random(size) * 5)
    throughput(lambda: per.sample(256), calls)
    pers = [throughput(lambda: per.sample(256), calls) for _ in range(runs)]
    per.close()
    shutil.rmtree(pr_path)
    return {"sample_per_s": statistics.median(ours), "numpy_per_s": statistics.median(base),
            "per_per_s": statistics.median(pers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 80_000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--frames", type=int, default=4000, help="real Pong transitions collected")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--one", action="store_true", help="measure one size in this process and "
                    "print its results as JSON (used internally: one fresh process per size)")
    args = ap.parse_args()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="rlb-bench-"))
    if args.one:
        r = bench_size(args.sizes[0], pong_transitions(args.frames), args.runs, workdir)
        print("RESULT " + json.dumps(r), flush=True)
        return
    rows = []
    for n in args.sizes:
        cmd = [sys.executable, "-m", "tools.bench.bench_buffer", "--one", "--sizes", str(n),
               "--runs", str(args.runs), "--frames", str(args.frames), "--dir", str(workdir)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.split("RESULT ", 1)[1])
        print(r, flush=True)
        rows.append([
            f"{n:,} ({r['gb']:.2f} GB)", f"{r['fill_s']:.1f}",
            f"{r['full_s']:.2f}", f"{r['save_rss_mb']:.0f} / {r['save_anon_mb']:.0f}",
            f"{r['raw_bytes'] / r['full_bytes']:.1f}x",
            f"{r['inc_s']:.3f}", f"{r['inc_rss_mb']:.0f}",
            f"{r['inc_s'] / r['full_s']:.1%} / {r['inc_bytes'] / r['full_bytes']:.1%}",
            f"{r['open_s'] * 1000:.1f}",
            f"{r['sample_per_s']:.0f} vs {r['numpy_per_s']:.0f} "
            f"({r['sample_per_s'] / r['numpy_per_s']:.2f}x)",
            f"{r['per_per_s']:.0f}",
        ])
    headers = ["transitions", "fill s", "full save s", "save peak extra RSS MB (all / anon)",
               "compression", "+2% save s", "+2% save peak RSS MB", "+2% / full (time / bytes)",
               "open ms", "uniform sample(256)/s vs in-RAM numpy", "prioritized sample(256)/s"]
    body = (
        "## Replay buffer: saves, open, sampling (real Pong frames, uint8 4x84x84)\n\n"
        f"{stamp()} Medians of {args.runs} runs (open: >= 5). `python -m tools.bench.bench_buffer`."
        f" Transitions are {args.frames:,} real Pong transitions (random policy, DQN preprocessing)"
        " repeated to fill the buffer; codec blosc-zstd level 3 with crc32c; chunks of ~4 MiB."
        " Peak extra RSS is sampled every 2 ms during the save, over the RSS before it; 'anon' is"
        " the anonymous (heap) part. Sampling is measured with the working tier in page cache,"
        " against numpy fancy indexing of in-RAM copies of the same five arrays, interleaved.\n\n"
        + table(headers, rows)
    )
    write_section("buffer", body)
    print(body)


if __name__ == "__main__":
    main()
