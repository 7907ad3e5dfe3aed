"""``--agent-init`` (trainers/guidance/agent_init.py): a new guidance run's agent adapter starts
as the LoRA adapter of a tiny GRPO run's checkpoint, tensor for tensor, the guidance adapter as
without it; bad checkpoints (missing, another rank, full weights, other names, another
--lora-alpha) are refused naming the flag before a run directory exists; ``--resume`` restores
the run's own adapters and never reads the GRPO checkpoint again."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.test_grpo import ARGS as GRPO_ARGS  # noqa: E402
from tests.test_grpo import fake_scores  # noqa: E402
from tests.test_guidance import (  # noqa: E402
    _drop_log_handlers,  # noqa: E402, F401 (autouse)
    args,
    fake_score,
    make_tiny_bert,
)
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import (
    ConfigError,  # noqa: E402
    parse_config,  # noqa: E402
)
from trainers.grpo import train as grpo_train  # noqa: E402
from trainers.guidance import agent_init, train  # noqa: E402
from trainers.guidance.config import RESUMABLE, Config  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_lm_dir(d / "lm"), make_tiny_bert(d / "bert")


def grpo_run(tiny, run, monkeypatch_ctx, *extra):
    """A 2-step GRPO run on the tiny model (rewards vary, so its adapters move)."""
    monkeypatch_ctx.setattr(grpo_train, "score_group", fake_scores)
    grpo_train.main([*GRPO_ARGS, "--model", str(tiny[0]), "--run-dir", str(run), "--steps", "2",
                     *extra])
    return run / "ckpt" / "step-2"


@pytest.fixture(scope="module")
def grpo_ckpt(tiny, tmp_path_factory):
    """The last checkpoint of a LoRA (rank 4, the guidance tests' rank) GRPO run."""
    with pytest.MonkeyPatch.context() as mp:
        torch.set_num_threads(1)
        return grpo_run(tiny, tmp_path_factory.mktemp("grpo") / "lora", mp, "--lora-rank", "4")


def build(tiny, run_dir, *extra):
    cfg = parse_config(Config, args(tiny, run_dir, "--iterations", "1", *extra),
                       prog="g", description="", resumable=RESUMABLE)
    return train.build(cfg)


def adapter(learner, role):
    return {k: v.copy() for k, v in learner.policies.adapter_state(role).items()}


def test_agent_init_copies_the_grpo_adapter_exactly_and_leaves_guidance(tiny, grpo_ckpt,
                                                                       tmp_path):
    grpo = load_file(str(grpo_ckpt / "weights.safetensors"))
    plain = build(tiny, tmp_path / "plain")
    fresh_agent, fresh_guidance = adapter(plain, "agent"), adapter(plain, "guidance")
    plain.close()
    learner = build(tiny, tmp_path / "init", "--agent-init", str(grpo_ckpt))
    got_agent, got_guidance = adapter(learner, "agent"), adapter(learner, "guidance")
    info = learner.trainer["eval"]["agent_init"]
    learner.close()

    lora = {k.replace(".default.", "."): v for k, v in grpo.items() if "lora_" in k}
    assert len(lora) == len(grpo) == len(got_agent) == info["tensors"] > 0
    assert set(got_agent) == set(lora)
    for k, v in lora.items():
        np.testing.assert_array_equal(got_agent[k], v.numpy())
    # the GRPO run trained its adapters: the copy is not the fresh initialisation
    assert any(not np.array_equal(got_agent[k], fresh_agent[k]) for k in got_agent)
    assert set(got_guidance) == set(fresh_guidance)
    for k, v in fresh_guidance.items():
        np.testing.assert_array_equal(got_guidance[k], v)
    assert info["path"] == str((grpo_ckpt / "weights.safetensors").resolve())
    assert info["sha256"] == hashlib.sha256(
        (grpo_ckpt / "weights.safetensors").read_bytes()).hexdigest()
    assert info["grpo_config"] == {"model": str(tiny[0]), "lora_rank": 4, "lora_alpha": 32}


def lone_file(ckpt, d, rename=None):
    """The checkpoint's weights.safetensors alone in ``d`` (no GRPO config.json beside it),
    names changed by ``rename``."""
    d.mkdir()
    state = load_file(str(ckpt / "weights.safetensors"))
    if rename:
        state = {rename(k): v for k, v in state.items()}
    save_file(state, str(d / "weights.safetensors"))
    return d / "weights.safetensors"


def refused(tiny, run_dir, path, error, match, *extra):
    with pytest.raises(error, match=match):
        build(tiny, run_dir, "--agent-init", str(path), *extra)
    assert not run_dir.exists()  # refused before the run directory is made


def test_another_rank_is_refused_naming_the_flag(tiny, grpo_ckpt, tmp_path):
    refused(tiny, tmp_path / "r8", grpo_ckpt, ValueError,
            r"--agent-init: expected --lora-rank 8 .*got 4", "--lora-rank", "8")
    file = lone_file(grpo_ckpt, tmp_path / "lone")  # no config.json: the shapes tell
    refused(tiny, tmp_path / "r8b", file, ValueError,
            r"--agent-init: expected .*lora_A.weight of shape \(8, .*\(--lora-rank 8\), got "
            r"\(4, ", "--lora-rank", "8")


def test_other_alpha_missing_file_full_weights_and_other_names_are_refused(
        tiny, grpo_ckpt, tmp_path):
    refused(tiny, tmp_path / "a", grpo_ckpt, ValueError,
            r"--agent-init: expected --lora-alpha 16 .*got 32", "--lora-alpha", "16")
    refused(tiny, tmp_path / "m", tmp_path / "nowhere", ConfigError,  # one line on the console
            r"--agent-init: expected a GRPO checkpoint directory .*nowhere")
    half = lone_file(grpo_ckpt, tmp_path / "half",
                     rename=lambda k: k.replace("layers.0.", "layers.9."))
    refused(tiny, tmp_path / "n", half, ValueError,
            r"--agent-init: expected the agent adapter's \d+ LoRA tensors.*missing \['base_")
    with pytest.MonkeyPatch.context() as mp:
        full = grpo_run(tiny, tmp_path / "grpo_full", mp)  # --lora-rank 0: full fine-tuning
    refused(tiny, tmp_path / "f", lone_file(full, tmp_path / "full"), ValueError,
            r"--agent-init: expected a LoRA checkpoint .*full-weights")


@pytest.fixture(scope="module")
def guidance_run(tiny, grpo_ckpt, tmp_path_factory):
    """A 1-iteration guidance run whose agent started from the GRPO checkpoint (both the
    resume test and the staged-training test read it; neither changes its checkpoint)."""
    run = tmp_path_factory.mktemp("guidance") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "score", fake_score)
        train.main(args(tiny, run, "--iterations", "1", "--agent-init", str(grpo_ckpt)))
    return run


