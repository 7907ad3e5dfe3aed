"""Reference log-probs from the policy's own weights (LoRA adapters disabled) equal those of
a separate copy of the base model; the bytes a copy would take are reported."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from rlbuffers.memory import causal_lm_token_logprobs, reference_bytes_saved, reference_logprobs

# peft 0.21 reads a property that transformers 5 deprecates
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def lora_policy():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=64)
    base = LlamaForCausalLM(cfg).eval()
    copy_of_base = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # trained adapters: the policy differs from the base
    return model, copy_of_base


def test_reference_equals_a_base_copy_and_policy_differs():
    model, base = lora_policy()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = reference_logprobs(model, ids, chunk_tokens=4)
    want = causal_lm_token_logprobs(base, ids).detach()
    torch.testing.assert_close(ref, want, atol=2e-5, rtol=1e-4)
    assert not ref.requires_grad
    policy = causal_lm_token_logprobs(model, ids, chunk_tokens=4)
    assert policy.requires_grad and (policy - want).abs().max() > 1e-3
    ref_tail = reference_logprobs(model, ids, logits_to_keep=3)
    torch.testing.assert_close(ref_tail, want[:, -3:], atol=2e-5, rtol=1e-4)


def test_bytes_saved_is_the_base_weights():
    model, base = lora_policy()
    assert reference_bytes_saved(model) == sum(p.numel() * 4 for p in base.parameters())


def test_not_a_peft_model_is_named():
    _, base = lora_policy()
    with pytest.raises(TypeError, match="model: expected a peft model"):
        reference_logprobs(base, torch.zeros(1, 3, dtype=torch.long))
    model, _ = lora_policy()
    with pytest.raises(ValueError, match="with_entropy: expected False"):
        reference_logprobs(model, torch.zeros(1, 3, dtype=torch.long), with_entropy=True)
