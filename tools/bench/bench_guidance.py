"""Memory of the guidance trainer's layouts: section ``guidance`` of ``docs/benchmarks.md``.

1. **The seed's situation, planned** (no model loaded): ``plan_placement`` on one 44.5 GB GPU
   plus CPU RAM for a 7 GB and a 13 GB base with 2 GB and 3 GB critics, the seed's layout
   (agent, guidance copy, reference copy, critic, target critic, value function) against
   ours (one base with two adapters, the reference shared, the value heads on the critic,
   the target critic placed): which models go where, what is left on the GPU.
2. **Measured on SmolLM2-135M + MiniLM** (``trainers/guidance/``, fresh process per run,
   layouts alternating, medians of ``--runs``): peak RSS while loading; the memory of the
   loaded models once their weights have been read (``ready``: every distinct parameter read
   once, as the first forward or a move to an accelerator does; transformers maps safetensors
   files lazily, so right after loading most weights are not yet resident) as RSS and as PSS
   (a page mapped by several copies counted once); the peak RSS of one training iteration.
3. **Phase 1 throughput**: episodes per minute with 1 rollout worker (the learner) and with 2
   Ray workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB, GB = 2**20, 10**9
LAYOUTS = {"shared": "shared + placed (default)", "naive": "`--naive-init` (the seed's)"}


# ----- 1. the seed's situation, planned ---------------------------------------------------

def seed_models(base: float, critic: float, shared: bool) -> dict[str, Any]:
    """Model specs in bytes. LoRA policies: the base weights plus 1% for each adapter's
    weights, gradients and AdamW state (x4); a trained critic or value function: weights,
    gradients and two AdamW moments (x4)."""
    from rlbuffers.memory import ModelSpec

    adapter = 0.01 * base * GB * 4
    if shared:
        return {"policy (agent + guidance adapters)": ModelSpec(int(base * GB + 2 * adapter),
                                                                  "trained"),
                "reference (adapters disabled)": ModelSpec(0, "frozen"),
                "critic (2 Q + 2 V heads)": ModelSpec(int(4 * critic * GB), "trained"),
                "target critic": ModelSpec(int(critic * GB), "periodic")}
    return {"agent": ModelSpec(int(base * GB + adapter), "trained"),
            "guidance copy": ModelSpec(int(base * GB + adapter), "trained"),
            "reference copy": ModelSpec(int(base * GB), "frozen"),
            "critic": ModelSpec(int(4 * critic * GB), "trained"),
            "target critic": ModelSpec(int(critic * GB), "periodic"),
            "value function": ModelSpec(int(4 * critic * GB), "trained")}


def seed_plans(gpu_gb: float = 44.5, cpu_gb: float = 64.0) -> str:
    from rlbuffers.memory import plan_placement
    from tools.bench.report import table

    rows = []
    for base in (7.0, 13.0):
        for critic in (2.0, 3.0):
            for layout in ("naive", "shared"):
                models = seed_models(base, critic, layout == "shared")
                plan = plan_placement(models, {"cuda:0": int(gpu_gb * GB),
                                               "cpu": int(cpu_gb * GB)})
                total = sum(m.bytes for m in models.values())
                on_cpu = [n for n, d in plan.device.items() if d == "cpu"]
                gpu_used = plan.bytes_per_device.get("cuda:0", 0)
                rows.append([f"{base:.0f} GB", f"{critic:.0f} GB", LAYOUTS[layout],
                             f"{total / GB:.1f}", ", ".join(on_cpu) or "none",
                             ", ".join(plan.unplaced) or "none",
                             f"{(gpu_gb * GB - gpu_used) / GB:.1f}"])
    return table(["base", "critic", "layout", "all models GB", "on CPU", "placed nowhere",
                  "GPU GB left"], rows)


# ----- 2. measured ------------------------------------------------------------------------

def child(layout: str, out: Path, threads: int) -> None:
    import psutil
    import torch

    from trainers.guidance import train
    from trainers.guidance.config import Config

    torch.set_num_threads(threads)
    cfg = Config(run_dir=str(out / "run"), device="cpu", iterations=1, episodes_per_iteration=2,
                 episodes_per_job=2, max_answer_tokens=24, max_hint_tokens=12,
                 naive_init=layout == "naive", train_threads=threads, generate_threads=threads)
    run = train.build(cfg)
    modules = [*run.policies.unique_models().values(), run.critic, run.target]
    if run.policies.reference_model is not None:
        modules.append(run.policies.reference_model)
    seen: set[int] = set()
    with torch.no_grad():  # read every distinct parameter once: its pages become resident
        for m in modules:
            for p in m.parameters():
                if p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    p.sum()
    ready = psutil.Process().memory_full_info()
    try:
        row = train.iterate(run)
    finally:
        run.close()
    print("RESULT " + json.dumps({
        "init_peak_mib": run.init_peak_rss_bytes / MIB, "ready_rss_mib": ready.rss / MIB,
        "ready_pss_mib": ready.pss / MIB,
        "iteration_peak_mib": max(v for k, v in row.items() if k.startswith("peak_rss_")) / MIB,
        "critic_loss": row["critic_loss"], "actor_loss": row["actor_loss"]}), flush=True)


def child_throughput(workers: int, out: Path, episodes: int, repeats: int) -> None:
    """Phase 1 alone: ``repeats`` timed collections of ``episodes`` episodes (after one
    untimed, which starts the workers and loads their models), on ``workers`` rollout workers
    (1: in the learner's process with 2 torch threads; more: Ray actors, 1 thread each)."""
    import time

    import torch

    from trainers.guidance import train
    from trainers.guidance.config import Config
    from trainers.guidance.rollout import collect

    torch.set_num_threads(2)
    cfg = Config(run_dir=str(out / "run"), device="cpu", iterations=1,
                 episodes_per_iteration=episodes, episodes_per_job=max(1, episodes // 2),
                 max_answer_tokens=48, max_hint_tokens=24, workers=workers, generate_threads=2,
                 eval_size=0)
    run = train.build(cfg)
    rates = []
    try:
        for it in range(repeats + 1):
            indices = list(range(it * episodes, (it + 1) * episodes))
            t0 = time.perf_counter()
            collect(run.pool, run.policies, [run.problems[i]["question"] for i in indices],
                    cfg, it + 1)
            if it:
                rates.append(episodes / (time.perf_counter() - t0) * 60)
    finally:
        run.close()
    print("RESULT " + json.dumps({"episodes_per_min": rates}), flush=True)


def throughput(repeats: int) -> str:
    from tools.bench.report import table

    res = {}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory(prefix="bench-guidance-") as tmp:
            cmd = [sys.executable, "-m", "tools.bench.bench_guidance", "--child",
                   f"throughput{workers}", "--out", tmp, "--runs", str(repeats)]
            p = subprocess.run(cmd, capture_output=True, text=True,
                               env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        if p.returncode:
            raise RuntimeError(f"throughput child failed:\n{p.stderr[-3000:]}")
        line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
        res[workers] = json.loads(line[7:])["episodes_per_min"]
        print(workers, res[workers], flush=True)
    med = {w: statistics.median(r) for w, r in res.items()}
    rows = [["1 (in the learner, 2 threads)", f"{med[1]:.1f}", "1.00x"],
            ["2 Ray workers (1 thread each)", f"{med[2]:.1f}", f"{med[2] / med[1]:.2f}x"]]
    return table(["rollout workers", "episodes / min", "vs 1"], rows) + (
        f"\n\nPhase 1 only (turn 1, hint, turn 2; 48-token answers, 24-token hints), 8 "
        f"episodes per collection in 2 jobs, medians of {repeats} collections after one "
        f"untimed (which starts the workers and loads their models).")


def run_child(layout: str, threads: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-guidance-") as tmp:
        cmd = [sys.executable, "-m", "tools.bench.bench_guidance", "--child", layout,
               "--out", tmp, "--threads", str(threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"{layout} child failed:\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


def measured(runs: int, threads: int) -> str:
    from tools.bench.report import table

    res: dict[str, list[dict[str, float]]] = {k: [] for k in LAYOUTS}
    for _ in range(runs):
        for layout in ("naive", "shared"):
            res[layout].append(run_child(layout, threads))
            print(layout, res[layout][-1], flush=True)
    keys = ("init_peak_mib", "ready_rss_mib", "ready_pss_mib", "iteration_peak_mib")
    med = {k: {m: statistics.median(r[m] for r in v) for m in keys} for k, v in res.items()}
    s, n = med["shared"], med["naive"]
    rows = [[LAYOUTS[k], *(f"{med[k][m]:,.0f}" for m in keys)] for k in LAYOUTS]
    rows.append(["shared / naive", *(f"{s[m] / n[m]:.2f}x" for m in keys)])
    gap = max(abs(a[k] - b[k]) for a, b in zip(res["shared"], res["naive"], strict=True)
              for k in ("critic_loss", "actor_loss"))
    return (table(["layout", "load peak RSS MiB", "ready RSS MiB", "ready PSS MiB",
                   "iteration peak RSS MiB"], rows)
            + f"\n\nTarget: initialisation <= 0.4x naive. Ready (weights resident): "
            f"**{s['ready_rss_mib'] / n['ready_rss_mib']:.2f}x** RSS, "
            f"{s['ready_pss_mib'] / n['ready_pss_mib']:.2f}x PSS; right after loading, "
            f"{s['init_peak_mib'] / n['init_peak_mib']:.2f}x (the copies are mapped, not yet "
            f"read). Largest critic / actor loss difference between the layouts: {gap:.1e}.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=[*LAYOUTS, "throughput1", "throughput2"],
                   help="internal: run one layout or one throughput measurement")
    p.add_argument("--out", help="internal")
    a = p.parse_args()
    if a.child and a.child.startswith("throughput"):
        child_throughput(int(a.child[-1]), Path(a.out), 8, a.runs)
        return
    if a.child:
        child(a.child, Path(a.out), a.threads)
        return
    from tools.bench.report import stamp, write_section

    body = ("## Two-turn guidance trainer: memory of the layouts\n\n"
            "### The seed's situation, planned: one 44.5 GB GPU and 64 GB of CPU RAM\n\n"
            "Made-up sizes from the seed (base 7-13 GB, critics 2-3 GB); trained = weights + "
            "gradients + AdamW (x4), LoRA adapters 1% of the base each (x4).\n\n"
            + seed_plans()
            + "\n\n### Measured: SmolLM2-135M + MiniLM critic, 1 iteration of 2 episodes\n\n"
            + f"{stamp()} 24-token answers, 12-token hints, {a.threads} threads, medians of "
            f"{a.runs} fresh processes per layout.\n\n" + measured(a.runs, a.threads)
            + "\n\n### Phase 1 throughput, 1 vs 2 rollout workers\n\n" + throughput(a.runs))
    print(body)
    write_section("guidance", body)


if __name__ == "__main__":
    main()
