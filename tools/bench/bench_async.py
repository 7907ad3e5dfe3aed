"""Benchmark of GRPO with generation workers (``--generation-workers N``, docs/async.md) against
the synchronous loop: section ``async`` of ``docs/benchmarks.md``.

Each configuration is a fresh ``python -m trainers.grpo`` subprocess of ``--steps`` steps at
the real model's defaults (or ``--model PATH``: e.g. the tiny model of ``tests/tiny_lm.py`` for
a smoke run); the parent samples every 50 ms the RSS of the learner process and of its Ray
worker processes (``ray::`` processes among its descendants; a local Ray instance is started
by the learner), and reads per-step seconds and completion tokens from ``metrics.jsonl``.
Tokens trained per second = completion tokens of steps 2..S / their wall time (step 1 pays
the workers' start and the first generation in every configuration). Configurations
alternate (sync, N=1 J=1, N=1 J=P, N=2, sync, ...) so a slow spell of the shared machine
falls on all.

Configurations (``--only`` takes their names): ``sync``; ``workers_1_j1``: one worker, one
group per job (``--groups-per-job 1``: G rows per generate call, the configuration measured
in docs/async.md's first round); ``workers_1_jP``: one worker, a step's P groups per job
(``--groups-per-job P``, P from ``--prompts-per-step`` or the trainer's default: the
synchronous loop's P x G rows per generate call; also the auto choice at N = 1);
``workers_1_shared``: one worker, J = P, the learner and the worker each with all C threads
(oversubscribed: while one waits, the other has every core; a static split of two cores
cannot beat the synchronous loop when each phase scales to two threads);
``workers_2``: two workers, J auto (the largest divisor of P at most ceil(P / 2)).

How the cores are split (``--cores C``, default the machine's): sync: ``--generate-threads C
--train-threads C``; N workers: the learner ``--train-threads max(1, C - N)``, each worker
one thread (``--generate-threads 1``, one Ray CPU each); ``workers_1_shared``: learner and
worker C threads each.

``--log FILE`` appends each finished run as a JSON line (configuration, result); a later
invocation with the same ``--log`` counts the runs already there (same ``--steps`` and trainer
flags) and runs only the rest, so a benchmark cut off part way keeps its runs.

At the real model a round of sync, N=1 (J=1) and N=2 (J=1) took ~24 minutes on the 2-core
machine (its single runs are in docs/async.md); with N=1 J=P added, expect ~32 minutes a
round, ~1.6 hours for the section's three. Smoke run (done on the
tiny model of ``tests/tiny_lm.py``): ``--steps 3 --runs 1 --no-write --model DIR --task
basic_arithmetic --train-size 40 --prompts-per-step 2 --group-size 3 --max-completion-tokens 12
--max-prompt-tokens 120 --pack-tokens 200 --memory-budget none``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
#: name: (generation workers, groups per job: an int, "P" (--prompts-per-step) or 0: auto,
#: whether the learner and the workers each take all the cores)
CONFIGS: dict[str, tuple[int, int | str, bool]] = {
    "sync": (0, 0, False), "workers_1_j1": (1, 1, False), "workers_1_jP": (1, "P", False),
    "workers_1_shared": (1, "P", True), "workers_2": (2, 0, False)}
DEFAULTS = ["--no-evaluate"]  # the trainer's defaults otherwise (no held-out evaluation)


def sampled_run(cmd: list[str], env: dict[str, str]) -> tuple[int, str, int, int]:
    """Run ``cmd``; every 50 ms sample the RSS of the process and of its ``ray::`` worker
    descendants. Returns (return code, stderr tail, learner peak, workers' peak sum)."""
    import psutil
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env)
        proc, learner, workers = psutil.Process(p.pid), 0, 0
        while p.poll() is None:
            try:
                learner = max(learner, proc.memory_info().rss)
                ray_rss = 0
                for c in proc.children(recursive=True):
                    try:
                        if "ray::" in " ".join(c.cmdline()[:1]):
                            ray_rss += c.memory_info().rss
                    except psutil.Error:
                        pass
                workers = max(workers, ray_rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        code = p.wait()
        err.seek(0)
        return code, err.read()[-3000:], learner, workers


def prompts_per_step(extra: list[str]) -> int:
    """P of the runs: ``--prompts-per-step`` among the trainer's flags, else its default."""
    p = argparse.ArgumentParser(add_help=False)
    from trainers.grpo.config import Config
    p.add_argument("--prompts-per-step", type=int, default=Config.prompts_per_step)
    return p.parse_known_args(extra)[0].prompts_per_step


def run_config(name: str, steps: int, cores: int, extra: list[str]) -> dict[str, float]:
    n, j, shared = CONFIGS[name]
    j = prompts_per_step(extra) if j == "P" else j
    threads = (["--generate-threads", str(cores), "--train-threads", str(cores)] if not n else
               ["--generate-threads", str(cores if shared else 1),
                "--train-threads", str(cores if shared else max(1, cores - n)),
                "--generation-workers", str(n), "--groups-per-job", str(j)])
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        cmd = [sys.executable, "-m", "trainers.grpo", "--run-dir", f"{tmp}/run", "--steps",
               str(steps), "--quiet", *DEFAULTS, *threads, *extra]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        code, err, learner, workers = sampled_run(cmd, env)
        if code:
            raise RuntimeError(f"{name} failed ({code}):\n{err}")
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text()
                .splitlines()]
    later = rows[1:] or rows
    secs = sum(r["step_seconds"] for r in later)
    return {"tokens_per_s": sum(r["completion_tokens"] for r in later) / secs,
            "step_seconds": statistics.median(r["step_seconds"] for r in later),
            "learner_peak_mib": learner / MIB, "workers_peak_mib": workers / MIB,
            "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in later),
            "learner_wait_s": statistics.median(r.get("learner_wait_seconds", 0.0)
                                                for r in later)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    p.add_argument("--only", help="comma-separated: " + ",".join(CONFIGS))
    p.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    p.add_argument("--log", help="JSON lines of finished runs: appended to, and reused")
    a, extra = p.parse_known_args()  # the rest goes to the trainer (e.g. --model DIR)
    names = a.only.split(",") if a.only else list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--only: unknown configurations {unknown}; expected of {list(CONFIGS)}")
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    key = {"steps": a.steps, "cores": a.cores, "extra": extra}
    if a.log and Path(a.log).exists():
        for line in Path(a.log).read_text().splitlines():
            row = json.loads(line)
            if row["key"] == key and row["name"] in results:
                results[row["name"]].append(row["result"])
    for _ in range(a.runs):
        for name in names:
            if len(results[name]) >= a.runs:
                continue
            results[name].append(run_config(name, a.steps, a.cores, extra))
            print(name, results[name][-1], flush=True)
            if a.log:
                with open(a.log, "a") as f:
                    f.write(json.dumps({"name": name, "key": key,
                                        "result": results[name][-1]}) + "\n")
    med = {n: {k: statistics.median(r[k] for r in v) for k in v[0]} for n, v in results.items()}
    base = med.get("sync", {}).get("tokens_per_s")
    from tools.bench.report import stamp, table
    rows = [[n, f"{m['tokens_per_s']:.1f}", f"{m['tokens_per_s'] / base:.2f}x" if base else "-",
             f"{m['step_seconds']:.1f}", f"{m['learner_peak_mib']:,.0f}",
             f"{m['workers_peak_mib']:,.0f}", f"{m['staleness_mean']:.2f}",
             f"{m['learner_wait_s']:.1f}"] for n, m in med.items()]
    text = (f"{stamp()} {a.steps} steps per run (tokens/s over steps 2..{a.steps}), medians of "
            f"{a.runs} runs, {a.cores} cores; trainer flags: {' '.join(DEFAULTS + extra)}.\n\n"
            + table(["configuration", "completion tokens / s", "vs sync", "s / step",
                     "learner peak MiB", "workers peak MiB (sum)", "staleness mean",
                     "learner wait s"], rows))
    print(text)
    if not a.no_write:
        from tools.bench.report import write_section
        write_section("async", "## GRPO with generation workers (docs/async.md)\n\n" + text)


if __name__ == "__main__":
    main()
