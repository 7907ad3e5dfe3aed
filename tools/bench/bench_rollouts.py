"""Benchmark of rollout workers (``rlbuffers.rollouts``): section ``rollouts`` of
``docs/benchmarks.md``.

- ERL generation time with 1 worker (in process) vs ``--workers 2`` (Ray) on HalfCheetah-v5:
  each run a fresh ``python -m trainers.erl`` process, runs alternating, medians over
  generations 2.. of each run, then over ``--runs`` runs: the rollout phase
  (``rollout_seconds``) and the whole generation (``gen_seconds``; the TD3 update phase does
  not parallelise over workers).
- Ray's overhead: round trip of an empty job, and seconds per MB of trajectory returned.

Run on a quiet machine: ``python -m tools.bench.bench_rollouts [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ERL = ["--env", "HalfCheetah-v5", "--pop-size", "4", "--max-episode-steps", "500",
       "--updates-per-step", "0.05", "--learning-starts", "1000"]


def erl_run(workers: int, generations: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-rollouts-") as tmp:
        cmd = [sys.executable, "-m", "trainers.erl", "--run-dir", f"{tmp}/run", *ERL,
               "--generations", str(generations), "--workers", str(workers)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().split("\n")
                if x]
    rows = rows[1:]  # the first generation starts the workers
    return {"rollout_seconds": statistics.median(r["rollout_seconds"] for r in rows),
            "gen_seconds": statistics.median(r["gen_seconds"] for r in rows)}


def empty_job(weights: Any) -> int:
    return 0


def payload_job(weights: Any, mib: int) -> np.ndarray:
    return np.ones(mib * 2**20 // 4, np.float32)


def ray_overheads(repeats: int = 50) -> dict[str, float]:
    from rlbuffers.rollouts import RayPool

    pool = RayPool(2, torch_threads=0)
    pool.set_weights(None)
    pool.results([pool.submit(empty_job) for _ in range(4)])  # warm
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool.results([pool.submit(empty_job)])
        t.append(time.perf_counter() - t0)
    per_mib = []
    for _ in range(5):
        t0 = time.perf_counter()
        pool.results([pool.submit(payload_job, 64)])
        per_mib.append((time.perf_counter() - t0) / 64)
    pool.close()
    return {"empty_job_ms": 1000 * statistics.median(t),
            "seconds_per_mib": statistics.median(per_mib)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--generations", type=int, default=4)
    a = p.parse_args()
    from tools.bench.report import stamp, table, write_section

    res: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for _ in range(a.runs):
        for w in (1, 2):
            res[w].append(erl_run(w, a.generations))
            print(w, res[w][-1], flush=True)
    med = {w: {k: statistics.median(r[k] for r in v) for k in v[0]} for w, v in res.items()}
    over = ray_overheads()
    rows = [["1 (in process)", f"{med[1]['rollout_seconds']:.2f}", "1.00x",
             f"{med[1]['gen_seconds']:.2f}"],
            ["2 (Ray actors)", f"{med[2]['rollout_seconds']:.2f}",
             f"{med[1]['rollout_seconds'] / med[2]['rollout_seconds']:.2f}x",
             f"{med[2]['gen_seconds']:.2f}"]]
    body = (f"## Rollout workers (`rlbuffers.rollouts`, ERL `--workers`)\n\n{stamp()}\n\n"
            f"ERL on HalfCheetah-v5 ({' '.join(ERL)}), generations 2..{a.generations} of "
            f"each run, medians of {a.runs} runs (alternating):\n\n"
            + table(["workers", "rollout phase s", "speed-up", "generation s"], rows)
            + f"\n\nRay overhead (2 local actors): empty job round trip "
            f"{over['empty_job_ms']:.2f} ms; returning a 64 MiB array "
            f"{over['seconds_per_mib'] * 1000:.2f} ms per MiB.")
    write_section("rollouts", body)
    print(body)


if __name__ == "__main__":
    main()
