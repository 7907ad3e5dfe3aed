"""Held-out evaluation of a CRSP run's checkpoints (``python -m trainers.crsp.evaluate
--run-dir DIR --steps 0,N``): for each checkpoint (0: the adapters before any step),

- solver accuracy on held-out problems: ``--eval-size`` problems of the run's task that share
  no content key (normalised question text, or for arithmetic the operand tuple:
  ``trainers.llm.evaluation.held_out``, the LLM trainers' shared evaluation) with any
  training seed problem *or any problem the run's proposer wrote* (read from ``DIR/buffer``),
  the overlap recomputed on the result (0); one greedy attempt each, scored by the task's
  verifier (a wrong number scores what no answer scores);
- the critic's own verdict (``margin > 0``, no threshold fitted) first, as
  ``critic_balanced_accuracy_raw``: balanced accuracy on the first attempt of every held-out
  problem with its 95% interval (:func:`balanced_accuracy_ci`), and the same on the balanced
  set; the calibrated threshold below is a secondary reading only;
- critic verdict accuracy on held-out solver attempts (``--critic-attempts`` sampled attempts
  per problem by that checkpoint's solver, labelled by the verifier), the verdict being the
  likelier of the two verdict continuations (``rollout.verdict_logprobs``): on the first
  attempt of every problem against the majority-class rate of those attempts, and on a
  class-balanced set (each problem's first correct and first incorrect attempt, the larger
  class cut to the smaller's size, by problem order) against its majority rate of 50%;
  balanced accuracy (the mean recall of the two classes) of both; the AUC of the verdict
  margin ``L_correct - L_incorrect`` (threshold-free); and the same figures with the verdict
  read at a *calibrated* threshold, ``margin > tau``, ``tau`` the one of best balanced accuracy
  (Youden's J) on that checkpoint's margins over ``--calibration-size`` of the run's own
  *training* seed problems (sampled attempts by the same solver, labelled by the verifier):
  an operating point set on training data, never on the held-out set, by the same procedure
  for every checkpoint;
- from ``metrics.jsonl``, the proposer's well-formed proposals over the first and the last
  ``--window`` steps, and (runs from issue 49 on) its verified proposals (the stated answer
  confirmed by ``trainers.crsp.verify``) and solvable ones (verified, and the solver reached
  the answer at least once): training proposals, not a held-out figure;

each with its 95% Wilson interval. Prints one JSON object (and writes ``--out``,
by default ``DIR/eval.json``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainers.common import metrics_rows, write_atomic
from trainers.config import saved_config
from trainers.crsp.config import Config
from trainers.crsp.formats import proposal_parts
from trainers.crsp.rewards import balanced_accuracy
from trainers.crsp.roles import ROLE_ID, Prompts, activate, make_model
from trainers.crsp.rollout import verdict_logprobs
from trainers.llm.evaluation import HELD_OUT_SEED, held_out, task_correct
from trainers.llm.generation import EVAL_THREADS, generate
from trainers.llm.tasks import extract_answer, task_problems, wilson
from trainers.phases import Count, heartbeat
from trainers.summary import json_bytes


def proportion(k: float, n: int) -> dict[str, Any]:
    """``k`` of ``n`` with its 95% Wilson interval (plain data)."""
    lo, hi = wilson(k, n) if n else (0.0, 0.0)
    return {"k": k, "n": n, "rate": k / n if n else 0.0, "wilson95": [lo, hi]}


def proposals(run_dir: Path, tok: Any) -> list[dict[str, Any]]:
    """The problems the run's proposer wrote (``{"question"}`` dicts, every parsed question):
    those of every step in ``DIR/metrics.jsonl`` (``proposed_questions``) and those still in
    ``DIR/buffer``'s last commit (the buffer alone loses the oldest steps once its capacity
    is reached; runs before the metrics kept them have only the buffer)."""
    from rlbuffers import ReplayBuffer

    questions: list[str] = []
    for row in metrics_rows(run_dir):
        questions += row.get("proposed_questions", [])
    if (run_dir / "buffer").exists():
        with ReplayBuffer.open(run_dir / "buffer", mode="r") as buf:
            rows = buf[np.arange(len(buf))] if len(buf) else {"role": np.zeros(0)}
        mine = np.flatnonzero(np.asarray(rows["role"]) == ROLE_ID["proposer"])
        texts = [tok.decode(rows["completion_ids"][i], skip_special_tokens=True) for i in mine]
        questions += [q for q, _ in map(proposal_parts, texts) if q]
    return [{"question": q} for q in dict.fromkeys(questions)]


def training_seeds(cfg: Config) -> list[dict[str, Any]]:
    """The run's training seed problems, as the trainer drew them."""
    return [dict(p) for p in task_problems(cfg.task, cfg.train_size, cfg.seed,
                                           cfg.task_config)]


