"""Paired held-out comparison of two GRPO runs at one step (``python3 -m trainers.grpo.compare
--run-dir A --run-dir B --step 70``): both checkpoints answer the same held-out problems
greedily, one at a time on the same problems, so their accuracies are paired; reports each
run's accuracy (Wilson 95%), the 2x2 table (``both``, ``breaks``: A right and B wrong,
``fixes``: A wrong and B right, ``neither``), the difference B - A with Newcombe's hybrid
score interval (Newcombe 1998, method 10) and the exact McNemar p (McNemar 1947).

The runs must share what draws their held-out set (``--task``, ``--task-config``, ``--seed``,
``--train-size``, ``--eval-size``; e.g. a synchronous run and a ``--generation-workers`` run of
the same seed) and what the evaluation decodes with (``--model``, ``--lora-rank``,
``--max-completion-tokens``, ``--generate-dtype``); anything else (learning rate, workers,
staleness) may differ. Decoding is greedy on one thread (``generation.EVAL_THREADS``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainers.common import write_atomic
from trainers.config import ConfigError, saved_config
from trainers.grpo.config import Config
from trainers.grpo.evaluate import eval_sets
from trainers.grpo.policy import load_weights, make_policy
from trainers.llm.evaluation import greedy_scores
from trainers.llm.tasks import task_problems
from trainers.statistics import mcnemar_exact, newcombe_paired, paired_counts, wilson
from trainers.summary import json_bytes

#: Config fields two compared runs must share: the held-out set's draw, then the decoding.
SHARED = ("task", "task_config", "seed", "train_size", "eval_size",
          "model", "lora_rank", "max_completion_tokens", "generate_dtype")


def paired(first: np.ndarray, second: np.ndarray) -> dict[str, Any]:
    """The paired figures of two runs' per-problem results (bool ``[n]`` each, the same
    problems in the same order): the 2x2 counts, each run's accuracy with its Wilson 95%
    interval, ``difference`` (second - first) with Newcombe's ``ci95`` and ``mcnemar_p``.

    Raises:
        ValueError: the two differ in length, or are empty.
    """
    both, breaks, fixes, neither = paired_counts(first, second)
    diff, lo, hi = newcombe_paired(both, breaks, fixes, neither)
    n, right = both + breaks + fixes + neither, (both + breaks, both + fixes)
    return {"n": n, "both": both, "breaks": breaks, "fixes": fixes, "neither": neither,
            "accuracy": [k / n for k in right], "ci95": [list(wilson(k, n)) for k in right],
            "difference": diff, "difference_ci95": [lo, hi],
            "mcnemar_p": mcnemar_exact(breaks, fixes)}


def weights_file(run_dir: Path, step: int) -> Path:
    """The trained weights of checkpoint ``step`` (``policy.save_weights``' file)."""
    return run_dir / "ckpt" / f"step-{step}" / "weights.safetensors"


def check_runs(cfgs: list[Config], run_dirs: list[Path], step: int) -> None:
    """Refuse two runs whose held-out sets or decoding differ, or a missing checkpoint.

    Raises:
        ConfigError: naming the flag (``--seed: ...``) or the checkpoint.
    """
    for name in SHARED:
        values = [getattr(c, name) for c in cfgs]
        if values[0] != values[1]:
            raise ConfigError(f"--{name.replace('_', '-')}: expected the same value in both "
                              f"runs (their held-out problems and decoding must be equal), got "
                              f"{values[0]!r} in {run_dirs[0]} and {values[1]!r} in "
                              f"{run_dirs[1]}")
    if not cfgs[0].eval_size:
        raise ConfigError(f"--eval-size: expected runs with a held-out set, got 0 in "
                          f"{run_dirs[0]}")
    for d in run_dirs:
        if not weights_file(d, step).is_file():
            raise ConfigError(f"--step: expected a checkpoint both runs keep, got {step} "
                              f"({weights_file(d, step).parent} is missing)")


def answers(cfg: Config, run_dir: Path, step: int, problems: list[dict[str, Any]],
            correct: Any) -> np.ndarray:
    """Per-problem greedy correctness (bool ``[n]``) of the run's checkpoint ``step``."""
    model, tok, _ = make_policy(cfg)
    load_weights(model, cfg.lora_rank > 0, weights_file(run_dir, step))
    model.eval()
    sampling = cfg.sampling(cfg.max_completion_tokens, torch.device("cpu"),
                            generate_dtype=cfg.generate_dtype, packed_weights=cfg.packed_weights)
    scored, _ = greedy_scores(model, tok, problems, sampling, correct,
                              progress=f"{run_dir.name} step {step}: {len(problems)} problems")
    return scored["correct"] > 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python3 -m trainers.grpo.compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", action="append", type=Path, required=True,
                    help="a GRPO run directory; give it twice (A, then B)")
    ap.add_argument("--step", type=int, required=True, help="the checkpoint of both runs")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: print only)")
    a = ap.parse_args(argv)
    if len(a.run_dir) != 2:
        raise ConfigError(f"--run-dir: expected two run directories, got {len(a.run_dir)}")
    cfgs = [Config(**saved_config(Config, d / "config.json")) for d in a.run_dir]
    check_runs(cfgs, a.run_dir, a.step)
    cfg = cfgs[0]
    sets = eval_sets(cfg.task, cfg.task_config,
                     task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config),
                     cfg.eval_size, 0, cfg.seed)
    right = [answers(c, d, a.step, sets.task, sets.correct)
             for c, d in zip(cfgs, a.run_dir, strict=True)]
    out = {"runs": [str(d) for d in a.run_dir], "step": a.step, "held_out": sets.report,
           **paired(*right)}
    text = json_bytes(out)
    if a.out:
        write_atomic(a.out, text)
    print(text.decode())
    return out


if __name__ == "__main__":  # a bad flag or run directory: one line (exit code 2)
    from trainers.config import run_main

    run_main("trainers.grpo.compare", "python3 -m trainers.grpo.compare", resumable=False)
