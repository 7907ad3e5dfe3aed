"""The critic's verdict term (trainers/crsp/verdict.py): its per-continuation advantages are
minus the gradient of the loss it names (likelihood: the class-balanced log-likelihood of the
verifier's label; expected: the expected balanced reward), against a torch autograd reference;
on the tiny model the update's adapter gradients equal the autograd gradient of that loss
computed from full logits; a rollout in each mode trains the verdict through the term (the
sampled verdict's tokens out of the loss) or through the sampled tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "datasketch")

from rlbuffers.cache import ByteLRUCache  # noqa: E402
from rlbuffers.memory import AdaptiveMicroBatch, RunningMeanStd  # noqa: E402
from tests.test_crsp_selfplay import config, scripted_generate  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.crsp import roles, rollout, update  # noqa: E402
from trainers.crsp.rewards import NoveltySketch, alpha_schedule  # noqa: E402
from trainers.crsp.roles import ROLES  # noqa: E402
from trainers.crsp.verdict import verdict_advantages, verdict_loss  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_lm_dir(tmp_path_factory.mktemp("tiny"))


def torch_loss(lp: torch.Tensor, truth: torch.Tensor, rate: float, mode: str) -> torch.Tensor:
    """The naive reference: per attempt, -w_y log softmax(L)_y or -sum_v softmax(L)_v R_v."""
    w = torch.where(truth, torch.tensor(0.5 / rate, dtype=torch.float64),
                    torch.tensor(0.5 / (1 - rate), dtype=torch.float64))
    log_p = torch.log_softmax(lp, 1)
    if mode == "likelihood":
        return -w * torch.where(truth, log_p[:, 0], log_p[:, 1])
    rewards = torch.stack([torch.where(truth, w, -w), torch.where(truth, -w, w)], 1)
    return -(log_p.exp() * rewards).sum(1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0), st.booleans()),
                min_size=1, max_size=12),
       st.floats(0.02, 0.98), st.sampled_from(["likelihood", "expected"]))
def test_advantages_are_minus_the_gradient_of_the_named_loss(rows, rate, mode):
    lp = np.array([[a, b] for a, b, _ in rows])
    truth = np.array([y for _, _, y in rows])
    t = torch.tensor(lp, requires_grad=True)
    loss = torch_loss(t, torch.tensor(truth), rate, mode)
    loss.sum().backward()
    np.testing.assert_allclose(verdict_loss(lp, truth, rate, mode), loss.detach().numpy(),
                               rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(verdict_advantages(lp, truth, rate, mode),
                               -t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_likelihood_keeps_pushing_a_confidently_wrong_critic():
    """At p(correct) = 0.03 on a correct attempt the expected-reward gradient has shrunk with
    p_c p_i; the likelihood's has not (the reason for the default)."""
    lp = np.array([[np.log(0.03), np.log(0.97)]])
    like = verdict_advantages(lp, np.array([True]), 0.2, "likelihood")[0, 0]
    exp = verdict_advantages(lp, np.array([True]), 0.2, "expected")[0, 0]
    assert like == pytest.approx(2.5 * 0.97, rel=1e-5)  # w_1 (1 - p_c)
    assert exp == pytest.approx(2 * 2.5 * 0.03 * 0.97, rel=1e-5)  # (R_c - R_i) p_c p_i
    assert like > 15 * exp > 0


def test_bad_mode_rate_and_shapes_are_named():
    lp, y = np.zeros((2, 2)), np.array([True, False])
    with pytest.raises(ValueError, match="mode: expected"):
        verdict_advantages(lp, y, 0.5, "sampled")
    with pytest.raises(ValueError, match="rate: expected"):
        verdict_advantages(lp, y, 1.0, "likelihood")
    with pytest.raises(ValueError, match="logprobs / truth"):
        verdict_advantages(np.zeros((2, 3)), y, 0.5, "likelihood")