def test_resume_restores_its_own_adapters_without_reading_agent_init(tiny, grpo_ckpt,
                                                                     guidance_run, monkeypatch):
    run = guidance_run
    saved = load_file(str(run / "ckpt" / "iteration-1" / "agent.safetensors"))
    grpo = load_file(str(grpo_ckpt / "weights.safetensors"))
    assert any(not torch.equal(v, grpo[k.replace(".lora_A.", ".lora_A.default.")
                                        .replace(".lora_B.", ".lora_B.default.")])
               for k, v in saved.items())  # the iteration trained the agent

    def never(*a, **kw):
        raise AssertionError("--resume read --agent-init again")

    monkeypatch.setattr(train, "load_agent_init", never)
    cfg = parse_config(Config, ["--run-dir", str(run), "--resume", "--iterations", "2"],
                       prog="g", description="", resumable=RESUMABLE)
    assert cfg.agent_init == str(grpo_ckpt)  # kept from config.json
    learner = train.build(cfg)
    got = adapter(learner, "agent")
    assert learner.trainer["eval"]["agent_init"]["sha256"] == agent_init.sha256(
        grpo_ckpt / "weights.safetensors")  # the record survives in the checkpoint's state
    learner.close()
    assert set(got) == set(saved)
    for k, v in saved.items():
        np.testing.assert_array_equal(got[k], v.numpy())


def test_a_guidance_checkpoint_starts_the_agent_of_a_frozen_run(tiny, grpo_ckpt, guidance_run,
                                                               tmp_path):
    """Staged training: an agent that trained on two turns in one guidance run is the frozen
    agent of the next, tensor for tensor; the new run's guidance adapter starts fresh."""
    ckpt = guidance_run / "ckpt" / "iteration-1"
    saved = load_file(str(ckpt / "agent.safetensors"))
    grpo = load_file(str(grpo_ckpt / "weights.safetensors"))
    assert any(not torch.equal(v, grpo[k.replace(".lora_A.", ".lora_A.default.")
                                        .replace(".lora_B.", ".lora_B.default.")])
               for k, v in saved.items())  # the first run trained its agent

    plain = build(tiny, tmp_path / "plain")
    fresh_guidance = adapter(plain, "guidance")
    plain.close()
    learner = build(tiny, tmp_path / "frozen", "--agent-init", str(ckpt), "--freeze-agent")
    got_agent, got_guidance = adapter(learner, "agent"), adapter(learner, "guidance")
    info = learner.trainer["eval"]["agent_init"]
    learner.close()
    assert set(got_agent) == set(saved) and info["tensors"] == len(saved) > 0
    for k, v in saved.items():
        np.testing.assert_array_equal(got_agent[k], v.numpy())
    for k, v in fresh_guidance.items():
        np.testing.assert_array_equal(got_guidance[k], v)
    assert info["path"] == str((ckpt / "agent.safetensors").resolve())
    assert info["sha256"] == hashlib.sha256((ckpt / "agent.safetensors").read_bytes()).hexdigest()
    assert info["grpo_config"] == {"model": str(tiny[0]), "lora_rank": 4, "lora_alpha": 32}
    # the file itself is accepted too, and a guidance run of another rank is refused by name
    file_run = build(tiny, tmp_path / "file", "--agent-init", str(ckpt / "agent.safetensors"))
    from_file = adapter(file_run, "agent")
    file_run.close()
    for k, v in saved.items():
        np.testing.assert_array_equal(from_file[k], v.numpy())
    refused(tiny, tmp_path / "r8", ckpt, ValueError,
            r"--agent-init: expected --lora-rank 8 .*got 4", "--lora-rank", "8")
