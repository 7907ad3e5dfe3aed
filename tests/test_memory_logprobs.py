"""token_logprobs and causal_lm_token_logprobs equal the naive full-logits computation,
values and gradients, and reject bad input naming the argument."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from rlbuffers.memory import causal_lm_token_logprobs, token_logprobs

ATOL = 2e-5


def naive(hidden, weight, targets, bias=None, temperature=1.0):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    keep = targets != -100
    logp = logp_all.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def leaves(b, t, h, v, *, bias, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    b_ = (torch.randn(v, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, b_, targets


def grads(fn, tensors, seed):
    """Values of ``fn()`` and gradients of a random weighted sum of them."""
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed + 1)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    got = torch.autograd.grad(loss, [x for x in tensors if x is not None])
    return [o.detach() for o in outs], got


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), v=st.integers(2, 70),
       chunk=st.integers(1, 12), bias=st.booleans(), entropy=st.booleans(),
       temperature=st.sampled_from([1.0, 0.7, 1.9]), seed=st.integers(0, 2**16))
def test_values_and_grads_equal_naive(b, t, v, chunk, bias, entropy, temperature, seed):
    hidden, weight, bias_t, targets = leaves(b, t, 8, v, bias=bias, seed=seed)
    targets[0, 0] = -100  # a masked position
    ts = (hidden, weight, bias_t)

    def ours():
        return token_logprobs(hidden, weight, targets, chunk_tokens=chunk, lm_head_bias=bias_t,
                              temperature=temperature, with_entropy=entropy)

    def ref():
        lp, ent = naive(hidden, weight, targets, bias_t, temperature)
        return (lp, ent) if entropy else lp

    (vals, gs), (rvals, rgs) = grads(ours, ts, seed), grads(ref, ts, seed)
    for got, want in zip(vals + list(gs), rvals + list(rgs), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    assert vals[0].dtype == torch.float32 and vals[0].shape == (b, t)
    assert vals[0][0, 0] == 0.0


def test_masked_positions_get_no_gradient():
    hidden, weight, _, targets = leaves(2, 5, 8, 11, bias=False, seed=3)
    targets[1, 2:] = -100
    lp = token_logprobs(hidden, weight, targets, chunk_tokens=3)
    (gh,) = torch.autograd.grad(lp.sum(), [hidden])
    assert torch.all(gh[1, 2:] == 0) and torch.all(gh[1, :2] != 0)


def test_bfloat16_inputs_follow_naive_in_fp32():
    hidden, weight, _, targets = leaves(2, 6, 16, 40, bias=False, seed=5)
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16()
    wb.requires_grad_()
    lp = token_logprobs(hb, wb, targets, chunk_tokens=4)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, naive(hb, wb, targets)[0], atol=1e-4, rtol=1e-4)
    gh, gw = torch.autograd.grad(lp.sum(), [hb, wb])
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    rgh, rgw = torch.autograd.grad(naive(hb, wb, targets)[0].sum(), [hb, wb])
    torch.testing.assert_close(gh.float(), rgh.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), rgw.float(), atol=2e-2, rtol=2e-2)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), v=st.integers(2, 300),
       chunk=st.integers(1, 12), bias=st.booleans(), entropy=st.booleans(),
       temperature=st.sampled_from([1.0, 0.7]), seed=st.integers(0, 2**16))
def test_bf16_matmuls_follow_naive_fp32(b, t, v, chunk, bias, entropy, temperature, seed):
    """``matmul_dtype=bfloat16``: values and gradients within bf16 rounding of the fp32
    naive computation. The gradient bound adds the error of the naive computation with bf16
    matmuls (inputs and logits rounded to 8 mantissa bits, softmax in fp32): where the
    gradient cancels (an entropy-only gradient of a near-uniform 2-token softmax is ~ the
    logits' difference) rounding the logits alone moves it by several percent."""
    hidden, weight, bias_t, targets = leaves(b, t, 32, v, bias=bias, seed=seed)
    targets[0, 0] = -100
    ts = (hidden, weight, bias_t)

    def ours():
        return token_logprobs(hidden, weight, targets, chunk_tokens=chunk, lm_head_bias=bias_t,
                              temperature=temperature, with_entropy=entropy,
                              matmul_dtype=torch.bfloat16)

    def ref(dtype):
        def run():
            cast = (lambda x: x) if dtype is None else (lambda x: x if x is None else x.to(dtype))
            lp, ent = naive(cast(hidden), cast(weight), targets, cast(bias_t), temperature)
            return (lp, ent) if entropy else lp
        return run

    (vals, gs), (rvals, rgs) = grads(ours, ts, seed), grads(ref(None), ts, seed)
    _, bgs = grads(ref(torch.bfloat16), ts, seed)
    for got, want in zip(vals, rvals, strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
    for got, want, bf16 in zip(gs, rgs, bgs, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        rounding = float((bf16 - want).norm())
        assert float((got - want).norm()) <= 2e-2 * float(want.norm()) + 2 * rounding + 1e-6
    assert vals[0].dtype == torch.float32 and vals[0][0, 0] == 0.0


def test_bf16_matmuls_keep_target_and_max_logits_exact():
    """A peaked distribution: log p(y) of the argmax target is ~ -sum of the other terms,
    and with the target's and the maximum's logits recomputed in fp32 it is within ~1e-3
    nats of fp32, where rounding the logits to bf16 alone is off by ~0.03-0.1 nats."""
    g = torch.Generator().manual_seed(7)
    v, h = 500, 64
    weight = torch.randn(v, h, generator=g) / h**0.5
    hidden = torch.randn(3, 40, h, generator=g)
    targets = torch.randint(0, v, (3, 40), generator=g)
    hidden = hidden + 12.0 * weight[targets]  # logit of the target ~ 12 x |w|^2 above others
    want = naive(hidden, weight, targets)[0]
    got = token_logprobs(hidden, weight, targets, matmul_dtype=torch.bfloat16)
    rounded = naive(hidden.bfloat16(), weight.bfloat16(), targets)[0]
    err, err_rounded = float((got - want).abs().max()), float((rounded - want).abs().max())
    assert err_rounded > 1e-2  # what the correction removes
    assert err < 1e-3 and err < err_rounded / 10, (err, err_rounded)
    exact = token_logprobs(hidden, weight, targets, matmul_dtype=torch.float32)
    assert torch.equal(exact, token_logprobs(hidden, weight, targets))


@pytest.mark.parametrize("matmul_dtype", [None, torch.bfloat16])
def test_caller_autocast_changes_nothing(matmul_dtype):
    """Called (forward and backward) inside the caller's bf16 autocast region (e.g. one
    region around a whole micro-batch loop): values and gradients are bitwise those of a
    call without autocast (the head chooses its own matmul dtype; an
    ambient autocast once broke the fp32 recomputation with a dtype error)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 30, 32, generator=g)
    weight = torch.randn(200, 32, generator=g)
    targets = torch.randint(0, 200, (2, 30), generator=g)
    results = []
    for ambient in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ambient):
            lp, ent = token_logprobs(h, w, targets, chunk_tokens=16, with_entropy=True,
                                     matmul_dtype=matmul_dtype)
            (lp.sum() + 0.5 * ent.sum()).backward()
        results.append((lp, ent, h.grad, w.grad))
    for plain, ambient in zip(*results, strict=True):
        assert plain.dtype == ambient.dtype == torch.float32
        assert torch.equal(plain, ambient)


@pytest.mark.parametrize("matmul_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_accumulated_weight_grad_equals_autograd(matmul_dtype, tied, monkeypatch):
    """accumulate_weight_grad: two backward passes (a gradient-accumulation loop) leave in
    .grad what autograd's returned gradients leave, with .grad None or holding values at
    the start, and with the weight also used as a (sparse-gradient) input embedding; the
    vocabulary is split in blocks of 5 rows here (the weight gradient computed per block)."""
    import rlbuffers.memory.logprobs as lp_mod
    monkeypatch.setattr(lp_mod, "_VOCAB_BLOCK", 5)
    results = []
    for accumulate in (False, True):
        hidden, weight, _, targets = leaves(2, 6, 8, 23, bias=False, seed=4)
        ids = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(9))
        weight.grad = torch.full_like(weight, 0.5) if tied else None  # both starts
        for k in range(2):  # two micro-batches into one .grad
            h = hidden * (k + 1)
            if tied:  # the same weight as input embedding, its rows' gradient sparse
                h = h + torch.nn.functional.embedding(ids, weight, sparse=accumulate)
            out = token_logprobs(h, weight, targets, chunk_tokens=5, matmul_dtype=matmul_dtype,
                                 accumulate_weight_grad=accumulate)
            (out * torch.linspace(-1, 1, 12).reshape(2, 6)).sum().backward()
        assert weight.grad.dtype == torch.float32 and weight.grad.layout == torch.strided
        results.append((weight.grad.clone(), hidden.grad.clone()))
    (w0, h0), (w1, h1) = results
    torch.testing.assert_close(w1, w0, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-4)


def test_accumulate_weight_grad_needs_a_leaf():
    hidden, weight, _, targets = leaves(1, 4, 8, 11, bias=False, seed=0)
    with pytest.raises(ValueError, match="lm_head_weight: accumulate_weight_grad needs a leaf"):
        token_logprobs(hidden, weight * 2, targets, accumulate_weight_grad=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"matmul_dtype": torch.int8}, "matmul_dtype: expected a floating torch.dtype or None"),
    ({"matmul_dtype": "bf16"}, "matmul_dtype: expected a floating torch.dtype or None"),
    ({"chunk_tokens": 0}, "chunk_tokens: expected an int >= 1, got 0"),
    ({"temperature": 0.0}, "temperature: expected > 0"),
    ({"lm_head_bias": torch.zeros(3)}, r"lm_head_bias: expected shape \(11,\), got \(3,\)"),
])
def test_bad_arguments_are_named(kwargs, match):
    hidden, weight, _, targets = leaves(1, 4, 8, 11, bias=False, seed=0)
    with pytest.raises(ValueError, match=match):
        token_logprobs(hidden, weight, targets, **kwargs)


def test_shape_mismatches_are_named():
    hidden, weight, _, targets = leaves(2, 4, 8, 11, bias=False, seed=0)
    with pytest.raises(ValueError, match=r"target_ids: expected shape \(2, 4\).*got \(2, 3\)"):
        token_logprobs(hidden, weight, targets[:, :3])
    with pytest.raises(ValueError, match=r"hidden: expected shape \[B, T, 8\].*got \(2, 4, 5\)"):
        token_logprobs(hidden[..., :5], weight, targets)
    with pytest.raises(ValueError, match=r"target_ids: expected ids in \[0, 11\)"):
        token_logprobs(hidden, weight, targets + 11)
    with pytest.raises(ValueError, match="target_ids: expected an integer dtype"):
        token_logprobs(hidden, weight, targets.float())


def tiny_llama(seed=0, *, tie=False):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=64, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def naive_model_logprobs(model, ids, **kw):
    logits = model(input_ids=ids, **kw).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("tie", [False, True])
def test_causal_lm_equals_model_logits_values_and_grads(tie):
    model = tiny_llama(tie=tie)
    ids = torch.randint(0, 128, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    params = [p for p in model.parameters()]
    ours = causal_lm_token_logprobs(model, ids, attention_mask=mask, chunk_tokens=5)
    want = naive_model_logprobs(model, ids, attention_mask=mask)
    loss_mask = mask[:, 1:].float()
    torch.testing.assert_close(ours * loss_mask, want * loss_mask, atol=ATOL, rtol=1e-4)
    g1 = torch.autograd.grad((ours * loss_mask).sum(), params)
    g2 = torch.autograd.grad((want * loss_mask).sum(), params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_logits_to_keep_keeps_the_completion_and_entropy_matches():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    lp, ent = causal_lm_token_logprobs(model, ids, logits_to_keep=4, chunk_tokens=3,
                                       with_entropy=True)
    assert lp.shape == (2, 4) and ent.shape == (2, 4)
    logits = model(input_ids=ids).logits[:, -5:-1].float()
    logp_all = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, logp_all.gather(-1, ids[:, -4:, None]).squeeze(-1),
                               atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(ent, -(logp_all.exp() * logp_all).sum(-1), atol=ATOL,
                               rtol=1e-4)


def test_packed_sequences_equal_separate_runs():
    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 128, (1, 6), generator=g), torch.randint(0, 128, (1, 5), generator=g)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(6), torch.arange(5)]).unsqueeze(0)
    lp = causal_lm_token_logprobs(model, packed, position_ids=pos, chunk_tokens=4)
    want_a = causal_lm_token_logprobs(model, a)
    want_b = causal_lm_token_logprobs(model, b)
    torch.testing.assert_close(lp[:, :5], want_a, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(lp[:, 6:], want_b, atol=ATOL, rtol=1e-4)


def test_causal_lm_bad_input_is_named():
    model = tiny_llama()
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \(2, 6\)"):
        causal_lm_token_logprobs(model, ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"logits_to_keep: expected an int in \[1, 5\]"):
        causal_lm_token_logprobs(model, ids, logits_to_keep=6)
    with pytest.raises(ValueError, match=r"input_ids: expected shape \[B, T\]"):
        causal_lm_token_logprobs(model, ids[0])


def test_frozen_head_gives_hidden_grads_only():
    hidden, weight, bias, targets = leaves(2, 7, 8, 30, bias=True, seed=9)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    lp = token_logprobs(hidden, weight, targets.int(), chunk_tokens=5, lm_head_bias=bias)
    (gh,) = torch.autograd.grad(lp.sum(), [hidden])
    (want,) = torch.autograd.grad(naive(hidden, weight, targets, bias)[0].sum(), [hidden])
    torch.testing.assert_close(gh, want, atol=ATOL, rtol=1e-4)
    with torch.no_grad():
        assert not token_logprobs(hidden, weight, targets, lm_head_bias=bias).requires_grad
