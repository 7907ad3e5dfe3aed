"""Peak memory of one real CRSP step at the trainer's defaults, optimised vs
``--no-memory-opt``: section ``crsp_real_step`` of ``docs/benchmarks.md``, beside the synthetic
update-only rows of ``tools/bench/bench_crsp.py``.

Each run is the trainer itself, ``python -m trainers.crsp --run-dir TMP --steps 1`` with every
CRSP setting at its default (real rollouts of all three roles with the formats reachable:
prefills, verdict choice, the critic's verdict term, then the update, the buffer commit and the
checkpoint), in a fresh process inside its own memory cgroup of ``--limit-gib`` (so a naive
path that outgrows it is killed by the cgroup's OOM killer, not the machine's). The peak is
measured from outside the process: the kernel's high-water mark of its resident set
(``ru_maxrss`` of ``os.wait4``, which no phase resets) and, for a run that is killed, the
largest RSS the parent saw sampling ``/proc/PID/status`` every 0.1 s. Runs alternate (naive,
optimised, ...) and each figure is the median of ``--runs``.

Run: ``python -m tools.bench.crsp_real_step [--runs 3] [--threads 2] [--limit-gib 12]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench.bench_larger_than_ram import MemoryCap
from tools.bench.report import stamp, table, write_section

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
PATHS = {"opt": ("optimised (default)", []), "naive": ("`--no-memory-opt`", ["--no-memory-opt"])}


def _vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_step(extra: list[str], threads: int, limit_bytes: int) -> dict[str, Any]:
    """One fresh ``trainers.crsp --steps 1`` run in a memory cgroup; returns exit code, wall
    seconds, the kernel's high-water mark (bytes), the sampled peak, and the cgroup's stats."""
    cap = MemoryCap(limit_bytes)
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "trainers.crsp", "--run-dir", str(Path(d) / "run"),
               "--steps", "1", "--generate-threads", str(threads), "--train-threads",
               str(threads), "--quiet", *extra]
        t0 = time.perf_counter()
        log = open(Path(d) / "log", "w")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=cap.preexec)
        sampled = 0
        while True:
            try:
                sampled = max(sampled, _vm_rss(p.pid))
            except (OSError, ValueError):
                pass
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.1)
        log.close()
        seconds = time.perf_counter() - t0
        tail = (Path(d) / "log").read_text()[-2000:]
        p.returncode = os.waitstatus_to_exitcode(status)
        stats = cap.stats()
        cap.close()
    return {"rc": p.returncode, "seconds": seconds, "maxrss": usage.ru_maxrss * 1024,
            "sampled": sampled, **stats, "how": cap.how, "tail": tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=12.0,
                    help="memory cgroup limit of each run (GiB)")
    a = ap.parse_args()
    limit = int(a.limit_gib * 2**30)
    res: dict[str, list[dict[str, Any]]] = {k: [] for k in PATHS}
    for i in range(a.runs):
        for k in ("naive", "opt"):
            r = run_step(PATHS[k][1], a.threads, limit)
            res[k].append(r)
            print(k, i, {x: r[x] for x in r if x != "tail"}, flush=True)
            if r["rc"] not in (0, -9, 137):
                print(r["tail"], file=sys.stderr)
    rows, peak = [], {}
    for k, (name, _) in PATHS.items():
        runs = res[k]
        done = [r for r in runs if r["rc"] == 0]
        killed = [r for r in runs if r["rc"] != 0]
        if done:
            peak[k] = statistics.median(r["maxrss"] for r in done)
            shown = f"{peak[k] / MIB:,.0f} MiB"
        else:
            peak[k] = None
            seen = max(r["sampled"] for r in runs) / MIB
            shown = (f"> {limit / MIB:,.0f} MiB (OOM-killed by its cgroup in {len(killed)} of "
                     f"{len(runs)} runs; largest RSS seen {seen:,.0f} MiB)")
        rows.append([name, shown, f"{statistics.median(r['seconds'] for r in runs):.1f}",
                     f"{len(done)} / {len(runs)}"])
    if peak["opt"] and peak["naive"]:
        ratio = f"{peak['naive'] / peak['opt']:.2f}x"
    elif peak["opt"]:
        ratio = f"> {limit / peak['opt']:.2f}x"
    else:
        ratio = "n/a (the optimised run did not finish)"
    body = ("### One real CRSP step at the defaults (rollout + update + commit), SmolLM2-135M\n\n"
            f"{stamp()} `python -m tools.bench.crsp_real_step --runs {a.runs} --threads "
            f"{a.threads} --limit-gib {a.limit_gib:g}`: the trainer itself, `--steps 1`, every "
            f"CRSP setting at its default, real rollouts; each run a fresh process in its own "
            f"memory cgroup ({res['opt'][0]['how']}) of {a.limit_gib:g} GiB; peak = the "
            f"kernel's high-water mark of the process's RSS (`ru_maxrss` from `wait4`, never "
            f"reset); medians of {a.runs}, runs alternating.\n\n"
            + table(["path", "peak RSS", "wall s (median)", "finished"], rows)
            + f"\n\n**`--no-memory-opt` / optimised: {ratio}** (target >= 3x).")
    print(body)
    write_section("crsp_real_step", body)


if __name__ == "__main__":
    main()
