"""Per-token log-probs of completions packed with their prompt once per row, for the LLM
trainers (GRPO, CRSP, guidance): the packing (``pack_shared_prefix``), the decoder forward with
attention over only the blocks a token may see (``rlbuffers.memory.prefix_attention``, the
Shared-Prefix Forward of Liu et al. 2025, "Prefix Grouper", arXiv 2506.05433, Sec. 3), and the
chunked fp32 LM head (``token_logprobs``, never the ``[B, T, V]`` logits); and the reference
policy's log-probs over such rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbuffers.memory import token_logprobs
from rlbuffers.memory.micro_batch import split_tokens
from rlbuffers.memory.prefix_attention import enable_prefix_attention, plan_prefix_attention
from rlbuffers.stream.prefix_packing import pack_shared_prefix, shared_prefix_mask
from trainers.llm.settings import Packing


def lm_parts(model: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """(decoder, LM head weight [V, H], bias [V] or None) of a causal LM or a peft model."""
    head = model.get_output_embeddings()
    return model.get_decoder(), head.weight, head.bias


def packed_batch(prompts: list[np.ndarray], completions: list[list[np.ndarray]],
                 packing: Packing, pad_id: int, per_token: dict[str, list[np.ndarray]],
                 row_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Groups (a prompt and its completions) packed with the prompt once per row
    (``pack_shared_prefix``: ``input_ids``, ``position_ids``, ``block``, ``parent``,
    ``source``, ``mask``, ``index``, ``real`` and ``per_token``, tensors ``[R, T]``, ``T =
    packing.pack_tokens``): groups share a row up to ``row_tokens`` tokens (None: ``T``); a longer
    group has a row of its own, split (prompt copied) only beyond ``T``."""
    row_tokens = min(row_tokens or packing.pack_tokens, packing.pack_tokens)
    b = pack_shared_prefix(prompts, completions, packing.pack_tokens, pad_id, per_token,
                           row_tokens=row_tokens)
    return {k: torch.from_numpy(v) for k, v in b.items()}


def packed_logprobs(model: Any, micro: dict[str, torch.Tensor], packing: Packing
                    ) -> torch.Tensor:
    """Log-probs (float32[n]) of the completion tokens of packed rows (``micro['mask']``, in
    row-major order), from the decoder's hidden states (each completion attends to its prompt
    and itself; under bf16/fp16 autocast with ``packing.train_dtype``) through the chunked LM
    head (no ``[B, T, V]``): its matmuls in ``packing.train_dtype`` too, as autocast runs every
    other linear layer, with fp32 logits, softmax and the target's and maximum's logits
    (``token_logprobs(matmul_dtype=)``)."""
    decoder, weight, bias = lm_parts(model)
    width = int(micro["real"].any(0).nonzero().max()) + 1  # trailing padding: not computed
    micro = {k: v[:, :width] for k, v in micro.items()}
    if enable_prefix_attention(decoder):  # only the allowed query-key blocks are computed
        attend: dict[str, Any] = {"prefix_plan": plan_prefix_attention(
            micro["block"], micro["parent"], micro["real"], micro["input_ids"].device)}
    else:  # another attention implementation: the dense mask (additive for eager)
        allowed = shared_prefix_mask(micro["block"], micro["parent"])
        if decoder.config._attn_implementation == "eager":
            allowed = torch.zeros(allowed.shape).masked_fill_(
                ~allowed, torch.finfo(torch.float32).min)
        attend = {"attention_mask": allowed}
    dtype = getattr(torch, packing.train_dtype)
    # The head's weight gradient goes straight into .grad (no [V, H] buffer per micro-batch);
    # a tied input embedding then sends only its looked-up rows (a sparse gradient) instead of
    # a dense [V, H] one: the head's backward, which runs first, has made .grad dense.
    accumulate = weight.requires_grad and weight.is_leaf and torch.is_grad_enabled()
    embed = decoder.get_input_embeddings()
    sparse = getattr(embed, "sparse", None)
    if accumulate and sparse is not None and embed.weight is weight:
        embed.sparse = True
    try:
        with torch.autocast(micro["input_ids"].device.type, dtype=dtype,
                            enabled=dtype != torch.float32):
            hidden = decoder(input_ids=micro["input_ids"], position_ids=micro["position_ids"],
                             use_cache=False, **attend).last_hidden_state
    finally:
        if sparse is not None:
            embed.sparse = sparse
    hidden = hidden.float()  # the LM head and log-softmax in fp32 (mixed precision)
    mask = micro["mask"]
    rows = mask.nonzero()[:, 0]
    return token_logprobs(hidden[rows, micro["source"][mask]][None], weight,
                          micro["input_ids"][mask][None], chunk_tokens=packing.chunk_tokens,
                          lm_head_bias=bias, temperature=packing.temperature,
                          matmul_dtype=None if dtype == torch.float32 else dtype,
                          accumulate_weight_grad=accumulate)[0]


@torch.no_grad()
def packed_reference_logprobs(model: Any, batch: dict[str, torch.Tensor], packing: Packing,
                              reference: Path | None, n_tokens: int = 0, *,
                              adapters_on: bool = False) -> torch.Tensor:
    """Per completion token log-probs of the reference policy (flat, float32[n], at the
    batch's ``index``; ``n`` is ``n_tokens`` or the number of completion tokens): the same
    weights with adapters disabled (``reference`` None: a peft model), the model as it is
    (``reference`` None and ``adapters_on``: the caller has put the reference adapter
    weights in, e.g. CRSP's proposer after its warm-up), or the initial weights
    memory-mapped from the file ``reference`` (``torch.save``d state dict) for the duration of
    the call, on the policy's device (full fine-tuning). The result is on the CPU."""
    n = n_tokens or int(batch["mask"].sum())
    out = torch.zeros(n)
    if reference is None and adapters_on:
        from contextlib import nullcontext

        ctx, ref = nullcontext(), model
    elif reference is None:
        ctx, ref = model.disable_adapter(), model
    else:
        from contextlib import nullcontext

        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            ref = AutoModelForCausalLM.from_config(model.config)
        from rlbuffers.safe_load import load_torch, restoring

        state = load_torch(reference, mmap=True,
                           map_location=next(model.parameters()).device)  # the policy's
        with restoring(reference, "the initial weights of this model"):
            ref.load_state_dict(state, assign=True)
        ref.tie_weights()
        own = dict(model.named_buffers())  # non-persistent buffers (rotary inv_freq): shared
        for name, buffer in list(ref.named_buffers()):
            if buffer.is_meta:
                owner, _, attr = name.rpartition(".")
                ref.get_submodule(owner).register_buffer(attr, own[name], persistent=False)
        ctx = nullcontext()
    ref.eval()
    real = batch["real"].sum(1).tolist()
    with ctx:  # no activations kept: rows together up to twice --pack-tokens
        for rows in split_tokens(real, 2 * packing.pack_tokens):
            micro = {k: v[rows] for k, v in batch.items()}
            # out is on the CPU: a CUDA index and CUDA values would not write into it
            out[micro["index"][micro["mask"]].cpu()] = packed_logprobs(ref, micro, packing).cpu()
    return out
