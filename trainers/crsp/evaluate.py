"""Held-out evaluation of a CRSP run's checkpoints (``python -m trainers.crsp.evaluate
--run-dir DIR --steps 0,N``): for each checkpoint (0: the adapters before any step),

- solver accuracy on held-out problems (reasoning-gym, ``--eval-seed``; every problem whose
  question is among the run's training problems is removed and the overlap after removal is
  reported: 0; each distinct question once), one greedy attempt each, scored by the task's
  verifier;
- critic verdict accuracy on held-out solver attempts (one sampled attempt per problem by
  that checkpoint's solver, labelled by the verifier), the verdict being the likelier of the
  two verdict continuations (``rollout.verdict_logprobs``), against the majority-class rate
  (and the balanced accuracy: the mean recall of the two classes);
- from ``metrics.jsonl``, the proposer's well-formed proposals over the first and the last
  ``--window`` steps;

each with its 95% Wilson interval. Prints one JSON object (and writes ``--out``,
by default ``DIR/eval.json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainers.crsp.config import Config
from trainers.crsp.rewards import balanced_accuracy
from trainers.crsp.roles import Prompts, activate, make_model
from trainers.crsp.rollout import verdict_logprobs
from trainers.llm.generation import generate
from trainers.llm.tasks import extract_answer, task_problems, wilson


def proportion(k: float, n: int) -> dict[str, Any]:
    """``k`` of ``n`` with its 95% Wilson interval (plain data)."""
    lo, hi = wilson(k, n) if n else (0.0, 0.0)
    return {"k": k, "n": n, "rate": k / n if n else 0.0, "wilson95": [lo, hi]}


def held_out(cfg: Config, n: int, seed: int) -> tuple[Any, list[int], int]:
    """``(dataset, indices, overlap)``: ``n`` problems of the run's task drawn with ``seed``,
    the indices of those whose question no training problem has (each distinct question
    once), and the overlap left."""
    train_q = {p["question"] for p in task_problems(cfg.task, cfg.train_size, cfg.seed,
                                                    cfg.task_config)}
    data = task_problems(cfg.task, n, seed, cfg.task_config)
    first = {}  # each distinct question once
    for i in range(n):
        first.setdefault(data[i]["question"], i)
    keep = [i for q, i in first.items() if q not in train_q]
    return data, keep, sum(data[i]["question"] in train_q for i in keep)


def evaluate_checkpoint(cfg: Config, run_dir: Path, step: int, data: Any, keep: list[int],
                        seed: int) -> dict[str, Any]:
    """Solver and critic figures of checkpoint ``step`` (0: initial adapters)."""
    from safetensors.torch import load_file

    model, tok, _ = make_model(cfg)
    if step:
        model.load_state_dict(load_file(str(run_dir / "ckpt" / f"step-{step}" /
                                            "adapters.safetensors")), strict=False)
    prompts = Prompts(tok, cfg.max_prompt_tokens, _cache())
    sampling = cfg.sampling(cfg.solver_tokens, generate_dtype=cfg.generate_dtype)
    s_prompts = [prompts("solver", data[i]["question"]) for i in keep]
    activate(model, "solver")
    torch.manual_seed(seed)
    greedy = generate(model, tok, s_prompts, sampling, n_per_prompt=1, greedy=True,
                      max_new=cfg.solver_tokens)
    sampled = generate(model, tok, s_prompts, sampling, n_per_prompt=1,
                       max_new=cfg.solver_tokens)

    def correct(ids: np.ndarray, i: int) -> bool:
        got = extract_answer(tok.decode(ids, skip_special_tokens=True))[0]
        return bool(got) and data.score_answer(got, data[i]) == 1.0

    solved = [correct(c, i) for (c, _), i in zip(greedy, keep, strict=True)]
    labels = np.array([correct(c, i) for (c, _), i in zip(sampled, keep, strict=True)])
    c_prompts = [prompts("critic", f"Problem:\n{data[i]['question']}\n\nSolution:\n"
                                   f"{tok.decode(c, skip_special_tokens=True)}")
                 for (c, _), i in zip(sampled, keep, strict=True)]
    lp = verdict_logprobs(model, tok, c_prompts, cfg.packing(cfg.pack_tokens, cfg.train_dtype))
    says = lp[:, 0] > lp[:, 1]
    n = len(keep)
    return {"step": step, "solver_accuracy": proportion(int(sum(solved)), n),
            "critic_accuracy": proportion(int((says == labels).sum()), n),
            "critic_majority_rate": proportion(int(max(labels.sum(), n - labels.sum())), n),
            "critic_balanced_accuracy": balanced_accuracy(says, labels),
            "critic_says_correct": float(says.mean()),
            "attempts_correct": proportion(int(labels.sum()), n)}


def _cache() -> Any:
    from rlbuffers.cache import ByteLRUCache

    return ByteLRUCache(16 << 20)


def proposer_windows(run_dir: Path, cfg: Config, window: int) -> dict[str, Any]:
    """Well-formed proposals over the first and the last ``window`` steps of metrics.jsonl
    (empty before the first step is committed)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if not rows:
        return {"steps": 0}
    per_step = cfg.seeds_per_step * cfg.proposer_samples

    def part(rs: list[dict[str, Any]]) -> dict[str, Any]:
        k = round(sum(r["proposals_valid"] * per_step for r in rs))
        return {**proportion(k, per_step * len(rs)), "steps": [rs[0]["step"], rs[-1]["step"]]}

    return {"first": part(rows[:window]), "last": part(rows[-window:]), "steps": len(rows)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--steps", default="0", help="checkpoints, comma-separated (0: initial)")
    ap.add_argument("--problems", type=int, default=200, help="held-out problems drawn")
    ap.add_argument("--eval-seed", type=int, default=987654, help="seed of the held-out draw")
    ap.add_argument("--window", type=int, default=20, help="steps per proposer window")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="JSON file (DIR/eval.json)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    raw = json.loads((a.run_dir / "config.json").read_text())
    cfg = Config(**{k: v for k, v in raw.items() if k in Config.__dataclass_fields__})
    data, keep, overlap = held_out(cfg, a.problems, a.eval_seed)
    out: dict[str, Any] = {"held_out": len(keep), "removed_as_seen": a.problems - len(keep),
                           "overlap_with_training": overlap,
                           "proposer": proposer_windows(a.run_dir, cfg, a.window),
                           "checkpoints": [evaluate_checkpoint(cfg, a.run_dir, int(s), data,
                                                               keep, a.eval_seed)
                                           for s in a.steps.split(",")]}
    (a.out or a.run_dir / "eval.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