@pytest.mark.parametrize("mode", ["likelihood", "expected"])
def test_update_gradient_equals_autograd_of_the_verdict_loss(tiny_dir, mode):
    """The critic's verdict term through the packed update (its two continuations added to
    the batch with the term's advantages, sampled completions weighted 0) gives the adapter
    gradient of coef * mean_j loss_j, with L from full logits of prompt + continuation."""
    cfg = dataclasses.replace(config(tiny_dir), beta=0.0)
    model, tok, _ = roles.make_model(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in sorted(model.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    rng = np.random.default_rng(0)
    options = rollout.verdict_ids(tok)
    b = rollout.RoleBatch()
    for _ in range(3):
        b.add(rng.integers(3, len(tok), 12), [(rng.integers(3, len(tok), 5), False)] * 2)
    b.advantage = np.zeros(6, np.float32)
    b.skip = [2] * 6
    packing = cfg.packing(cfg.pack_tokens)
    lp = rollout.verdict_logprobs(model, tok, b.prompts, packing)
    truth, rate, coef = np.array([True, False, False]), 0.3, 0.8
    b.verdict_options = [options[True], options[False]]
    b.verdict_advantage = verdict_advantages(lp, truth, rate, mode)
    b.verdict_coef = coef
    roles.activate(model, "critic")
    batch = update.role_tensors(b, packing, tok.pad_token_id)
    update.role_gradients(model, AdaptiveMicroBatch(model, max_micro_batch=1), batch, packing,
                          cfg.policy_loss(), b.training_tokens())
    params = roles.role_parameters(model, "critic")
    got = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    sums = []
    for prompt in b.prompts:
        row = []
        for o in b.verdict_options:
            ids = torch.from_numpy(np.concatenate([prompt, o]))[None]
            logits = model(input_ids=ids).logits.float()[0, :-1] / cfg.temperature
            tok_lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            row.append(tok_lp[len(prompt) - 1:].sum())
        sums.append(torch.stack(row))
    L = torch.stack(sums).double()
    np.testing.assert_allclose(L.detach().numpy(), lp, rtol=1e-4, atol=1e-4)
    (coef * torch_loss(L, torch.tensor(truth), rate, mode).mean()).backward()
    want = [p.grad for p in params]
    assert any(w.abs().max() > 0 for w in want)
    scale = max(float(w.abs().max()) for w in want)
    for a, w in zip(got, want, strict=True):  # fp32 packed + chunked vs full logits
        torch.testing.assert_close(a, w.float(), rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("mode", ["likelihood", "sampled"])
def test_rollout_trains_the_verdict_by_its_mode(tiny_dir, monkeypatch, mode):
    cfg = config(tiny_dir, seeds_per_step=1, proposer_samples=4, solver_samples=4,
                 critiques_per_problem=2, critic_samples=4, verdict_loss=mode)
    model, tok, _ = roles.make_model(cfg)
    monkeypatch.setattr(rollout, "generate", scripted_generate(tok))
    prompts = roles.Prompts(tok, cfg.max_prompt_tokens, ByteLRUCache(1 << 20))
    torch.manual_seed(0)
    batches, metrics = rollout.rollout(
        cfg, model, tok, prompts, [{"question": "What is 2 + 3?", "answer": "5"}],
        lambda a, e: float(a == e["answer"]), NoveltySketch(8, 16),
        {r: RunningMeanStd() for r in ROLES}, alpha_schedule(cfg.alpha0, cfg.alpha_decay),
        step=0)
    c = batches["critic"]
    n = len(c.completions)
    prompts_, groups, adv, weight = c.training()
    assert 0 <= metrics["critic_p_correct"] <= 1
    if mode == "sampled":  # the verdict's tokens carry the balanced reward, no extra term
        assert len(groups) == len(c.prompts) and not c.skip
        assert metrics["critic_verdict_loss"] is None
        return
    assert c.verdict_advantage.shape == (len(c.prompts), 2)
    np.testing.assert_allclose(c.verdict_advantage.sum(1), 0.0, atol=1e-6)
    assert len(groups) == 2 * len(c.prompts) and prompts_[len(c.prompts):] == c.prompts
    for comp, s, w in zip(c.completions, c.skip, weight[:n], strict=True):
        assert tok.decode(comp[:s]) in ("correct</verdict>", "incorrect</verdict>")
        assert (w[:s] == 0).all() and (w[s:] > 0).all()
    # The reason's advantage comes from its own rewards (format, length), centred per group.
    reason = np.asarray(c.parts["format"]) * cfg.format_weight + metrics["alpha"] * np.asarray(
        c.parts["length"])
    groups_r = reason.reshape(-1, cfg.critic_samples)
    flat = groups_r.std(1) == 0
    np.testing.assert_allclose(c.advantage.reshape(-1, cfg.critic_samples)[flat], 0.0)
    np.testing.assert_allclose(c.advantage.reshape(-1, cfg.critic_samples).sum(1), 0.0,
                               atol=1e-5)
    assert metrics["critic_verdict_loss"] > 0
