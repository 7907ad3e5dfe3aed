"""Peak memory of one CRSP training step, optimised vs ``--no-memory-opt``: section ``crsp`` of
``docs/benchmarks.md``.

A training step here is the update of all three roles of ``trainers/crsp/`` on one step's
utterances: reference log-probs, the TR-RPG loss and its gradients, gradient clipping and the
AdamW step of each role (the rollout phase, generation, is the same code on both paths and is
left out). Both paths get the same utterances, built from real text so that their lengths are
those of a trainer step at its defaults with every proposal well formed (the largest step the
config allows): ``--seeds`` seed problems of reasoning-gym's ``gsm_symbolic``, one proposal
each (``proposer_tokens``), ``solver_samples`` attempts at every seed and proposed problem
(``solver_tokens``), ``critiques_per_problem`` critiques of each (``critic_tokens``); every
completion at its role's limit, its tokens taken from other problems' text.

Each run is a fresh subprocess (``--child opt|selective|naive``) that loads SmolLM2-135M-Instruct
(fp32) and reports: the RSS after loading (model, on the naive path its reference copy, the
adapters and optimizers), the peak RSS of the step (``PeakMemory``: the kernel's high-water
mark reset at the start of the step) and the step's seconds. Runs alternate (naive, opt,
naive, ...) so a slow spell of the shared machine falls on both; medians of ``--runs``.

What the naive path materialises (``naive_grads``): every sequence padded to the fixed length
``max_prompt_tokens + longest completion limit``, one prompt copy per completion; the
``[B, T, V]`` logits of all three roles with their temperature-scaled copy and log-softmax kept
alive for one backward of the roles' summed loss; a second full model as the reference policy
and its ``[B, T, V]`` logits. The optimised path: one base with three LoRA adapters (the
reference is the base with adapters disabled), shared-prefix packed rows, log-probs from
``token_logprobs`` in chunks of ``chunk_tokens``, one role's graph at a time in micro-batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

MIB = 2**20
ROLE_LIMITS = {"proposer": "proposer_tokens", "solver": "solver_tokens",
               "critic": "critic_tokens"}


def synthetic_batches(cfg: Any, tok: Any, n_seeds: int) -> dict[str, Any]:
    """The utterances of one step at the config's sizes (see the module docstring): real
    prompts rendered with each role's chat template, completions of real text at each role's
    limit, advantages from a seeded normal."""
    from rlbuffers.cache import ByteLRUCache
    from trainers.crsp.roles import ROLES, Prompts
    from trainers.crsp.rollout import RoleBatch
    from trainers.llm.tasks import task_problems

    problems = task_problems(cfg.task, 4 * n_seeds + 8, cfg.seed, cfg.task_config)
    questions = [problems[i]["question"] for i in range(len(problems))]
    text = np.asarray(tok("\n\n".join(questions[n_seeds:]), add_special_tokens=False)
                      ["input_ids"], np.int64)
    cursor = [0]

    def completion(limit: int) -> np.ndarray:
        start = cursor[0] % (len(text) - limit)
        cursor[0] += limit
        return text[start:start + limit]

    prompts = Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(cfg.prompt_cache_bytes))
    seeds = questions[:n_seeds]
    out = {r: RoleBatch() for r in ROLES}
    for q in seeds:
        out["proposer"].add(prompts("proposer", "Problem:\n" + q),
                            [(completion(cfg.proposer_tokens), True)
                             for _ in range(cfg.proposer_samples)])
    # Every proposal well formed: --proposer-samples proposed problems per seed.
    problems_text = seeds + [tok.decode(c) for c in out["proposer"].completions]
    for q in problems_text:
        comps = [completion(cfg.solver_tokens) for _ in range(cfg.solver_samples)]
        out["solver"].add(prompts("solver", q), [(c, True) for c in comps])
        for c in comps[:cfg.critiques_per_problem]:
            user = f"Problem:\n{q}\n\nSolution:\n{tok.decode(c)}"
            out["critic"].add(prompts("critic", user), [(completion(cfg.critic_tokens), True)
                                                        for _ in range(cfg.critic_samples)])
    rng = np.random.default_rng(cfg.seed)
    for b in out.values():
        b.advantage = rng.standard_normal(len(b.completions)).astype(np.float32)
    return out


def child(path: str, n_seeds: int, threads: int) -> None:
    import torch

    from rlbuffers.memory import AdaptiveMicroBatch, PeakMemory, auto_budget
    from rlbuffers.memory.process import peak_rss_bytes, rss_bytes
    from trainers.crsp.config import Config, longest_completion
    from trainers.crsp.naive import naive_grads
    from trainers.crsp.roles import ROLES, make_model, role_parameters, set_checkpointing
    from trainers.crsp.update import optimised_grads

    torch.set_num_threads(threads)
    cfg = Config(memory_opt=path != "naive", seeds_per_step=n_seeds, train_threads=threads,
                 gradient_checkpointing="selective" if path == "selective" else "off")
    model, tok, reference = make_model(cfg)
    plan = set_checkpointing(model, cfg, None)
    fixed = cfg.max_prompt_tokens + longest_completion(cfg)
    opts = {r: torch.optim.AdamW(role_parameters(model, r), lr=cfg.lr, weight_decay=0.0)
            for r in ROLES}
    batches = synthetic_batches(cfg, tok, n_seeds)

    def step_role(role: str) -> None:
        torch.nn.utils.clip_grad_norm_(role_parameters(model, role), cfg.max_grad_norm)
        opts[role].step()
        opts[role].zero_grad(set_to_none=True)

    amb = AdaptiveMicroBatch(model, budget_bytes=auto_budget(), grow_after=10,
                             max_tokens=cfg.micro_batch_tokens, tokens_key="real")
    load_rss, load_peak = rss_bytes(), peak_rss_bytes()
    t0 = time.perf_counter()
    with PeakMemory() as pm:
        if cfg.memory_opt:
            grads = optimised_grads(model, batches, cfg.packing(cfg.pack_tokens),
                                    cfg.policy_loss(), tok.pad_token_id, amb, step_role)
        else:
            grads = naive_grads(model, reference, batches, cfg.policy_loss(), cfg.temperature,
                                fixed, tok.pad_token_id)
            for role in grads:
                step_role(role)
    seconds = time.perf_counter() - t0
    rows = sum(len(b.completions) for b in batches.values())
    print("RESULT " + json.dumps({
        "load_rss_mib": load_rss / MIB, "load_peak_mib": load_peak / MIB,
        "step_peak_mib": pm.peak_rss_bytes / MIB, "step_extra_mib": pm.peak_extra_rss_bytes / MIB,
        "process_peak_mib": max(load_peak, pm.peak_rss_bytes) / MIB, "seconds": seconds,
        "completions": {r: len(b.completions) for r, b in batches.items()},
        "completion_tokens": int(sum(len(c) for b in batches.values() for c in b.completions)),
        "naive_logits_mib": rows * fixed * model.config.vocab_size * 4 / MIB,
        "vocab": model.config.vocab_size, "fixed_tokens": fixed,
        "checkpointed": plan["layers"],
        "checkpoint_saving_mib": plan.get("saving_bytes", 0) / MIB,
        "losses": {r: g["loss"] for r, g in grads.items()}}), flush=True)


def run_child(path: str, n_seeds: int, threads: int, limit_bytes: int) -> dict[str, Any]:
    """One step in a fresh process; stopped (``{"stopped_mib": ...}``) if its RSS, sampled
    every 20 ms, passes ``limit_bytes``."""
    from tools.bench.report import run_sampled

    cmd = [sys.executable, "-m", "tools.bench.bench_crsp", "--child", path,
           "--seeds", str(n_seeds), "--threads", str(threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    run = run_sampled(cmd, env, interval_s=0.02, limit_bytes=limit_bytes)
    if run.returncode is None:
        return {"stopped_mib": run.peak_rss_bytes / MIB}
    if run.returncode:
        raise RuntimeError(f"{path} child failed ({run.returncode}):\n{run.stderr[-3000:]}")
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


PATHS = {"opt": "optimised (default)",
         "selective": "optimised + `--gradient-checkpointing selective` (auto)",
         "naive": "`--no-memory-opt`"}
KEYS = ("load_rss_mib", "step_peak_mib", "step_extra_mib", "process_peak_mib", "seconds")


def bench_size(n_seeds: int, runs: int, threads: int, limit_bytes: int) -> str:
    from tools.bench.report import table

    res: dict[str, list[dict[str, Any]]] = {k: [] for k in PATHS}
    for _ in range(runs):
        for path in ("naive", "opt", "selective"):
            if path == "naive" and res["naive"] and "stopped_mib" in res["naive"][0]:
                continue  # over the limit once: not repeated
            res[path].append(run_child(path, n_seeds, threads, limit_bytes))
            print(n_seeds, path, json.dumps(res[path][-1]), flush=True)
    ok = {k: [r for r in v if "stopped_mib" not in r] for k, v in res.items()}
    med = {k: {m: statistics.median(r[m] for r in v) for m in KEYS} for k, v in ok.items() if v}
    first = ok["opt"][0]
    rows = []
    for k, name in PATHS.items():
        if k in med:
            m = med[k]
            rows.append([name, f"{m['load_rss_mib']:,.0f}", f"{m['step_peak_mib']:,.0f}",
                         f"{m['step_extra_mib']:,.0f}", f"{m['process_peak_mib']:,.0f}",
                         f"{m['seconds']:.1f}"])
        else:
            rows.append([name, "", f"> {limit_bytes / MIB:,.0f} (stopped at "
                         f"{res[k][0]['stopped_mib']:,.0f})", "", "", ""])
    o = med["opt"]
    text = (f"#### {n_seeds} seed problem(s) per step: {first['completions']} completions, "
            f"{first['completion_tokens']:,} completion tokens\n\n"
            + table(["path", "RSS after load MiB", "step peak RSS MiB", "step extra MiB",
                     "process peak MiB", "step s"], rows) + "\n\n")
    if "naive" in med:
        n = med["naive"]
        gap = max(abs(r["losses"][k] - ok["naive"][0]["losses"][k])
                  for r in ok["opt"] for k in r["losses"])
        ratio = n["step_peak_mib"] / o["step_peak_mib"]
        text += (f"Peak RSS of the step, naive / optimised: **{ratio:.2f}x** (target >= 3x); "
                 f"the memory the step adds over the loaded model: "
                 f"{n['step_extra_mib'] / o['step_extra_mib']:.1f}x; step time optimised / "
                 f"naive: {o['seconds'] / n['seconds']:.2f}x. Largest per-role loss difference "
                 f"between the paths: {gap:.1e}. ")
    else:
        text += (f"The naive path passed {limit_bytes / MIB:,.0f} MiB and was stopped (a "
                 f"first try without the limit was killed by the kernel's OOM killer on this "
                 f"24 GiB machine); the optimised step peaks at {o['step_peak_mib']:,.0f} MiB. ")
    if "selective" in med:
        sel = ok["selective"][0]
        text += (f"Selective checkpointing checkpointed layers {sel['checkpointed']} (the "
                 f"profile's choice for half the saved bytes; "
                 f"{sel['checkpoint_saving_mib']:,.0f} MiB less per micro-batch): step extra "
                 f"{med['selective']['step_extra_mib']:,.0f} vs {o['step_extra_mib']:,.0f} MiB,"
                 f" {med['selective']['seconds'] / o['seconds']:.2f}x the time. ")
    text += (f"The naive path's `[B, T, V]` logits are {first['naive_logits_mib']:,.0f} MiB "
             f"per copy (every row padded to {first['fixed_tokens']} tokens, "
             f"V={first['vocab']:,}), and it holds several: the scaled logits and their "
             f"log-softmax of all three roles for one backward, and the reference's.")
    return text


def warmup_effect(n_eval: int, steps: int, batch: int, threads: int) -> dict[str, Any]:
    """The format warm-up's effect (``--warmup-effect``): well-formed proposals (one sampled
    proposal for each of ``n_eval`` seed problems) and the critic's verdicts on ``n_eval``
    sampled solver attempts labelled by the verifier (says-correct rate, balanced accuracy),
    before and after ``steps`` warm-up steps of ``batch`` examples per role, on SmolLM2-135M
    at the real run's settings; Wilson intervals. Problems for the measurement are disjoint
    from the warm-up's (indices from 500 on)."""
    import tempfile
    from pathlib import Path

    import torch

    from rlbuffers.cache import ByteLRUCache
    from trainers.crsp.config import Config
    from trainers.crsp.evaluate import balanced_accuracy, proportion
    from trainers.crsp.formats import proposal_parts
    from trainers.crsp.roles import ROLES, Prompts, activate, make_model, role_parameters
    from trainers.crsp.rollout import verdict_logprobs
    from trainers.crsp.warmup import warm_up
    from trainers.llm.generation import generate
    from trainers.llm.tasks import extract_answer, task_problems

    torch.set_num_threads(threads)
    cfg = Config(task="basic_arithmetic", task_config=json.dumps(
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}),
        proposer_tokens=48, solver_tokens=32, critic_tokens=16, max_prompt_tokens=256,
        pack_tokens=304, generate_dtype="bfloat16", train_dtype="bfloat16", lr=3e-4,
        warmup_steps=steps, warmup_batch=batch, memory_budget="none")
    model, tok, _ = make_model(cfg)
    problems = task_problems(cfg.task, cfg.train_size, cfg.seed, cfg.task_config)
    prompts = Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(16 << 20))
    held = range(500, 500 + n_eval)

    def measure() -> dict[str, Any]:
        torch.manual_seed(0)
        sampling = cfg.sampling(48, generate_dtype=cfg.generate_dtype)
        activate(model, "proposer")
        props = generate(model, tok, [prompts("proposer", "Problem:\n" + problems[i]["question"])
                                      for i in held], sampling, n_per_prompt=1, max_new=48)
        valid = sum(all(x is not None for x in proposal_parts(tok.decode(
            c, skip_special_tokens=True))) for c, _ in props)
        activate(model, "solver")
        att = generate(model, tok, [prompts("solver", problems[i]["question"]) for i in held],
                       sampling, n_per_prompt=1, max_new=cfg.solver_tokens)
        texts = [tok.decode(c, skip_special_tokens=True) for c, _ in att]
        labels = np.array([bool(g) and problems.score_answer(g, problems[i]) == 1.0
                           for t, i in zip(texts, held, strict=True)
                           for g in [extract_answer(t)[0]]])
        lp = verdict_logprobs(model, tok, [prompts("critic", f"Problem:\n{problems[i]['question']}"
                                                   f"\n\nSolution:\n{t}")
                                           for t, i in zip(texts, held, strict=True)],
                              cfg.packing(cfg.pack_tokens, cfg.train_dtype))
        says = lp[:, 0] > lp[:, 1]
        return {"proposals_well_formed": proportion(int(valid), n_eval),
                "critic_says_correct": proportion(int(says.sum()), n_eval),
                "critic_accuracy": proportion(int((says == labels).sum()), n_eval),
                "critic_balanced_accuracy": balanced_accuracy(says, labels),
                "attempts_correct": proportion(int(labels.sum()), n_eval)}

    before = measure()
    opts = {r: torch.optim.AdamW(role_parameters(model, r), lr=cfg.lr) for r in ROLES}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        losses = warm_up(cfg, model, tok, prompts, opts, problems, problems.score_answer,
                         Path(d))
    seconds = time.perf_counter() - t0
    return {"before": before, "after": measure(), "warmup": losses,
            "warmup_seconds": seconds, "steps": steps, "batch": batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seeds", default="1,2", help="comma-separated seed problems per step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit-gib", type=float, default=16.0,
                   help="stop a child whose RSS passes this (the seed's 16 GB CPU box)")
    p.add_argument("--child", choices=list(PATHS), help="internal: run one path")
    p.add_argument("--warmup-effect", type=int, default=0, metavar="N",
                   help="measure the format warm-up on N held-out problems instead")
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--warmup-batch", type=int, default=4)
    a = p.parse_args()
    if a.warmup_effect:
        print(json.dumps(warmup_effect(a.warmup_effect, a.warmup_steps, a.warmup_batch,
                                       a.threads), indent=1))
        return
    if a.child:
        child(a.child, int(a.seeds), a.threads)
        return
    from tools.bench.report import stamp, write_section
    from trainers.crsp.config import Config

    cfg = Config()
    parts = [bench_size(int(n), a.runs, a.threads, int(a.limit_gib * 2**30))
             for n in a.seeds.split(",")]
    body = (f"### One CRSP training step (update of all three roles), SmolLM2-135M fp32\n\n"
            f"{stamp()} Every proposal well formed, each completion at its role's limit "
            f"({cfg.proposer_tokens} / {cfg.solver_tokens} / {cfg.critic_tokens} tokens), "
            f"{cfg.solver_samples} solver attempts per problem, {cfg.critiques_per_problem} "
            f"critiques per problem, prompts up to {cfg.max_prompt_tokens} tokens, LoRA "
            f"r={cfg.lora_rank} per role, {a.threads} threads; medians of {a.runs} fresh "
            f"processes per path (runs alternate). `tools/bench/bench_crsp.py` says what each "
            f"path materialises.\n\n" + "\n\n".join(parts))
    print(body)
    write_section("crsp", body)


if __name__ == "__main__":
    main()
