"""Truncated importance sampling of stale groups (``--is-truncation``, issue 48):
``trainers.llm.policy_loss.accumulate_gradients(is_truncation=C)`` against a naive torch
reference over each prompt + completion alone with full logits (values of the statistics and
gradients), and C = 0 computing exactly the loss without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.heavy import require

require("transformers")

from rlbuffers.memory import AdaptiveMicroBatch  # noqa: E402
from trainers.llm.packed_logprobs import packed_batch  # noqa: E402
from trainers.llm.policy_loss import accumulate_gradients, token_weights  # noqa: E402
from trainers.llm.settings import Packing, PolicyLoss  # noqa: E402

PACK = Packing(pack_tokens=16, chunk_tokens=3)
LOSS = PolicyLoss(epsilon=0.1, epsilon_high=0.3, beta=0.1)


@pytest.fixture
def model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=50,
                                        max_position_embeddings=128))


def rollouts(seed=0, n_groups=3, g=3, vocab=50):
    """Groups of ``g`` completions after a prompt, their advantages and per-token stored
    log-probs: ``old`` (the ratio's denominator), ``gen`` (the generating weights': around
    ``old``, so some ratios pass C = 1.2 and some do not) and ``ref``."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(2, 7)) for _ in range(n_groups)]
    groups = [[rng.integers(3, vocab, rng.integers(1, 6)) for _ in range(g)]
              for _ in range(n_groups)]
    lens = [len(c) for grp in groups for c in grp]
    adv = rng.normal(size=len(lens)).astype(np.float32)
    old = [rng.normal(-4, 0.3, k).astype(np.float32) for k in lens]
    gen = [(o + rng.normal(0, 0.4, len(o))).astype(np.float32) for o in old]
    ref = [rng.normal(-4, 0.3, k).astype(np.float32) for k in lens]
    return prompts, groups, lens, adv, old, gen, ref


def naive_logprobs(model, prompts, groups):
    out = []
    for p, grp in zip(prompts, groups, strict=True):
        for c in grp:
            ids = torch.from_numpy(np.concatenate([p, c]))[None]
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1]
            out.append(torch.log_softmax(logits.float(), -1).gather(
                1, torch.from_numpy(c)[:, None]).squeeze(1))
    return out


def packed(prompts, groups, lens, adv, old, gen, ref, norm="sequence"):
    per_token = {"advantage": [np.full(k, a, np.float32) for k, a in zip(lens, adv, strict=True)],
                 "weight": token_weights(lens, norm, 8), "old": old, "ref": ref,
                 "generation": gen}
    return packed_batch(prompts, groups, PACK, 0, per_token, row_tokens=12)


def run(model, batch, n_tok, record_behaviour, c):
    model.zero_grad()
    amb = AdaptiveMicroBatch(model, max_tokens=12, tokens_key="real")
    out = accumulate_gradients(model, amb, batch, LOSS, PACK, n_tok, record_behaviour,
                               is_truncation=c)
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("record_behaviour", [False, True])
@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_tis_loss_equals_a_naive_reference_in_values_and_gradients(model, record_behaviour,
                                                                   norm):
    """Per token: -min(r A, clip(r) A) * min(exp(old - gen), C) + beta * k3, with ``old`` the
    stored log-probs (or, recording the behaviour, the current ones detached: r = 1)."""
    c = 1.2
    prompts, groups, lens, adv, old, gen, ref = rollouts()
    batch = packed(prompts, groups, lens, adv, old, gen, ref, norm)
    n_tok = sum(lens)

    model.zero_grad()
    terms, ratios = [], []
    for lp, a, o, g, r in zip(naive_logprobs(model, prompts, groups), adv, old, gen, ref,
                              strict=True):
        o = lp.detach() if record_behaviour else torch.from_numpy(o)
        ratio = torch.exp(lp - o)
        surr = torch.minimum(ratio * a, ratio.clamp(0.9, 1.3) * a)
        w = torch.exp(o - torch.from_numpy(g))
        ratios.append(w.detach())
        d = torch.from_numpy(r) - lp
        per = -surr * torch.clamp(w, max=c) + 0.1 * (torch.exp(d) - d - 1)
        terms.append(per.mean() / len(lens) if norm == "sequence" else per.sum() / n_tok)
    torch.stack(terms).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    w_all = torch.cat(ratios)

    out, got = run(model, batch, n_tok, record_behaviour, c)
    assert 0 < out["is_clipped_fraction"] < 1  # some tokens truncated, some not
    assert out["is_clipped_fraction"] == pytest.approx(float((w_all > c).float().mean()))
    assert out["is_ratio_mean"] == pytest.approx(float(w_all.mean()), rel=1e-5)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_tis_off_is_the_loss_without_it_bit_for_bit(model):
    """C = 0: the same gradients and statistics, bit for bit, as a batch without generation
    log-probs (the loss of today), plus the ratio's statistics (nothing truncated); and a
    fresh group (generated by the weights being updated: ``generation == old``, every weight
    exactly 1) with C >= 1 gives the same gradients bit for bit too."""
    prompts, groups, lens, adv, old, gen, ref = rollouts(seed=3)
    n_tok = sum(lens)
    batch = packed(prompts, groups, lens, adv, old, gen, ref)
    out_off, off = run(model, batch, n_tok, False, 0.0)
    plain = {k: v for k, v in batch.items() if k != "generation"}
    out_plain, base = run(model, plain, n_tok, False, 0.0)
    assert "is_ratio_mean" not in out_plain
    assert {k: v for k, v in out_off.items() if not k.startswith("is_")} == out_plain
    ratio = np.exp(np.concatenate(old) - np.concatenate(gen))
    assert out_off["is_ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-5)
    assert out_off["is_clipped_fraction"] == 0.0
    fresh = packed(prompts, groups, lens, adv, old, old, ref)
    out_fresh, on = run(model, fresh, n_tok, False, 2.0)
    assert out_fresh["is_ratio_mean"] == 1.0 and out_fresh["is_clipped_fraction"] == 0.0
    for n in base:
        assert torch.equal(off[n], base[n]) and torch.equal(on[n], base[n]), n


def test_tis_refuses_a_negative_truncation_or_missing_generation_logprobs(model):
    prompts, groups, lens, adv, old, gen, ref = rollouts(seed=4)
    batch = packed(prompts, groups, lens, adv, old, gen, ref)
    with pytest.raises(ValueError, match="is_truncation: expected 0"):
        run(model, batch, sum(lens), False, -1.0)
    plain = {k: v for k, v in batch.items() if k != "generation"}
    with pytest.raises(ValueError, match=r"batch\['generation'\]"):
        run(model, plain, sum(lens), False, 2.0)
