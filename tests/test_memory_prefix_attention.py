"""Prefix-aware attention (rlbuffers.memory.prefix_attention) over shared-prefix packed rows:
hidden states and gradients equal the dense ``shared_prefix_mask`` path of the library's sdpa
attention, for any packing (hypothesis), with and without gradient checkpointing; calls
without a plan are the library's sdpa; bad plans are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbuffers.memory.prefix_attention import (
    NAME,
    enable_prefix_attention,
    plan_prefix_attention,
)
from rlbuffers.stream.prefix_packing import pack_shared_prefix, shared_prefix_mask


def tiny_llama(kv_heads: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=97,
                      max_position_embeddings=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).double()


def forward_and_grads(model, b, plan: bool):
    model.zero_grad(set_to_none=True)
    ids, pos = torch.from_numpy(b["input_ids"]), torch.from_numpy(b["position_ids"])
    if plan:
        kw = {"prefix_plan": plan_prefix_attention(b["block"], b["parent"], b["real"])}
    else:
        kw = {"attention_mask": torch.from_numpy(shared_prefix_mask(b["block"], b["parent"]))}
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False, **kw).last_hidden_state
    real = torch.from_numpy(b["real"])
    weights = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)
    (hidden[real] * weights).sin().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden[real].detach(), grads


token_arrays = st.lists(st.integers(3, 96), min_size=1, max_size=9).map(
    lambda x: np.array(x, np.int64))
groups_st = st.lists(st.tuples(token_arrays, st.lists(token_arrays, min_size=1, max_size=4)),
                     min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=groups_st, slack=st.integers(0, 20), kv_heads=st.sampled_from([1, 2, 4]))
def test_values_and_gradients_equal_the_dense_mask(groups, slack, kv_heads):
    model = tiny_llama(kv_heads)
    prompts, completions = [p for p, _ in groups], [cs for _, cs in groups]
    max_tokens = max(len(p) + len(c) for p, cs in groups for c in cs) + slack
    b = pack_shared_prefix(prompts, completions, max_tokens, pad_id=0)
    want_h, want_g = forward_and_grads(model, b, plan=False)
    assert enable_prefix_attention(model) and model.config._attn_implementation == NAME
    got_h, got_g = forward_and_grads(model, b, plan=True)
    torch.testing.assert_close(got_h, want_h, rtol=1e-10, atol=1e-10)
    assert want_g.keys() == got_g.keys()
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-9, atol=1e-10, msg=name)


def test_gradient_checkpointing_recomputes_with_the_plan():
    groups = [(np.arange(3, 9), [np.arange(10, 15), np.arange(20, 23)]),
              (np.arange(30, 34), [np.arange(40, 47)])]
    b = pack_shared_prefix([p for p, _ in groups], [c for _, c in groups], 24, pad_id=0)
    model = tiny_llama()
    want_h, want_g = forward_and_grads(model, b, plan=False)
    enable_prefix_attention(model)
    # transformers >= 5.2x names it activation_checkpointing_enable (the older name warns);
    # older releases (5.17 on the CUDA machine, >= 4.45 allowed) have only the older name.
    enable = getattr(model, "activation_checkpointing_enable", None) \
        or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    model.train()
    got_h, got_g = forward_and_grads(model, b, plan=True)
    torch.testing.assert_close(got_h, want_h, rtol=1e-10, atol=1e-10)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-9, atol=1e-10, msg=name)


def test_without_a_plan_it_is_the_library_sdpa():
    model = tiny_llama()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    att = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = model(input_ids=ids, attention_mask=att).logits
    enable_prefix_attention(model)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=att).logits, want,
                               rtol=0, atol=0)
    gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=4, do_sample=False,
                         pad_token_id=0)
    model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(gen, model.generate(input_ids=ids, attention_mask=att,
                                                   max_new_tokens=4, do_sample=False,
                                                   pad_token_id=0), rtol=0, atol=0)


def test_other_attention_implementations_are_left_alone():
    model = tiny_llama()
    model.config._attn_implementation = "eager"
    assert not enable_prefix_attention(model)
    assert model.config._attn_implementation == "eager"


def test_bad_plans_are_named():
    b = pack_shared_prefix([np.arange(3, 6)], [[np.arange(7, 9)]], 8, pad_id=0)
    with pytest.raises(ValueError, match=r"block, parent, real: expected equal"):
        plan_prefix_attention(b["block"], b["parent"][:, :4], b["real"])
    parent = b["parent"].copy()
    parent[0, 0] = 5  # the prompt's first token now looks like an orphan completion
    with pytest.raises(ValueError, match=r"row 0, position 0: a completion"):
        plan_prefix_attention(b["block"], parent, b["real"])
    real = b["real"].copy()
    real[0, 1] = False
    with pytest.raises(ValueError, match=r"real\[0\]: expected real tokens first"):
        plan_prefix_attention(b["block"], b["parent"], real)
    model = tiny_llama()
    enable_prefix_attention(model)
    plan = plan_prefix_attention(b["block"], b["parent"], b["real"])
    with pytest.raises(ValueError, match=r"prefix_plan: planned for 1 rows of 8 tokens, got 1 "
                                         r"rows of 5"):
        model.model(input_ids=torch.from_numpy(b["input_ids"][:, :5]), prefix_plan=plan)


def test_under_autocast_the_output_has_the_attention_dtype():
    """Under bf16 autocast, sdpa returns bf16 while the rotated query stays fp32 (on CUDA it
    did: ``index_copy_`` of bf16 pieces into an fp32 row failed): the rows are assembled in
    the pieces' dtype, as the library's sdpa returns them."""
    from rlbuffers.memory.prefix_attention import prefix_attention

    b = pack_shared_prefix([np.array([1, 2, 3])], [[np.array([4, 5]), np.array([6])]], 12, 0)
    plan = plan_prefix_attention(b["block"], b["parent"], b["real"])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = prefix_attention(torch.nn.Module(), q, k, v, None, prefix_plan=plan)
    want, _ = prefix_attention(torch.nn.Module(), q, k, v, None, prefix_plan=plan)
    assert out.dtype == torch.bfloat16 and want.dtype == torch.float32
    assert torch.allclose(out.float(), want, atol=3e-2)
