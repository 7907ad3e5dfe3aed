"""GRPO (trainers/grpo/) placement and logging: which device the policy, its batches and the
reference weights go to (checked on CPU with made-up budgets and spies), the memory plan and
per-phase line that a default run prints, and a CUDA smoke run (only where CUDA is)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from rlbuffers.memory.placement import ModelSpec, plan_placement  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.grpo import policy, train  # noqa: E402
from trainers.grpo.config import Config  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ARGS = ["--task", "basic_arithmetic", "--train-size", "40", "--prompts-per-step", "2",
        "--group-size", "3", "--max-completion-tokens", "12", "--max-prompt-tokens", "120",
        "--pack-tokens", "200", "--memory-budget", "none", "--train-threads", "1",
        "--no-evaluate", "--steps", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


def fake_scores(problems, indices, texts, group_size, format_reward, partial_credit=False):
    """Deterministic rewards that vary within groups (the tiny model never answers right)."""
    r = np.array([(sum(map(ord, t)) % 7) / 6 for t in texts], np.float32)
    return {"correctness": (r > 0.5).astype(np.float32), "formatted": np.zeros(len(r), bool),
            "reward": r}


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_plan_puts_the_policy_on_the_accelerator_when_it_fits(tiny_dir):
    """The trainer's models and roles through plan_placement with made-up budgets: the
    trained policy (weights + gradients + AdamW state) goes to a "cuda:0" with room, to the
    CPU when the accelerator is short, and nowhere when neither has room."""
    model, _, _ = policy.make_policy(Config(model=str(tiny_dir)))
    specs = {name: ModelSpec.from_module(model, role) for name, role in policy.ROLES.items()}
    need = specs["policy"].bytes
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert policy.ROLES == {"policy": "trained"} and need >= 4 * weights  # + grads + 2 moments
    assert plan_placement(specs, {"cpu": 10 * need, "cuda:0": need}).device == \
        {"policy": "cuda:0"}
    assert plan_placement(specs, {"cpu": 10 * need, "cuda:0": need - 1}).device == \
        {"policy": "cpu"}
    assert plan_placement(specs, {"cpu": need - 1, "cuda:0": need - 1}).unplaced == ["policy"]


def test_place_policy_passes_the_trained_role_and_keeps_a_cpu_run_on_the_cpu(tiny_dir,
                                                                             monkeypatch):
    calls = []
    real = policy.place_models

    def spy(modules, roles, device, cpu_bytes):
        calls.append((set(modules), dict(roles), device, cpu_bytes))
        return real(modules, roles, device, cpu_bytes)

    monkeypatch.setattr(policy, "place_models", spy)
    model, _, _ = policy.make_policy(Config(model=str(tiny_dir), lora_rank=4))
    placed, plan = policy.place_policy(model, torch.device("cpu"))
    assert calls == [({"policy"}, {"policy": "trained"}, torch.device("cpu"), calls[0][3])]
    assert calls[0][3] > 0 and plan.device == {"policy": "cpu"}
    assert placed is model and all(p.device.type == "cpu" for p in placed.parameters())


@pytest.mark.parametrize("lora", [0, 4])
def test_the_trainer_moves_batches_to_the_device_and_passes_the_reference(tiny_dir, tmp_path,
                                                                          monkeypatch, lora):
    """A one-step run: every packed batch goes to the resolved device (``--device cpu``);
    the reference log-probs read run_dir/reference.pt in full fine-tuning and use the
    adapters-disabled policy (None) with LoRA."""
    moved, references = [], []
    real_to, real_ref = train.to_device, train.packed_reference_logprobs
    monkeypatch.setattr(train, "to_device",
                        lambda batch, device: moved.append(device) or real_to(batch, device))

    def ref_spy(model, batch, packing, reference, n_tokens=0):
        references.append(reference)
        assert batch["input_ids"].device == next(model.parameters()).device
        return real_ref(model, batch, packing, reference, n_tokens)

    monkeypatch.setattr(train, "packed_reference_logprobs", ref_spy)
    run = tmp_path / "run"
    train.main([*ARGS, "--model", str(tiny_dir), "--run-dir", str(run), "--device", "cpu",
                "--lora-rank", str(lora)])
    assert moved == [torch.device("cpu")]
    assert references == [None if lora else run / "reference.pt"]
    assert (run / "reference.pt").exists() is (not lora)
    assert len(rows(run)) == 1


def test_a_default_run_logs_its_memory_plan_and_per_phase_peaks(tiny_dir, tmp_path):
    """At the default log level (INFO) a one-step run prints the placement plan, the memory
    plan (budget, checkpointing, micro-batches, capacity) and the step's per-phase seconds
    and peaks; the plan's numbers are in the metrics row."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "trainers.grpo", *ARGS, "--model",
                          str(tiny_dir), "--run-dir", str(run), "--device", "cpu",
                          "--gradient-checkpointing", "all"],
                         capture_output=True, text=True, check=True)
    err = out.stderr
    assert "placement plan" in err and "policy" in err
    plan = next(line for line in err.splitlines() if "memory plan:" in line)
    assert "budget none on cpu" in plan and "gradient checkpointing all (2 layers)" in plan
    assert "micro-batches of up to 512 tokens" in plan and "capacity 1536 completions" in plan
    step = next(line for line in err.splitlines() if "step 1: " in line)
    for phase in ("generate", "score", "reference", "save_wait", "update", "buffer"):
        assert f"{phase} " in step
    assert step.count(" MiB") == 6
    row = rows(run)[0]
    assert row["memory_budget_bytes"] is None and row["checkpointed_layers"] == 2
    assert row["policy_bytes"] > 0 and row["peak_rss_update_bytes"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lora", [0, 4])
def test_one_step_on_cuda_then_resume(tiny_dir, tmp_path, monkeypatch, lora):
    """On CUDA: a step (full fine-tuning reads reference.pt onto the GPU; LoRA disables its
    adapters) records CUDA peaks per phase and matches a second run's first step (up to CUDA's
    non-deterministic summation order), and a resumed second step loads the checkpoint back
    onto the GPU and trains on."""
    monkeypatch.setattr(train, "score_group", fake_scores)
    args = [*ARGS, "--device", "cuda", "--model", str(tiny_dir), "--lora-rank", str(lora),
            "--train-dtype", "bfloat16"]
    train.main([*args, "--run-dir", str(tmp_path / "straight"), "--steps", "2"])
    run = tmp_path / "run"
    train.main([*args, "--run-dir", str(run)])
    train.main(["--run-dir", str(run), "--resume", "--steps", "2"])
    got, want = rows(run), rows(tmp_path / "straight")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert r["cuda_peak_update_bytes"] > 0 and np.isfinite(r["loss"])
        assert r["kl"] >= 0 and r["grad_norm"] > 0 and r["policy_bytes"] > 0
    assert got[0]["completion_tokens"] == want[0]["completion_tokens"]
    assert got[0]["reward_mean"] == want[0]["reward_mean"]
    for key in ("loss", "grad_norm"):
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-3, abs=1e-6)
    if not lora:
        assert got[0]["cuda_peak_reference_bytes"] > 0
