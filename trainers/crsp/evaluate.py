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
- the proposer on held-out data (``--proposer-eval-size``, :func:`proposer_figures`): from
  each of the first held-out problems one proposal, its stated answer verified, the verified
  ones attempted by the ``--attempts-from`` solver: verified and solvable rates;
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
from trainers.crsp.figures import (  # noqa: F401 - auc, youden_threshold: the module's API
    auc,
    balanced_accuracy,
    balanced_accuracy_ci,
    balanced_set,
    critic_figures,
    proportion,
    youden_threshold,
)
from trainers.crsp.formats import proposal_parts
from trainers.crsp.roles import ROLE_ID, Prompts, activate, make_model
from trainers.crsp.rollout import verdict_logprobs
from trainers.crsp.warmup import WARMUP_ADAPTERS
from trainers.llm.evaluation import HELD_OUT_SEED, held_out, task_correct
from trainers.llm.generation import EVAL_THREADS, generate
from trainers.llm.tasks import extract_answer, task_problems
from trainers.phases import Count, heartbeat
from trainers.summary import json_bytes

#: ``--steps``' name of the adapters saved after the format warm-up (``WARMUP_ADAPTERS``).
WARMUP = "warmup"


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


def adapters_file(run_dir: Path, step: int | str) -> Path | None:
    """The adapters of checkpoint ``step``: ``ckpt/step-N``'s, ``WARMUP`` (``"warmup"``) the
    ones saved right after the format warm-up, 0 none (the initial adapters)."""
    if step == WARMUP:
        return run_dir / WARMUP_ADAPTERS
    return run_dir / "ckpt" / f"step-{step}" / "adapters.safetensors" if step else None


def load_checkpoint(cfg: Config, run_dir: Path, step: int | str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` with the adapters of checkpoint ``step`` (0: initial,
    ``"warmup"``: after the format warm-up)."""
    from trainers.crsp.resume import restore_adapters

    model, tok, _ = make_model(cfg)
    path = adapters_file(run_dir, step)
    if path is not None:
        restore_adapters(model, path, "cpu")
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


def proposer_figures(cfg: Config, model: Any, solver: Any, tok: Any,
                     problems: list[dict[str, Any]], seed: int, attempts: int
                     ) -> dict[str, Any]:
    """The proposer of ``model`` writes one proposal from each held-out problem (sampled,
    torch seeded with ``seed``); the verifier confirms or not its stated answer
    (``verify.verified_entry``); the solver of ``solver`` (one checkpoint for every proposer:
    ``--attempts-from``) makes ``attempts`` sampled attempts at each verified one. Returns,
    over all proposals, ``well_formed``, ``verified``, ``solvable`` (verified, the answer
    reached at least once: the issue's ``proposer_solvable_rate``) and ``learnable`` (0 < p
    < 1), each with its Wilson interval."""
    from trainers.crsp.formats import STOP, cut_at_stop
    from trainers.crsp.verify import entry_score, verified_entry

    scorer = task_problems(cfg.task, 1, 0, cfg.task_config).score_answer
    prompts = Prompts(tok, cfg.max_prompt_tokens, _cache(),
                      verifiable=cfg.proposer_reward == "learnability")
    activate(model, "proposer")
    torch.manual_seed(seed)
    with heartbeat(f"proposer: one proposal from each of {len(problems)} held-out problems"):
        written = generate(model, tok, [prompts("proposer", "Problem:\n" + p["question"])
                                        for p in problems],
                           cfg.sampling(cfg.proposer_tokens, generate_dtype=cfg.generate_dtype),
                           n_per_prompt=1, max_new=cfg.proposer_tokens)
    parts = [proposal_parts(tok.decode(cut_at_stop(tok, c, STOP["proposer"])[0],
                                       skip_special_tokens=True)) for c, _ in written]
    entries = [verified_entry(q, a, scorer) if q and a else None for q, a in parts]
    checked = [e for e in entries if e is not None]
    rates = []
    if checked:
        texts, _ = solver_attempts(cfg, solver, tok, checked, seed + 1, attempts)
        hits = np.array([entry_score(scorer, extract_answer(t)[0], checked[i // attempts])
                         == 1.0 for i, t in enumerate(texts)]).reshape(len(checked), attempts)
        rates = hits.mean(1).tolist()
    n = len(problems)
    return {"n": n, "attempts": attempts,
            "well_formed": proportion(sum(q is not None and a is not None for q, a in parts), n),
            "verified": proportion(len(checked), n),
            "solvable": proportion(sum(r > 0 for r in rates), n),
            "learnable": proportion(sum(0 < r < 1 for r in rates), n)}


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


def check_args(a: argparse.Namespace) -> list[int | str]:
    """The checkpoints of ``--steps`` (step numbers, and ``"warmup"``); every flag checked
    before anything loads.

    Raises:
        trainers.config.ConfigError: ``--flag: expected ..., got ...`` (a checkpoint of
            ``--steps`` or ``--attempts-from`` that the run does not keep, too).
    """
    from trainers.config import MAX_THREADS, ConfigError, check_rules

    parts = [p.strip() for p in a.steps.split(",")]
    if not all(p.isdigit() or p == WARMUP for p in parts):
        raise ConfigError(f"--steps: expected comma-separated step numbers (0: the initial "
                          f"model; {WARMUP}: after the format warm-up), got {a.steps!r}")
    check_rules(a, {"eval_size": (a.eval_size >= 1, ">= 1"),
                    "critic_attempts": (a.critic_attempts >= 1, ">= 1"),
                    "calibration_size": (a.calibration_size >= 0, ">= 0"),
                    "proposer_eval_size": (a.proposer_eval_size >= 0, ">= 0"),
                    "window": (a.window >= 1, ">= 1"),
                    "threads": (1 <= a.threads <= MAX_THREADS, f"in [1, {MAX_THREADS}]")})
    steps: list[int | str] = [WARMUP if p == WARMUP else int(p) for p in parts]
    for flag, step in [*(("--steps", s) for s in steps), ("--attempts-from", a.attempts_from)]:
        path = adapters_file(a.run_dir, step)
        if path is not None and not path.is_file():
            raise ConfigError(f"{flag}: expected steps whose checkpoint the run keeps (0, "
                              f"ckpt/step-N or, after a warm-up, {WARMUP} in {a.run_dir}), "
                              f"got {step} ({path} is missing)")
    return steps


def main(argv: list[str] | None = None) -> None:
    from trainers.config import ArgumentParser

    ap = ArgumentParser(prog="python3 -m trainers.crsp.evaluate",
                        description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--steps", default="0",
                    help="checkpoints, comma-separated (0: initial; warmup: after the format "
                         "warm-up of --warmup-steps, before step 1)")
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
    ap.add_argument("--proposer-eval-size", type=int, default=100,
                    help="held-out problems the proposer writes from (one proposal each, "
                         "the first of the --eval-size ones), for its verified and solvable "
                         "rates (0: none)")
    ap.add_argument("--threads", type=int, default=1,
                    help="ignored since issue 49: the evaluation runs on one thread "
                         "(generation.EVAL_THREADS), so its figures do not depend on it")
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
        if a.proposer_eval_size:  # the same held-out seeds and solver for every proposer
            checkpoints[-1]["proposer"] = proposer_figures(
                cfg, m, model, tok, problems[:a.proposer_eval_size], seed + 2,
                a.critic_attempts)
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
