"""The activation profile (bytes autograd saves per layer) and the choice of layers to
checkpoint: the profile adds up to the whole forward's saved bytes, checkpointing the chosen
layers lowers them by exactly the predicted saving without changing gradients, and the choice
is the fewest layers that fit (against brute force over every subset)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from rlbuffers.memory import (
    ActivationProfile,
    LayerActivations,
    profile_activations,
    select_checkpoint_layers,
)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300))


def saved_bytes_of_forward(model, ids):
    """Naive reference: one hook over the whole forward, every saved storage once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total[0] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids).logits.square().mean()
    return total[0], loss


def checkpoint_layers(model, indices):
    for i in indices:
        layer = model.model.layers[i]
        layer.forward = lambda *a, _f=layer.forward, **k: checkpoint(
            _f, *a, use_reentrant=False, **k)


def test_profile_adds_up_and_checkpointing_saves_exactly_what_it_predicts():
    model = tiny_llama()
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    prof = profile_activations(list(model.model.layers),
                               lambda: model(input_ids=ids).logits.square().mean(),
                               exclude=model.parameters())
    total, loss = saved_bytes_of_forward(model, ids)
    assert prof.total_bytes == total
    assert prof.other_bytes > 0
    assert all(x.saved_bytes >= x.exclusive_bytes > x.input_bytes > 0 for x in prof.layers)
    # The hidden states [2, 48, 64] fp32 are each layer's checkpointed input.
    assert {x.input_bytes for x in prof.layers} == {2 * 48 * 64 * 4}
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    chosen = select_checkpoint_layers(prof, total - 2 * prof.layers[1].checkpoint_saving_bytes)
    assert len(chosen) == 2
    checkpoint_layers(model, chosen)
    after, loss2 = saved_bytes_of_forward(model, ids)
    assert after == total - sum(prof.layers[i].checkpoint_saving_bytes for i in chosen)
    loss2.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)
    # The rotary cos/sin [1, 48, 16] fp32, saved by every layer and freed only with all four.
    assert prof.shared_bytes == 2 * 48 * 16 * 4
    for subset in ([3], [0, 2], [0, 1, 3], [0, 1, 2, 3]):  # any set: the savings add up
        fresh = tiny_llama()
        checkpoint_layers(fresh, subset)
        shared = prof.shared_bytes if len(subset) == 4 else 0
        assert saved_bytes_of_forward(fresh, ids)[0] == total - shared - sum(
            prof.layers[i].checkpoint_saving_bytes for i in subset), subset


def test_profile_errors_name_the_problem():
    layer = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="layers: expected at least one module"):
        profile_activations([], lambda: None)
    with pytest.raises(ValueError, match="layers: expected distinct modules"):
        profile_activations([layer, layer], lambda: None)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad is disabled"):
        profile_activations([layer], lambda: layer(torch.ones(1, 3)))
    with pytest.raises(ValueError, match="max_saved_bytes: expected >= 0, got -1"):
        select_checkpoint_layers(ActivationProfile((), 0), -1)


def test_profile_state_dict_is_plain_data():
    prof = ActivationProfile((LayerActivations(0, 10, 8, 4),), 3)
    assert prof.state_dict() == {"layers": [{"index": 0, "saved_bytes": 10, "exclusive_bytes": 8,
                                             "input_bytes": 4}], "other_bytes": 3,
                                  "shared_bytes": 0}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 300)), min_size=1, max_size=7),
       st.integers(0, 500), st.integers(0, 8000))
def test_the_choice_is_the_fewest_layers_that_fit(layers, other, budget):
    prof = ActivationProfile(tuple(LayerActivations(i, s, s, x) for i, (s, x) in enumerate(layers)),
                             other)
    chosen = select_checkpoint_layers(prof, budget)
    saving = {x.index: x.checkpoint_saving_bytes for x in prof.layers}
    left = prof.total_bytes - sum(saving[i] for i in chosen)
    fits = [k for k in range(len(layers) + 1)
            if any(prof.total_bytes - sum(saving[i] for i in c) <= budget
                   for c in itertools.combinations(range(len(layers)), k))]
    if fits:
        assert left <= budget and len(chosen) == min(fits)
    else:  # nothing fits: every layer that saves anything
        assert chosen == [i for i in range(len(layers)) if saving[i] > 0]
    assert chosen == sorted(set(chosen))
