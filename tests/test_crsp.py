"""CRSP trainer (trainers/crsp/) on a tiny random Llama: the optimised path (shared base with
three adapters, reference = adapters off, roles one after another, shared-prefix packing,
chunked log-probs, micro-batches) and the naive path (a reference copy, full logits, all roles
at once, fixed padding) give the same losses, reference log-probs and gradients for a full
step of all three roles; a rollout of all roles on the tiny model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

from rlbuffers import ReplayBuffer  # noqa: E402
from rlbuffers.cache import ByteLRUCache  # noqa: E402
from rlbuffers.memory import AdaptiveMicroBatch, RunningMeanStd  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.crsp import fsdp, roles, rollout, train, update  # noqa: E402
from trainers.crsp.config import Config, check_config, longest_completion  # noqa: E402
from trainers.crsp.naive import naive_grads  # noqa: E402
from trainers.crsp.rewards import NoveltySketch  # noqa: E402
from trainers.crsp.roles import ROLES  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


def small_config(tiny_dir, **kw):
    return Config(model=str(tiny_dir), lora_rank=4, max_prompt_tokens=24, proposer_tokens=8,
                  solver_tokens=8, critic_tokens=20, pack_tokens=48, chunk_tokens=7,
                  memory_budget="none", beta=0.1, epsilon=0.2, **kw)


def random_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def synthetic_batches(vocab, seed=0):
    """Proposer: 2 prompts x 1; solver: 3 prompts x 3 attempts; critic: 4 prompts x 1, with
    a verdict term."""
    rng = np.random.default_rng(seed)
    out = {}
    for role, (n_prompts, g) in zip(ROLES, [(2, 1), (3, 3), (4, 1)], strict=True):
        b = rollout.RoleBatch()
        for _ in range(n_prompts):
            b.add(rng.integers(3, vocab, rng.integers(3, 20)),
                  [(rng.integers(3, vocab, rng.integers(1, 8)), False) for _ in range(g)])
        b.advantage = rng.normal(size=len(b.completions)).astype(np.float32)
        out[role] = b
    # The critic's verdict term: two continuations per prompt, the sampled verdict's leading
    # tokens left out of the loss (RoleBatch.training).
    c = out["critic"]
    c.verdict_options = [rng.integers(3, vocab, 3), rng.integers(3, vocab, 4)]
    c.verdict_advantage = rng.normal(size=(len(c.prompts), 2)).astype(np.float32)
    c.skip = [min(2, len(x)) for x in c.completions]
    c.verdict_coef = 0.7
    return out


def test_optimised_and_naive_paths_give_the_same_losses_and_gradients(tiny_dir):
    cfg = small_config(tiny_dir)
    opt_model, tok, none = roles.make_model(cfg)
    naive_cfg = dataclasses.replace(cfg, memory_opt=False)
    naive_model, _, reference = roles.make_model(naive_cfg)
    assert none is None and reference is not None
    for m in (opt_model, naive_model):
        random_adapters(m)
    batches = synthetic_batches(len(tok))
    amb = AdaptiveMicroBatch(opt_model, max_micro_batch=1)  # one packed row at a time
    grads = {}

    def keep(role):  # what the trainer's optimizer of this role would step on
        grads.update({n: p.grad.clone() for n, p in opt_model.named_parameters()
                      if p.grad is not None and f".{role}." in n})

    got = update.optimised_grads(opt_model, batches, cfg.packing(cfg.pack_tokens),
                                 cfg.policy_loss(), tok.pad_token_id, amb, keep)
    want = naive_grads(naive_model, reference, batches, naive_cfg.policy_loss(),
                       naive_cfg.temperature,
                       naive_cfg.max_prompt_tokens + longest_completion(naive_cfg),
                       tok.pad_token_id)
    assert set(got) == set(want) == set(ROLES)
    naive = {n: p.grad for n, p in naive_model.named_parameters() if p.grad is not None}
    assert set(grads) == set(naive) and len(grads) > 0
    for role in ROLES:
        torch.testing.assert_close(got[role]["ref"], want[role]["ref"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[role]["behaviour"], want[role]["behaviour"],
                                   rtol=1e-5, atol=1e-5)
        # AdaptiveMicroBatch's loss is the sum over rows of each row's share: the role's loss.
        assert got[role]["loss"] == pytest.approx(want[role]["loss"], rel=1e-4, abs=1e-6)
        role_names = [n for n in grads if f".{role}." in n]
        assert role_names
        for n in role_names:
            # fp32 sums in another order: 1e-5 of the tensor's largest entry (the verdict
            # term's sums over tokens make the critic's gradient entries ~1)
            atol = max(1e-6, 1e-5 * float(naive[n].abs().max()))
            torch.testing.assert_close(grads[n], naive[n], rtol=1e-4, atol=atol, msg=n)


def test_selective_checkpointing_from_the_profile_keeps_the_gradients(tiny_dir, caplog):
    cfg = small_config(tiny_dir)
    plain, tok, _ = roles.make_model(cfg)
    assert roles.set_checkpointing(plain, cfg, None)["layers"] == []  # off: none
    sel_cfg = dataclasses.replace(cfg, gradient_checkpointing="selective",
                                  checkpoint_layers="auto", activation_fraction=0.75)
    selective, _, _ = roles.make_model(sel_cfg)
    with caplog.at_level("INFO"):
        plan = roles.set_checkpointing(selective, sel_cfg, None)
    said = [r.getMessage() for r in caplog.records]
    # Issue 45: the profile is announced before it runs (GRPO sat 23 s silent in it)
    assert said.index("profiling each decoder layer's activations (one forward pass) to "
                      "choose the checkpointed layers...") < next(
        i for i, m in enumerate(said) if m.startswith("activation profile ("))
    layers = plan["profile"]["layers"]
    assert len(layers) == 2 and all(x["saved_bytes"] > 0 for x in layers)
    # One of the two identical layers is enough to keep <= 75% of the saved bytes.
    assert len(plan["layers"]) == 1 and plan["saving_bytes"] > 0
    grads = []
    for model in (plain, selective):
        random_adapters(model)
        keep = {}
        update.optimised_grads(model, synthetic_batches(len(tok)),
                               cfg.packing(cfg.pack_tokens), cfg.policy_loss(),
                               tok.pad_token_id, AdaptiveMicroBatch(model, max_micro_batch=1),
                             lambda role, m=model, k=keep: k.update(
                                 {n: p.grad.clone() for n, p in m.named_parameters()
                                  if p.grad is not None and f".{role}." in n}))
        grads.append(keep)
    assert set(grads[0]) == set(grads[1]) and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


def test_micro_batch_planned_from_the_measured_cost_and_the_budget(tiny_dir, monkeypatch):
    from rlbuffers.memory import MemoryBudgetError, StepCost

    cfg = small_config(tiny_dir, micro_batch_tokens=0, seeds_per_step=2, solver_samples=4)
    model, tok, _ = roles.make_model(cfg)
    packing = cfg.packing(cfg.pack_tokens)
    probed = []

    def probe(step, make_batch, sizes):  # runs the real steps, returns a known cost
        for n in sizes:
            batch = make_batch(n)
            assert batch["input_ids"].shape == (n, cfg.pack_tokens)
            step(batch)
            assert all(p.grad is None for p in model.parameters())  # zeroed after each
            probed.append(n)
        return StepCost(fixed_bytes=1000, bytes_per_item=300)

    monkeypatch.setattr(update, "probe_activation_bytes", probe)
    # Solver rows at these settings: 2 x 2 x 4 x (24 + 8) tokens / 48 per row = 11.
    assert update.plan_micro_batch_tokens(model, cfg, packing, tok.pad_token_id, 2000) == 3 * 48
    assert update.plan_micro_batch_tokens(model, cfg, packing, tok.pad_token_id,
                                          10**9) == 11 * 48
    with pytest.raises(MemoryBudgetError, match="does not fit one item"):
        update.plan_micro_batch_tokens(model, cfg, packing, tok.pad_token_id, 1200)
    assert probed == [1, 2] * 3


def test_seed_stream_shuffles_within_its_buffer_and_resumes_exactly():
    """Criterion 3.1: seeds come through rlbuffers.stream with a configurable shuffle buffer.
    Drawing 3 per step with the state saved and the stream rebuilt every step (as the trainer
    does) gives the uninterrupted order; every index appears once per pass; the buffer
    reorders the plain per-pass permutation, and only within blocks of its size."""
    n, k = 128, 3
    cfg = Config(seed=7, seed_shuffle_buffer=16)
    whole = list(itertools.islice(train.seed_stream(n, cfg.seed, cfg.seed_shuffle_buffer), 2 * n))
    state, resumed = {}, []
    while len(resumed) < 2 * n:
        stream = train.seed_stream(n, cfg.seed, cfg.seed_shuffle_buffer)
        if state:
            stream.load_state_dict(json.loads(json.dumps(state)))  # plain data
        resumed += list(itertools.islice(stream, k))
        state = stream.state_dict()
    assert resumed[:2 * n] == whole
    assert sorted(whole) == sorted(list(range(n)) * 2)
    plain = list(itertools.islice(train.seed_stream(n, 7, 0), 2 * n))
    assert whole != plain
    for b in range(0, 2 * n, 16):
        assert sorted(whole[b:b + 16]) == sorted(plain[b:b + 16])
    with pytest.raises(ValueError,
                       match=r"--seed-shuffle-buffer: expected in \[0, 2\*\*20\], got -1"):
        check_config(Config(seed_shuffle_buffer=-1))


def test_bad_checkpoint_layers_are_named():
    with pytest.raises(ValueError, match="--checkpoint-layers: expected 'auto' or comma-"):
        check_config(Config(checkpoint_layers="first"))
    with pytest.raises(ValueError, match="--activation-fraction: expected in \\[0, 1\\], got 2"):
        check_config(Config(activation_fraction=2.0))


def test_rollout_rewards_every_role(tiny_dir):
    cfg = small_config(tiny_dir, seeds_per_step=2, solver_samples=3, critiques_per_problem=2,
                       proposer_samples=1, critic_samples=1,  # no group: running statistics
                       critic_batch="first")  # a random model's attempts: one class
    model, tok, _ = roles.make_model(cfg)
    prompts = roles.Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(1 << 20))
    seeds = [{"question": "What is 2 + 3?", "answer": "5"},
             {"question": "What is 4 + 4?", "answer": "8"}]
    stats = {r: RunningMeanStd() for r in ROLES}
    torch.manual_seed(0)
    batches, metrics = rollout.rollout(cfg, model, tok, prompts, seeds,
                                    lambda a, e: float(a == e["answer"]), NoveltySketch(8, 16),
                                    stats, step=0)
    assert len(batches["proposer"].completions) == 2
    n_problems = len(batches["solver"].prompts)
    assert n_problems >= 2 and len(batches["solver"].completions) == 3 * n_problems
    assert len(batches["critic"].completions) == 2 * n_problems
    for role in ROLES:
        b = batches[role]
        assert b.reward.shape == b.advantage.shape == (len(b.completions),)
        assert stats[role].count == len(b.completions)
    assert metrics["alpha"] == cfg.alpha0
    cache = prompts.cache.stats()  # every distinct role prompt tokenized once, kept
    assert cache["entries"] == cache["misses"] >= 2 + n_problems and cache["evictions"] == 0


ARGS = ["--train-size", "20", "--seeds-per-step", "2", "--solver-samples", "2",
        "--critiques-per-problem", "1", "--max-prompt-tokens", "200", "--pack-tokens", "240",
        "--proposer-tokens", "10", "--solver-tokens", "8", "--critic-tokens", "20",
        "--proposer-length-target", "8", "--solver-length-target", "6",
        "--critic-length-target", "18", "--proposer-samples", "2", "--critic-samples", "2",
        "--lora-rank", "4", "--memory-budget", "none", "--generate-threads", "1",
        "--train-threads", "1", "--lr", "1e-2",
        "--task", "basic_arithmetic",
        # a random model's attempts are nearly all wrong: a balanced critic batch would be
        # empty, and these tests are about every role's update
        "--critic-batch", "first"]


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_tensor_summaries_by_flag_and_on_demand(tiny_dir, tmp_path, monkeypatch):
    base = [*ARGS, "--model", str(tiny_dir), "--steps", "2"]
    train.main([*base, "--run-dir", str(tmp_path / "a"), "--tensor-summary"])
    for r in rows(tmp_path / "a"):
        owners = {g["owner"] for g in r["tensors"]["groups"]}
        assert {"parameter", "optimizer_state"} <= owners and r["tensors"]["total_bytes"] > 0
    real_rollout = train.rollout

    def ask_in_step_2(*a, step):  # what `kill -USR1 PID` does while step 2 runs
        if step == 1:  # the rollout's step counts from 0
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_rollout(*a, step=step)

    monkeypatch.setattr(train, "rollout", ask_in_step_2)
    train.main([*base, "--run-dir", str(tmp_path / "b")])
    assert ["tensors" in r for r in rows(tmp_path / "b")] == [False, True]


def test_crash_between_checkpoint_and_commit_resumes_to_the_uninterrupted_run(
        tiny_dir, tmp_path, monkeypatch):
    base = [*ARGS, "--model", str(tiny_dir)]
    train.main([*base, "--run-dir", str(tmp_path / "a"), "--steps", "3"])
    want = rows(tmp_path / "a")
    assert len(want) == 3

    real_save = ReplayBuffer.save

    def crash_at_step_3(self, *a, **kw):  # step 3's checkpoint is written, not committed
        if kw.get("metadata", {}).get("trainer_step") == 3:
            raise KeyboardInterrupt
        return real_save(self, *a, **kw)

    monkeypatch.setattr(ReplayBuffer, "save", crash_at_step_3)
    with pytest.raises(SystemExit, match="step 2 is the last complete one"):
        train.main([*base, "--run-dir", str(tmp_path / "b"), "--steps", "3"])
    monkeypatch.setattr(ReplayBuffer, "save", real_save)
    train.main(["--run-dir", str(tmp_path / "b"), "--resume"])
    got = rows(tmp_path / "b")
    keys = ["step", "utterances", "alpha", "novelty", "seed_accuracy",
            *[f"{r}_{k}" for r in ROLES for k in ("reward", "loss", "kl")]]
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    buf = ReplayBuffer.open(tmp_path / "b" / "buffer", mode="r")
    assert len(buf) == sum(r["utterances"] for r in want)
    data = buf[np.arange(len(buf))]
    assert set(data["role"].tolist()) == {0, 1, 2}
    np.testing.assert_array_equal(np.unique(data["step"]), [1, 2, 3])
    buf.close()
    out = subprocess.run([sys.executable, "-m", "rlbuffers.cli", "inspect",
                          str(tmp_path / "b" / "buffer"), "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out)["size"] == len(data["role"])
    assert (tmp_path / "b" / "curve.png").stat().st_size > 0


def test_one_step_run_logs_the_memory_plan_and_each_phase(tiny_dir, tmp_path, capsys):
    """At the default log level a run prints its memory plan (budget, micro-batches,
    checkpointing, savings) and one line per step with each phase's seconds and peak; the
    plan's numbers are in the metrics row."""
    # The CPU's plan (--device auto would pick a GPU where one is present).
    train.main([*ARGS, "--model", str(tiny_dir), "--steps", "1", "--run-dir",
                str(tmp_path / "run"), "--gradient-checkpointing", "all", "--device", "cpu"])
    err = capsys.readouterr().err
    plan = next(line for line in err.splitlines() if "memory plan:" in line)
    assert "INFO trainers.crsp" in plan and "budget none" in plan
    assert "micro-batches of 512 tokens (rows of 240)" in plan
    assert "checkpointing all (layers [0, 1])" in plan and "shared reference saves" in plan
    assert "memory saved by shared_reference" in err
    step = next(line for line in err.splitlines() if "step 1: rollout" in line)
    assert all(f"{p} " in step and " s " in step for p in ("rollout", "update", "buffer"))
    # Issue 45: the update announces each role's part (it was silent 11 s on SmolLM2)
    lines = err.splitlines()
    start = lines.index("INFO trainers.phases: update (step 1)...")
    prefix = "INFO trainers.crsp.update: update: "
    roles_said = [line[len(prefix):].split(",")[0] for line in lines[start:]
                  if line.startswith(prefix)]
    assert roles_said == list(roles.ROLES), lines[start:start + 8]
    # one "<seconds> s <peak> MiB" per phase (on CUDA each is followed by "(cuda N MiB)")
    assert len(re.findall(r"\d+\.\d s [\d,]+ MiB", step)) == 3
    (row,) = rows(tmp_path / "run")
    assert row["micro_batch_tokens"] == 512 and row["checkpointed_layers"] == [0, 1]
    assert row["memory_budget_bytes"] is None and row["device"] == "cpu"
    assert row["saving_shared_reference_bytes"] > 0
    assert all(row[f"peak_rss_{p}_bytes"] > 0 for p in ("rollout", "update", "buffer"))


