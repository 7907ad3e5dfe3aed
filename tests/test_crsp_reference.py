"""CRSP's proposer reference after the format warm-up (``--proposer-reference warmup``, the
default): the KL term of the proposer is taken against its adapter as the warm-up left it,
swapped in for the reference pass and swapped out bit for bit; at step 1 (nothing trained since
the warm-up) the proposer's KL is 0 where the base reference gives a clear distance; a resumed
run reads the same reference back; the naive path and older runs keep the base."""

from __future__ import annotations

import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

from tests.test_crsp import ARGS, rows  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.crsp import roles, train  # noqa: E402
from trainers.crsp.config import Config, check_config, legacy_settings  # noqa: E402
from trainers.crsp.update import adapters_swapped  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


def lora(model, role):
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if f".{role}." in n and "lora_" in n}


def test_swapped_adapters_hold_the_reference_inside_and_come_back_bit_for_bit(tiny_dir):
    cfg = Config(model=str(tiny_dir), lora_rank=4, memory_budget="none")
    model, _, _ = roles.make_model(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    reference = {n: torch.randn(v.shape, generator=gen) for n, v in lora(model, "proposer").items()}
    assert reference
    with adapters_swapped(model, reference):
        now = dict(model.named_parameters())
        for n, v in reference.items():
            assert torch.equal(now[n].detach(), v)
        for n in before.keys() - reference.keys():  # the other roles and the base untouched
            assert torch.equal(now[n].detach(), before[n])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    with pytest.raises(RuntimeError, match="inside"), adapters_swapped(model, reference):
        raise RuntimeError("inside")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    with adapters_swapped(model, None), adapters_swapped(model, {}):
        pass
    with pytest.raises(KeyError, match="no parameter 'nope'"), adapters_swapped(
            model, {"nope": torch.zeros(1)}):
        pass


def test_the_proposer_kl_is_taken_against_its_warmed_up_adapter(tiny_dir, tmp_path):
    base = [*ARGS, "--model", str(tiny_dir), "--warmup-steps", "3", "--warmup-batch", "2",
            "--beta", "0.04"]
    train.main([*base, "--run-dir", str(tmp_path / "w"), "--steps", "2"])
    train.main([*base, "--run-dir", str(tmp_path / "b"), "--steps", "2",
                "--proposer-reference", "base"])
    warm, old = rows(tmp_path / "w"), rows(tmp_path / "b")
    # Step 1: the proposer is exactly its warmed-up adapter (nothing stepped since), so its
    # KL to the warm-up is 0 (up to the two passes' batching), while the base is far away.
    assert abs(warm[0]["proposer_kl"]) < 1e-5
    assert old[0]["proposer_kl"] > 1e-3
    # The solver and the critic keep the base reference: the same KL either way at step 1.
    for role in ("solver", "critic"):
        assert warm[0][f"{role}_kl"] == old[0][f"{role}_kl"]
    # A resumed run reads the same reference back from DIR/warmup/adapters.safetensors.
    train.main([*base, "--run-dir", str(tmp_path / "r"), "--steps", "1"])
    train.main(["--run-dir", str(tmp_path / "r"), "--resume", "--steps", "2"])
    keys = ["proposer_kl", "proposer_loss", "solver_kl", "critic_kl"]
    assert [[r[k] for k in keys] for r in rows(tmp_path / "r")] == \
        [[r[k] for k in keys] for r in warm]


def test_the_setting_is_checked_and_older_runs_keep_the_base():
    check_config(Config(proposer_reference="warmup", memory_opt=False))  # no warm-up: base
    check_config(Config(proposer_reference="base", memory_opt=False, warmup_steps=2))
    with pytest.raises(ValueError, match="--proposer-reference: expected one of warmup, base "
                                         r"\('warmup' with --warmup-steps needs the "
                                         "memory-optimised update"):
        check_config(Config(proposer_reference="warmup", memory_opt=False, warmup_steps=2))
    with pytest.raises(ValueError, match="--proposer-reference: expected one of warmup, base"):
        check_config(Config(proposer_reference="sft"))
    cfg = Config()
    assert "--proposer-reference base" in legacy_settings(cfg, {"steps": 3})
    assert cfg.proposer_reference == "base"