def evaluation_set(cfg: Config, run_dir: Path, tok: Any, size: int, seed: int
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The held-out problems and their report (``held_out``'s, plus how many training seeds
    and proposals they were kept apart from)."""
    seeds = training_seeds(cfg)
    written = proposals(run_dir, tok)
    problems, report = held_out(cfg.task, cfg.task_config, seeds + written, size, seed)
    return problems, {**report, "training_seeds": len(seeds), "proposals": len(written)}


def auc(scores: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Area under the ROC curve of ``scores`` (float[n], higher: more likely correct) against
    ``labels`` (bool[n], both classes present): the probability that a correct attempt scores
    above an incorrect one, ties counted half (the Mann-Whitney U / (n1 n0)), with the 95%
    interval of Hanley & McNeil 1982 ("The meaning and use of the area under a ROC curve",
    Radiology 143, eq. 1-3). Threshold-free: 0.5 for a critic that does not look at the
    attempt, whatever verdict it prefers."""
    s, y = np.asarray(scores, np.float64), np.asarray(labels, bool)
    pos, neg = s[y], s[~y]
    diff = pos[:, None] - neg[None, :]
    a = float(((diff > 0) + 0.5 * (diff == 0)).mean())
    n1, n0 = len(pos), len(neg)
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = np.sqrt((a * (1 - a) + (n1 - 1) * (q1 - a * a) + (n0 - 1) * (q2 - a * a)) / (n1 * n0))
    return {"auc": a, "ci95": [max(0.0, a - 1.96 * se), min(1.0, a + 1.96 * se)],
            "n_correct": n1, "n_incorrect": n0}


def balanced_accuracy_ci(says: np.ndarray, labels: np.ndarray) -> dict[str, Any] | None:
    """Balanced accuracy ``BA = (TPR + TNR) / 2`` of verdicts ``says`` against ``labels``
    (bool[n] each, True: correct) with its 95% interval: each recall's Wilson interval
    combined by MOVER (method of variance estimates recovery: Zou & Donner 2008,
    "Construction of confidence limits about effect measures: a general approach", Stat.
    Med. 27; the square-and-add of Newcombe 1998, method 10, for a sum instead of a
    difference): ``BA - sqrt((TPR - l1)^2 + (TNR - l0)^2) / 2``, ``BA + sqrt((u1 - TPR)^2 +
    (u0 - TNR)^2) / 2``. It treats the two recalls as independent: exact on attempts of
    distinct problems (one attempt per problem); on the balanced set, where a problem gives
    one attempt of each class, the recalls may correlate. None when a class is missing."""
    y, v = np.asarray(labels, bool), np.asarray(says, bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if not n1 or not n0:
        return None
    tp, tn = int((v & y).sum()), int((~v & ~y).sum())
    (l1, u1), (l0, u0) = wilson(tp, n1), wilson(tn, n0)
    tpr, tnr = tp / n1, tn / n0
    ba = (tpr + tnr) / 2
    lo = ba - 0.5 * float(np.hypot(tpr - l1, tnr - l0))
    hi = ba + 0.5 * float(np.hypot(u1 - tpr, u0 - tnr))
    return {"value": ba, "ci95": [max(0.0, lo), min(1.0, hi)], "n": n1 + n0,
            "tpr": proportion(tp, n1), "tnr": proportion(tn, n0),
            "says_correct": float(v.mean()), "interval": "MOVER of Wilson recalls"}


def critic_figures(says: np.ndarray, labels: np.ndarray, margin: np.ndarray | None = None
                   ) -> dict[str, Any]:
    """Verdict accuracy, the majority-class rate and balanced accuracy of ``says`` against
    ``labels`` (bool[n] each; True: correct), and with ``margin`` (float[n], the verdict
    log-prob margin ``L_correct - L_incorrect``) its :func:`auc`."""
    n, k = len(labels), int(labels.sum())
    both = 0 < k < n
    return {"accuracy": proportion(int((says == labels).sum()), n),
            "majority_rate": proportion(max(k, n - k), n),
            "balanced_accuracy": balanced_accuracy(says, labels) if both else None,
            "says_correct": float(says.mean()) if n else 0.0,
            "attempts_correct": proportion(k, n),
            **({"auc": auc(margin, labels)} if margin is not None and both else {})}


def youden_threshold(margin: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """The verdict threshold ``tau`` that maximises balanced accuracy (equivalently Youden's
    ``J = TPR + TNR - 1``: Youden 1950, "Index for rating diagnostic tests") of ``margin >
    tau`` against ``labels`` (float[n], bool[n]): over every distinct cut of the sorted
    margins, ``tau`` the midpoint between the two margins it falls between (below the
    smallest: everything "correct"; at the largest: everything "incorrect"); the lowest such
    ``tau`` on ties. Returns ``{"tau", "balanced_accuracy", "n"}``; ``tau`` 0.0 and
    ``balanced_accuracy`` None when a class is missing.

    Raises:
        ValueError: ``margin`` and ``labels`` of different lengths.
    """
    m, y = np.asarray(margin, np.float64), np.asarray(labels, bool)
    if m.shape != y.shape or m.ndim != 1:
        raise ValueError(f"margin / labels: expected float[n] and bool[n], got {m.shape} and "
                         f"{y.shape}")
    n1 = int(y.sum())
    n0 = len(y) - n1
    if not n1 or not n0:
        return {"tau": 0.0, "balanced_accuracy": None, "n": len(y)}
    order = np.argsort(m, kind="stable")
    ms, ys = m[order], y[order]
    # Cut after the first i sorted margins (i = 0..n): those say "incorrect", the rest
    # "correct"; only cuts between distinct margins are realisable by a threshold.
    below_neg = np.concatenate([[0], np.cumsum(~ys)])  # true negatives
    below_pos = np.concatenate([[0], np.cumsum(ys)])  # false negatives
    ba = 0.5 * ((n1 - below_pos) / n1 + below_neg / n0)
    ok = np.ones(len(ms) + 1, bool)
    ok[1:-1] = ms[1:] > ms[:-1]
    i = int(np.flatnonzero(ok)[np.argmax(ba[ok])])
    tau = (ms[0] - 1.0 if i == 0 else ms[-1] if i == len(ms)
           else 0.5 * (ms[i - 1] + ms[i]))
    return {"tau": float(tau), "balanced_accuracy": float(ba[i]), "n": len(y)}


def balanced_set(labels: np.ndarray) -> np.ndarray:
    """Indices ``(problem, attempt)`` (int[2m, 2]) of a class-balanced set from ``labels``
    (bool[P, K]: attempt k of problem p was correct): each problem's first correct and first
    incorrect attempt, then the first ``m`` of each class by problem order, ``m`` the smaller
    class's count."""
    firsts: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for p, row in enumerate(labels):
        for y in (True, False):
            hit = np.flatnonzero(row == y)
            if len(hit):
                firsts[y].append((p, int(hit[0])))
    m = min(len(firsts[True]), len(firsts[False]))
    return np.array(firsts[True][:m] + firsts[False][:m], np.int64).reshape(-1, 2)


def load_checkpoint(cfg: Config, run_dir: Path, step: int) -> tuple[Any, Any]:
    """``(model, tokenizer)`` with the adapters of checkpoint ``step`` (0: initial)."""
    from trainers.crsp.resume import restore_adapters

    model, tok, _ = make_model(cfg)
    if step:
        restore_adapters(model, run_dir / "ckpt" / f"step-{step}" / "adapters.safetensors",
                         "cpu")
    return model, tok


def solver_attempts(cfg: Config, model: Any, tok: Any, problems: list[dict[str, Any]],
                    seed: int, attempts: int) -> tuple[list[str], np.ndarray]:
    """``attempts`` sampled solver attempts per problem (texts, problem-major) and their
    verifier labels (bool[P, attempts])."""
    correct_fn = task_correct(cfg.task, cfg.task_config)
    prompts = Prompts(tok, cfg.max_prompt_tokens, _cache())
    sampling = cfg.sampling(cfg.solver_tokens, generate_dtype=cfg.generate_dtype)
    activate(model, "solver")
    torch.manual_seed(seed)
    count = Count(len(problems) * attempts, "attempts done")
    with heartbeat(f"solver attempts: {attempts} per problem on {len(problems)} problems",
                   count=count):
        sampled = generate(model, tok, [prompts("solver", p["question"]) for p in problems],
                           sampling, n_per_prompt=attempts, max_new=cfg.solver_tokens,
                           on_finished=count.add)
    texts = [tok.decode(c, skip_special_tokens=True) for c, _ in sampled]
    labels = [correct_fn(extract_answer(t)[0] or None, problems[i // attempts]) == 1.0
              for i, t in enumerate(texts)]
    return texts, np.array(labels, bool).reshape(len(problems), attempts)


def margins(cfg: Config, model: Any, tok: Any, problems: list[dict[str, Any]],
            pool: tuple[list[str], np.ndarray]) -> np.ndarray:
    """The critic's verdict margins ``L_correct - L_incorrect`` (float64[P, K]) on the attempt
    ``pool`` (:func:`solver_attempts`' output) of ``problems``."""
    texts, labels = pool
    k = labels.shape[1]
    prompts = Prompts(tok, cfg.max_prompt_tokens, _cache())
    c_prompts = [prompts("critic", f"Problem:\n{problems[i // k]['question']}\n\n"
                                   f"Solution:\n{t}") for i, t in enumerate(texts)]
    with heartbeat(f"critic verdicts on {len(c_prompts)} attempts"):
        lp = verdict_logprobs(model, tok, c_prompts,
                              cfg.packing(cfg.pack_tokens, cfg.train_dtype))
    return (lp[:, 0] - lp[:, 1]).reshape(labels.shape)


def evaluate_checkpoint(cfg: Config, model: Any, tok: Any, step: int,
                        problems: list[dict[str, Any]], pool: tuple[list[str], np.ndarray],
                        calibration: tuple[list[dict[str, Any]], tuple[list[str], np.ndarray]]
                        | None = None) -> dict[str, Any]:
    """Checkpoint ``step``'s greedy solver accuracy on ``problems`` and its critic's verdicts
    on the attempt ``pool`` (:func:`solver_attempts`' output: the same attempts for every
    checkpoint); with ``calibration`` (training problems and their attempt pool), the same
    verdict figures at the threshold :func:`youden_threshold` sets on them."""
    correct_fn = task_correct(cfg.task, cfg.task_config)
    prompts = Prompts(tok, cfg.max_prompt_tokens, _cache())
    sampling = cfg.sampling(cfg.solver_tokens, generate_dtype=cfg.generate_dtype)
    activate(model, "solver")
    count = Count(len(problems), "problems done")
    with heartbeat(f"step {step}: greedy solver on {len(problems)} held-out problems",
                   count=count):
        greedy = generate(model, tok, [prompts("solver", p["question"]) for p in problems],
                          sampling, n_per_prompt=1, greedy=True, max_new=cfg.solver_tokens,
                          on_finished=count.add)
    solved = [correct_fn(extract_answer(tok.decode(c, skip_special_tokens=True))[0] or None,
                         p) == 1.0 for (c, _), p in zip(greedy, problems, strict=True)]
    labels = pool[1]
    margin = margins(cfg, model, tok, problems, pool)
    pick = balanced_set(labels)
    p_idx, a_idx = pick[:, 0], pick[:, 1]
    out: dict[str, Any] = {"step": step,
                           "solver_accuracy": proportion(int(sum(solved)), len(problems))}
    # The reported critic figure (issue 49): its own verdict, the likelier continuation
    # (margin > 0), as balanced accuracy with its interval: on the first attempt of every
    # problem (distinct problems: independent items) and on the balanced set.
    raw = margin > 0.0
    out["critic_balanced_accuracy_raw"] = balanced_accuracy_ci(raw[:, 0], labels[:, 0])
    out["critic_balanced_accuracy_raw_balanced_set"] = balanced_accuracy_ci(
        raw[p_idx, a_idx], labels[p_idx, a_idx])
    thresholds = {"": 0.0}
    if calibration is not None:  # a secondary reading: a threshold set afterwards
        c_problems, c_pool = calibration
        out["calibration"] = youden_threshold(
            margins(cfg, model, tok, c_problems, c_pool).reshape(-1), c_pool[1].reshape(-1))
        thresholds["_calibrated"] = out["calibration"]["tau"]
    for tag, tau in thresholds.items():
        says = margin > tau
        out[f"critic_first_attempts{tag}"] = critic_figures(says[:, 0], labels[:, 0],
                                                            margin[:, 0])
        out[f"critic_balanced_set{tag}"] = critic_figures(
            says[p_idx, a_idx], labels[p_idx, a_idx], margin[p_idx, a_idx])
    return out


def _cache() -> Any:
    from rlbuffers.cache import ByteLRUCache

    return ByteLRUCache(16 << 20)


def proposer_windows(run_dir: Path, cfg: Config, window: int) -> dict[str, Any]:
    """Well-formed proposals over the first and the last ``window`` steps of metrics.jsonl
    (empty before the first step is committed)."""
    rows = metrics_rows(run_dir)
    if not rows:
        return {"steps": 0}
    per_step = cfg.seeds_per_step * cfg.proposer_samples

    def part(rs: list[dict[str, Any]]) -> dict[str, Any]:
        k = round(sum(r["proposals_valid"] * per_step for r in rs))
        return {**proportion(k, per_step * len(rs)), "steps": [rs[0]["step"], rs[-1]["step"]]}

    def counted(rs: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
        rs = [r for r in rs if key in r]  # rows of runs before issue 49 lack the counts
        if not rs:
            return None
        return {**proportion(sum(r[key] for r in rs), sum(r["proposals"] for r in rs)),
                "steps": [rs[0]["step"], rs[-1]["step"]]}

    out = {"first": part(rows[:window]), "last": part(rows[-window:]), "steps": len(rows)}
    for key, name in (("proposals_verified", "verified"), ("proposals_solvable", "solvable")):
        out[f"{name}_first"] = counted(rows[:window], key)
        out[f"{name}_last"] = counted(rows[-window:], key)
    return out


def check_args(a: argparse.Namespace) -> list[int]:
    """The checkpoints of ``--steps`` (ints); every flag checked before anything loads.

    Raises:
        trainers.config.ConfigError: ``--flag: expected ..., got ...`` (a checkpoint of
            ``--steps`` or ``--attempts-from`` that the run does not keep, too).
    """
    from trainers.config import MAX_THREADS, ConfigError, check_rules

    parts = a.steps.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--steps: expected comma-separated step numbers (0: the initial "
                          f"model), got {a.steps!r}")
    check_rules(a, {"eval_size": (a.eval_size >= 1, ">= 1"),
                    "critic_attempts": (a.critic_attempts >= 1, ">= 1"),
                    "calibration_size": (a.calibration_size >= 0, ">= 0"),
                    "window": (a.window >= 1, ">= 1"),
                    "threads": (1 <= a.threads <= MAX_THREADS, f"in [1, {MAX_THREADS}]")})
    steps = [int(p) for p in parts]
    for flag, step in [*(("--steps", s) for s in steps), ("--attempts-from", a.attempts_from)]:
        ckpt = a.run_dir / "ckpt" / f"step-{step}"
        if step and not (ckpt / "adapters.safetensors").is_file():
            raise ConfigError(f"{flag}: expected steps whose checkpoint the run keeps (0 or "
                              f"ckpt/step-N in {a.run_dir}), got {step} ({ckpt} is missing)")
    return steps


def main(argv: list[str] | None = None) -> None:
    from trainers.config import ArgumentParser

    ap = ArgumentParser(prog="python3 -m trainers.crsp.evaluate",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--steps", default="0", help="checkpoints, comma-separated (0: initial)")
    ap.add_argument("--eval-size", type=int, default=300, help="held-out problems")
    ap.add_argument("--eval-seed", type=int, default=None,
                    help="first seed of the held-out draws (default: the run's seed + "
                         f"{HELD_OUT_SEED})")
    ap.add_argument("--critic-attempts", type=int, default=4,
                    help="sampled solver attempts per held-out problem that the critic judges")
    ap.add_argument("--attempts-from", type=int, default=None,
                    help="the checkpoint whose solver writes the attempts every checkpoint's "
                         "critic judges (default: the last of --steps)")
    ap.add_argument("--calibration-size", type=int, default=100,
                    help="training seed problems whose attempts set each checkpoint's "
                         "calibrated verdict threshold (0: no calibrated figures)")
    ap.add_argument("--window", type=int, default=20, help="steps per proposer window")
    ap.add_argument("--threads", type=int, default=1,
                    help="ignored since issue 49: the evaluation runs on one thread "
                         f"(generation.EVAL_THREADS), so its figures do not depend on it")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (DIR/eval.json)")
    a = ap.parse_args(argv)
    cfg = Config(**saved_config(Config, a.run_dir / "config.json"))
    steps = check_args(a)
    if a.threads != EVAL_THREADS:
        print(f"--threads {a.threads}: ignored, the evaluation runs on {EVAL_THREADS} thread(s) "
              "so that its figures do not depend on the thread count", flush=True)
    torch.set_num_threads(EVAL_THREADS)  # sampled attempts and margins too, not only greedy
    seed = cfg.seed + HELD_OUT_SEED if a.eval_seed is None else a.eval_seed
    source = steps[-1] if a.attempts_from is None else a.attempts_from
    model, tok = load_checkpoint(cfg, a.run_dir, source)
    problems, report = evaluation_set(cfg, a.run_dir, tok, a.eval_size, seed)
    texts, labels = solver_attempts(cfg, model, tok, problems, seed, a.critic_attempts)
    calibration = None
    if a.calibration_size:  # training seeds: never a held-out problem
        seeds = training_seeds(cfg)
        pick = np.random.default_rng(seed).permutation(len(seeds))[:a.calibration_size]
        c_problems = [seeds[i] for i in sorted(pick)]
        calibration = (c_problems, solver_attempts(cfg, model, tok, c_problems, seed + 1,
                                                   a.critic_attempts))
    checkpoints = []
    for step in steps:
        m = model if step == source else load_checkpoint(cfg, a.run_dir, step)[0]
        checkpoints.append(evaluate_checkpoint(cfg, m, tok, step, problems, (texts, labels),
                                               calibration))
        del m
    out: dict[str, Any] = {
        "held_out": report, "overlap": report["overlap"],
        "proposer": proposer_windows(a.run_dir, cfg, a.window),
        "critic_attempts": {"from_step": source, "per_problem": a.critic_attempts,
                            "correct": proportion(int(labels.sum()), labels.size),
                            "balanced_set": len(balanced_set(labels))},
        "calibration_set": None if calibration is None else {
            "training_seeds": len(calibration[0]),
            "correct": proportion(int(calibration[1][1].sum()), calibration[1][1].size)},
        "checkpoints": checkpoints}
    write_atomic(a.out or a.run_dir / "eval.json", json_bytes(out))
    print(json_bytes(out).decode())


if __name__ == "__main__":  # a bad flag or run directory: one line (exit code 2)
    from trainers.config import run_main

    run_main("trainers.crsp.evaluate", "python3 -m trainers.crsp.evaluate", resumable=False)
