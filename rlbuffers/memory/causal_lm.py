"""Per-token log-probabilities of a ``transformers`` causal LM through the chunked LM head.

Runs the decoder only (``model.get_decoder()``), then :func:`token_logprobs` on its final
hidden states, so the ``[B, T, V]`` logits the model's own ``forward`` would build never exist.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlbuffers.memory.logprobs import token_logprobs


def _output_head(model: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    head = model.get_output_embeddings()  # type: ignore[operator]
    if type(head) is not torch.nn.Linear:
        raise TypeError(f"model: expected a plain torch.nn.Linear LM head, got "
                        f"{type(head).__name__} (an adapter on the LM head is not supported)")
    return head.weight, head.bias


def _check(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
           logits_to_keep: int | None) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected shape [B, T], got {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and tuple(t.shape) != tuple(input_ids.shape):
            raise ValueError(f"{name}: expected shape {tuple(input_ids.shape)} (input_ids), "
                             f"got {tuple(t.shape)}")
    if logits_to_keep is not None and not 1 <= logits_to_keep < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep: expected an int in [1, {input_ids.shape[1] - 1}] "
                         f"(T - 1), got {logits_to_keep!r}")


def causal_lm_token_logprobs(model: torch.nn.Module, input_ids: Tensor, *,
                             attention_mask: Tensor | None = None,
                             position_ids: Tensor | None = None,
                             logits_to_keep: int | None = None, chunk_tokens: int = 1024,
                             temperature: float = 1.0,
                             with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each next token of ``input_ids`` under a causal LM.

    Position ``t`` of the result is ``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])``.

    Args:
        model: a ``transformers`` causal LM (``get_decoder()`` and a ``torch.nn.Linear``
            ``get_output_embeddings()``), e.g. ``LlamaForCausalLM``, or a peft model wrapping
            one (adapters on the decoder are used as they are enabled).
        input_ids: ``int64[B, T]`` token ids.
        attention_mask: optional ``int[B, T]`` (1 = real token, 0 = padding); padded
            positions still get a value, which the caller masks.
        position_ids: optional ``int64[B, T]``; for packed sequences (several sequences in
            one row, positions restarting at 0, no ``attention_mask``) ``transformers``
            builds a block-diagonal mask from them. The value at the last token of each
            packed sequence predicts the next sequence's first token: mask it.
        logits_to_keep: keep only the last ``k`` predicted tokens (the completion), as in
            TRL: the result is ``[B, k]`` for ``input_ids[:, -k:]``. ``None`` keeps all
            ``T - 1``.
        chunk_tokens: tokens per LM-head chunk (see :func:`token_logprobs`).
        temperature: logits are divided by it (> 0).
        with_entropy: also return each position's entropy.

    Returns:
        ``logprobs: float32[B, T - 1]`` (or ``[B, k]``), plus ``entropy`` of the same shape
        when ``with_entropy``.

    Raises:
        ValueError: shapes that do not match ``input_ids``, ``logits_to_keep`` out of range,
            and everything :func:`token_logprobs` raises.
        TypeError: an LM head that is not a plain ``torch.nn.Linear``.
    """
    _check(input_ids, attention_mask, position_ids, logits_to_keep)
    weight, bias = _output_head(model)
    decoder = model.get_decoder()  # type: ignore[operator]
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    k = input_ids.shape[1] - 1 if logits_to_keep is None else logits_to_keep
    hidden = hidden[:, -(k + 1):-1]
    targets = input_ids[:, -k:]
    return token_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens,
                          lm_head_bias=bias, temperature=temperature,
                          with_entropy=with_entropy)
