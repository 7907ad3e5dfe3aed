"""Benchmark of ``trainers/grpo/`` against TRL's ``GRPOTrainer``: section ``grpo`` of
``docs/benchmarks.md``.

Both trainers get the same model (SmolLM2-135M-Instruct, fp32 weights), precision, prompts
(reasoning-gym, the same chat template and system prompt), reward (reasoning-gym's
``score_answer`` on the extracted answer plus the format reward), group size, completion length,
beta, learning rate, AdamW, and LoRA on or off. TRL keeps its defaults otherwise (gradient
checkpointing on). Each run is a fresh subprocess (``--child ours|trl``); the parent samples its
RSS every 50 ms (the whole process, model loading and imports included) and reads its per-step
seconds and completion tokens from what the child prints. Runs of the two trainers alternate
(TRL, ours, TRL, ours, ...), so a slow spell of the shared machine falls on both; medians of
``--runs`` runs of ``--steps`` steps each.

Rows (see ``ROWS``): LoRA r=16, G=4, 64 tokens, beta 0.04; full fine-tuning G=8, 256 tokens,
beta 0.04; full fine-tuning G=4, 64 tokens (whose weights + gradients + AdamW state alone are
~2.15 GB: the floor); each in fp32 for both trainers, and (``*_bf16``) in bf16 mixed precision
for both: TRL's default ``bf16=True`` (autocast around every forward, generation included)
against ours with ``--train-dtype bfloat16`` (autocast in the reference and update forwards, LM
head in fp32) and ``--generate-dtype bfloat16`` (a bf16 copy of the weights while decoding).
Master weights, gradients and AdamW state stay fp32 in both. ``--only NAME,...`` runs some rows
and keeps each row's text in ``~/.cache/rlbuffers/bench-grpo-rows``; a row not run on this machine
keeps the text it has in ``docs/benchmarks.md`` (``row_text``), so the section is rewritten with
the new rows and the old ones as they were.
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
from typing import Any

MIB = 2**20
ROWS_DIR = Path.home() / ".cache" / "rlbuffers" / "bench-grpo-rows"
COMMON = {"prompts": 4, "lr": 1e-5, "task": "gsm_symbolic", "threads": 2}
BASE_ROWS = {
    "lora": {"group": 4, "tokens": 64, "beta": 0.04, "lora": 16, "lr": 1e-4},
    "full_g8_256": {"group": 8, "tokens": 256, "beta": 0.04, "lora": 0},
    "full_g4_64": {"group": 4, "tokens": 64, "beta": 0.04, "lora": 0},
}
ROWS = {**{k: {**v, "precision": "fp32"} for k, v in BASE_ROWS.items()},
        **{f"{k}_bf16": {**v, "precision": "bf16"} for k, v in BASE_ROWS.items()}}
PHASES = ("generate", "reference", "update", "commit")  # of ours; commit overlaps the next step
_TITLES = {"lora": "LoRA r=16, G=4, 64 tokens, beta 0.04",
           "full_g8_256": "full fine-tuning, G=8, 256 tokens, beta 0.04",
           "full_g4_64": "full fine-tuning, G=4, 64 tokens, beta 0.04"}
TITLES = {**{k: v + ", fp32" for k, v in _TITLES.items()},
          **{f"{k}_bf16": v + ", bf16 mixed precision" for k, v in _TITLES.items()}}


# ----- children ---------------------------------------------------------------------------

def child_ours(row: dict[str, Any], steps: int, out: Path) -> None:
    from trainers.grpo import train as grpo

    args = ["--run-dir", str(out / "run"), "--task", row["task"], "--steps", str(steps),
            "--prompts-per-step", str(row["prompts"]), "--group-size", str(row["group"]),
            "--max-completion-tokens", str(row["tokens"]), "--beta", str(row["beta"]),
            "--lora-rank", str(row["lora"]), "--lr", str(row["lr"]), "--no-evaluate",
            "--generate-threads", str(row["threads"]), "--train-threads", str(row["threads"]),
            "--device", row.get("device", "cpu")]
    if row["precision"] == "bf16":
        args += ["--generate-dtype", "bfloat16", "--train-dtype", "bfloat16"]
    grpo.main(args)
    for line in (out / "run" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        print("STEP " + json.dumps({"seconds": m["step_seconds"],
                                    "tokens": m["completion_tokens"],
                                    **{k: m.get(f"seconds_{k}", 0.0) for k in PHASES}}),
              flush=True)


def child_trl(row: dict[str, Any], steps: int, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainers.grpo.config import Config
    from trainers.grpo.rewards import score_group
    from trainers.llm import tasks as math_tasks
    from trainers.llm.model import smollm2_dir

    torch.set_num_threads(row["threads"])
    problems = math_tasks.task_problems(row["task"], 2000, 0)
    order = __import__("numpy").random.default_rng([0, 0]).permutation(len(problems))
    data = Dataset.from_list([
        {"prompt": [{"role": "system", "content": math_tasks.SYSTEM},
                    {"role": "user", "content": problems[int(i)]["question"]}], "idx": int(i)}
        for i in order[:row["prompts"] * steps]])

    def reward(completions: list[Any], idx: list[int], **_: Any) -> list[float]:
        texts = [c[0]["content"] for c in completions]
        per_prompt = [idx[k] for k in range(0, len(idx), row["group"])]
        return score_group(problems, per_prompt, texts, row["group"],
                           Config().format_reward)["reward"].tolist()

    class Times(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.seconds = time.perf_counter() - self.t0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **k: Any) -> None:
            if logs and "completions/mean_length" in logs:
                n = logs["completions/mean_length"] * row["prompts"] * row["group"]
                print("STEP " + json.dumps({"seconds": self.seconds, "tokens": n}), flush=True)

    peft_config = None
    if row["lora"]:
        from peft import LoraConfig
        peft_config = LoraConfig(r=row["lora"], lora_alpha=32, lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"])
    args = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=row["prompts"]
                      * row["group"], gradient_accumulation_steps=1,
                      num_generations=row["group"], max_completion_length=row["tokens"],
                      max_steps=steps, learning_rate=row["lr"], beta=row["beta"],
                      logging_steps=1, save_strategy="no", report_to=[],
                      use_cpu=row.get("device", "cpu") == "cpu",
                      gradient_checkpointing=row.get("gradient_checkpointing", True),
                      bf16=row["precision"] == "bf16", seed=0, temperature=1.0,
                      shuffle_dataset=False)
    trainer = GRPOTrainer(model=str(smollm2_dir()), reward_funcs=reward, args=args,
                          train_dataset=data, peft_config=peft_config, callbacks=[Times()])
    trainer.train()
    if torch.cuda.is_available() and row.get("device", "cpu") != "cpu":
        print(f"CUDA_PEAK {torch.cuda.max_memory_allocated()}", flush=True)


# ----- parent -----------------------------------------------------------------------------

def run_child(kind: str, row: dict[str, Any], steps: int) -> dict[str, float]:
    """One run in a fresh process: its peak RSS (sampled by this process every 50 ms, the
    same way for both trainers; the kernel's ``ru_maxrss`` is not used because the memory
    monitor of ours resets the high-water mark per phase), median step seconds and completion
    tokens per second."""
    from tools.bench.report import run_sampled
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        cmd = [sys.executable, "-m", "tools.bench.bench_grpo", "--child", kind,
               "--row", json.dumps(row), "--steps", str(steps), "--out", tmp]
        env = dict(os.environ, OMP_NUM_THREADS=str(row["threads"]),
                   TOKENIZERS_PARALLELISM="false")
        run = run_sampled(cmd, env, interval_s=0.05)
    if run.returncode:
        raise RuntimeError(f"{kind} child failed:\n{run.stderr[-3000:]}")
    stdout, peak = run.stdout, run.peak_rss_bytes
    steps_out = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("STEP ")]
    secs = [s["seconds"] for s in steps_out]
    return {"peak_rss_mib": peak / MIB, "step_seconds": statistics.median(secs),
            "tokens_per_s": sum(s["tokens"] for s in steps_out) / sum(secs),
            **{k: statistics.median(s.get(k, 0.0) for s in steps_out) for k in PHASES}}


def bench_row(name: str, runs: int, steps: int) -> str:
    from tools.bench.report import stamp, table
    row = {**COMMON, **ROWS[name]}
    results: dict[str, list[dict[str, float]]] = {"ours": [], "trl": []}
    for _ in range(runs):
        for kind in ("trl", "ours"):
            results[kind].append(run_child(kind, row, steps))
            print(kind, results[kind][-1], flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in results.items()}
    o, t = med["ours"], med["trl"]
    floor = 135e6 * 16 / MIB if not row["lora"] else 0  # fp32 weights + grads + 2 AdamW moments
    rows = [["rlbuffers trainers/grpo/", f"{o['peak_rss_mib']:,.0f}",
             f"{o['peak_rss_mib'] / t['peak_rss_mib']:.2f}x",
             f"{o['step_seconds']:.1f}", f"{o['step_seconds'] / t['step_seconds']:.2f}x",
             f"{o['tokens_per_s']:.1f}"],
            ["TRL 1.16 GRPOTrainer", f"{t['peak_rss_mib']:,.0f}", "1.00x",
             f"{t['step_seconds']:.1f}", "1.00x", f"{t['tokens_per_s']:.1f}"]]
    text = (f"### {TITLES[name]}\n\n{stamp()} {row['prompts']} prompts x {row['group']} "
            f"completions x {row['tokens']} tokens per step, {steps} steps per run, medians of "
            f"{runs} runs each, {row['threads']} threads.\n\n"
            + table(["trainer", "peak RSS MiB", "vs TRL", "s / step", "vs TRL",
                     "completion tokens / s"], rows))
    text += ("\n\nOurs per phase (s, medians): " + ", ".join(
        f"{k} {o[k]:.1f}" for k in PHASES) + " (the checkpoint and buffer commit of a step are "
        "written while the next step generates).")
    if floor:
        text += (f"\n\nPeak minus the {floor:,.0f} MiB floor of fp32 weights + gradients + "
                 f"AdamW state: ours {o['peak_rss_mib'] - floor:,.0f} MiB, TRL "
                 f"{t['peak_rss_mib'] - floor:,.0f} MiB.")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip()
    return text + (f"\n\nMeasured at {head}." if head else "")


def row_text(name: str, section: str) -> str | None:
    """The text of row ``name``: this machine's cached run, else its subsection (from its
    ``### `` title to the next) in ``section`` (the current section ``grpo``), else None."""
    cached = ROWS_DIR / f"{name}.md"
    if cached.exists():
        return cached.read_text()
    title = f"### {TITLES[name]}\n"
    start = section.find(title)
    if start < 0:
        return None
    end = section.find("\n### ", start + len(title))
    return section[start:len(section) if end < 0 else end].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated rows: " + ",".join(ROWS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--child", choices=["ours", "trl"], help="internal: run one trainer")
    p.add_argument("--row", help="internal")
    p.add_argument("--out", help="internal")
    a = p.parse_args()
    if a.child:
        {"ours": child_ours, "trl": child_trl}[a.child](json.loads(a.row), a.steps, Path(a.out))
        return
    from tools.bench.report import write_section
    ROWS_DIR.mkdir(parents=True, exist_ok=True)
    for name in a.only.split(",") if a.only else list(ROWS):
        text = bench_row(name, a.runs, a.steps)
        print(text, flush=True)
        (ROWS_DIR / f"{name}.md").write_text(text)
    from tools.bench.report import read_section
    old = read_section("grpo")
    texts = [row_text(n, old) for n in ROWS]
    if all(texts):
        body = ["Per step: generate P x G completions, score, reference log-probs, update. "
                "Peak RSS is the whole process (imports and model loading included), sampled "
                "every 50 ms by the parent, the same way for both trainers. Ours also writes "
                "an atomic checkpoint every step (weights and AdamW state, 1.6 GB in full "
                "fine-tuning, on a worker thread while the next step generates) and commits the "
                "rollout buffer; TRL saves nothing (`save_strategy=\"no\"`)."]
        write_section("grpo", "\n\n".join(
            ["## GRPO trainer vs TRL GRPOTrainer (SmolLM2-135M-Instruct, CPU)", *body]
            + texts))


if __name__ == "__main__":
    main()