def test_no_memory_opt_places_the_reference_copy_by_the_plan(tiny_dir, tmp_path, monkeypatch):
    """``--no-memory-opt``: the reference copy goes through ``place_models`` as a frozen
    model for the training device (the CPU here) and the step trains from it."""
    calls = []
    real = train.place_models

    def record(modules, roles_, device, cpu_bytes):
        calls.append((sorted(modules), dict(roles_), device))
        return real(modules, roles_, device, cpu_bytes)

    monkeypatch.setattr(train, "place_models", record)
    train.main([*ARGS, "--model", str(tiny_dir), "--steps", "1", "--run-dir",
                str(tmp_path / "run"), "--no-memory-opt", "--device", "cpu"])
    assert calls == [(["reference"], {"reference": "frozen"}, torch.device("cpu"))]
    (row,) = rows(tmp_path / "run")
    assert row["reference_device"] == "cpu" and row["saving_shared_reference_bytes"] == 0
    assert all(np.isfinite(row[f"{r}_loss"]) for r in ROLES)


def test_reference_placement_plan_with_made_up_budgets(tiny_dir):
    """The plan ``place_models`` applies to the naive path's reference: on a CUDA device
    with room for it, the accelerator; without room, the CPU (budgets made up: no GPU)."""
    from rlbuffers.memory.placement import ModelSpec, plan_placement

    _, _, reference = roles.make_model(small_config(tiny_dir, memory_opt=False))
    spec = ModelSpec.from_module(reference, "frozen")
    size = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert spec.bytes == size and spec.role == "frozen"
    roomy = plan_placement({"reference": spec}, {"cpu": 10 * size, "cuda:0": 2 * size})
    assert roomy.device == {"reference": "cuda:0"}
    full = plan_placement({"reference": spec}, {"cpu": 10 * size, "cuda:0": size // 2})
    assert full.device == {"reference": "cpu"}


def test_process_group_backend_follows_the_device(monkeypatch):
    """NCCL only for CUDA tensors, gloo otherwise; ``init_distributed`` asks for the backend
    of its device, and under torchrun a CUDA ``--device`` becomes ``cuda:LOCAL_RANK``."""
    from trainers.llm.device import distributed_backend

    assert distributed_backend(torch.device("cpu")) == "gloo"
    assert distributed_backend(torch.device("cuda:1")) == "nccl"
    backends, current = [], []
    monkeypatch.setattr(torch.distributed, "init_process_group", backends.append)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert fsdp.init_distributed(torch.device("cpu")) == (1, 2)
    assert backends == ["gloo"] and current == []
    assert fsdp.init_distributed(torch.device("cuda:1")) == (1, 2)
    assert backends == ["gloo", "nccl"] and current == [torch.device("cuda:1")]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert fsdp.rank_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(fsdp, "resolve_device",
                        lambda spec: torch.device("cuda:0" if spec == "cuda" else spec))
    assert fsdp.rank_device("cuda") == torch.device("cuda:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("memory_opt", ["--memory-opt", "--no-memory-opt"])
def test_one_step_on_cuda(tiny_dir, tmp_path, memory_opt):
    """One step with ``--device cuda``: adapters, optimizer state and batches on the GPU,
    CUDA peaks per phase in the row, a checkpoint written and a resume continuing it."""
    base = [*ARGS, "--model", str(tiny_dir), "--device", "cuda", memory_opt]
    train.main([*base, "--steps", "1", "--run-dir", str(tmp_path / "run")])
    (row,) = rows(tmp_path / "run")
    assert row["device"] == "cuda:0" and row["cuda_peak_update_bytes"] > 0
    assert all(np.isfinite(row[f"{r}_loss"]) for r in ROLES)
    if memory_opt == "--no-memory-opt":
        assert row["reference_device"] == "cuda:0"
    train.main(["--run-dir", str(tmp_path / "run"), "--resume", "--steps", "2"])
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]
