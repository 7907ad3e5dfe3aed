"""Attention for shared-prefix packed rows that computes only the blocks a token may see.

Rows from :func:`rlbuffers.stream.prefix_packing.pack_shared_prefix` hold a prompt once and its
completions after it; each completion attends to its prompt and, causally, to itself. With the
dense ``[R, 1, T, T]`` mask of ``shared_prefix_mask``, ``scaled_dot_product_attention`` still
computes all ``T * T`` query-key pairs (CPU kernels do not skip masked blocks), so a row of a
150-token prompt and eight 200-token completions does ~3.0 M pairs where ~0.4 M are allowed.
Here each group of a row costs two calls: the prompt's causal self-attention, and its
completions batched (padded to the longest) against ``[prompt keys, own keys]`` with a
lower-right causal mask: ``P * P / 2 + n * C * (P + C)`` pairs for a prompt of ``P`` tokens and
``n`` completions of at most ``C``. Outputs and gradients equal the dense mask's (the same
softmax over the same keys; only the summation order differs). The split (prefix
self-attention, then suffix queries against the concatenated prefix and suffix keys) is the
Shared-Prefix Forward of Liu et al. 2025, "Prefix Grouper" (arXiv 2506.05433, Sec. 3).

Use: :func:`enable_prefix_attention` on a Hugging Face model whose attention is ``"sdpa"``,
then pass ``prefix_plan=plan_prefix_attention(block, parent, real)`` to its forward (no
``attention_mask``). Calls without a plan (generation, plain forwards) run the library's
``sdpa`` attention unchanged, so the switch can stay on, which it must for gradient
checkpointing (the backward pass re-runs the forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: the name registered with ``transformers``' attention interfaces.
NAME = "rlbuffers_prefix_sdpa"


@dataclass(frozen=True)
class PrefixGroup:
    """One prompt of a row and the completions that follow it.

    Attributes:
        prompt: positions ``[start, stop)`` of the prompt in the row.
        positions: int64 ``[n, C]``, the row positions of the ``n`` completions' tokens, each
            padded to the longest ``C`` with its last position (``None`` when no completion
            follows the prompt).
        valid: bool ``[n * C]``, flat: True where ``positions`` is a real token.
        mask: bool ``[n, 1, C, P + C]``: completion query ``a`` may see every prompt key and
            its own keys ``b <= a`` that are real.
    """

    prompt: tuple[int, int]
    positions: torch.Tensor | None
    valid: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class PrefixPlan:
    """Per row, its groups, and where their outputs go: ``order`` (int64 ``[m]``) lists the
    row positions that get an output, in the order the groups produce them; other positions
    (padding) get zeros."""

    rows: list[list[PrefixGroup]]
    order: list[torch.Tensor]
    length: int


def plan_prefix_attention(block: Any, parent: Any, real: Any,
                          device: torch.device | str = "cpu") -> PrefixPlan:
    """The plan of :func:`prefix_attention` for packed rows.

    Args:
        block, parent: int ``[R, T]`` (numpy or torch), as made by ``pack_shared_prefix``: a
            prompt's positions have ``parent == block``; a completion's ``parent`` is its
            prompt's block.
        real: bool ``[R, T]``: False on padding.
        device: where the plan's tensors live (the model's device).

    Raises:
        ValueError: shapes differ, or a completion does not directly follow its prompt or
            another completion of the same prompt.
    """
    block, parent, real = (np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x)
                           for x in (block, parent, real))
    if not (block.shape == parent.shape == real.shape) or block.ndim != 2:
        raise ValueError(f"block, parent, real: expected equal [R, T] shapes, got "
                         f"{block.shape}, {parent.shape}, {real.shape}")
    rows, orders = [], []
    for r in range(block.shape[0]):
        groups, order = _row_groups(block[r], parent[r], real[r], r, device)
        rows.append(groups)
        orders.append(torch.as_tensor(order, dtype=torch.long, device=device))
    return PrefixPlan(rows=rows, order=orders, length=block.shape[1])


def _row_groups(block: np.ndarray, parent: np.ndarray, real: np.ndarray, r: int,
                device: torch.device | str) -> tuple[list[PrefixGroup], list[int]]:
    n_real = int(real.sum())
    if not real[:n_real].all():
        raise ValueError(f"real[{r}]: expected real tokens first, then padding")
    cuts = np.flatnonzero(np.diff(block[:n_real])) + 1
    starts = np.concatenate([[0], cuts]).astype(int)
    stops = np.concatenate([cuts, [n_real]]).astype(int)
    groups: list[PrefixGroup] = []
    order: list[int] = []
    k = 0
    while k < len(starts):
        p0, p1 = starts[k], stops[k]
        if parent[p0] != block[p0]:
            raise ValueError(f"row {r}, position {p0}: a completion (block {block[p0]}) "
                             f"without its prompt (block {parent[p0]}) before it")
        comps = []
        k += 1
        while k < len(starts) and parent[starts[k]] == block[p0] != block[starts[k]]:
            comps.append((starts[k], stops[k]))
            k += 1
        order.extend(range(p0, p1))
        if not comps:
            groups.append(PrefixGroup((p0, p1), None, None, None))
            continue
        width = max(b - a for a, b in comps)
        positions = np.array([np.minimum(np.arange(a, a + width), b - 1) for a, b in comps])
        valid = np.arange(width)[None] < np.array([b - a for a, b in comps])[:, None]
        own = np.tril(np.ones((width, width), bool))[None] & valid[:, None, :]
        mask = np.concatenate([np.ones((len(comps), width, p1 - p0), bool), own], axis=2)
        order.extend(positions[valid].tolist())
        groups.append(PrefixGroup(
            (p0, p1), torch.as_tensor(positions, device=device),
            torch.as_tensor(valid.reshape(-1), device=device),
            torch.as_tensor(mask[:, None], device=device)))
    return groups, order


def prefix_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, prefix_plan: PrefixPlan | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A ``transformers`` attention function: with ``prefix_plan``, attention over packed
    rows computed group by group (``query`` ``[R, H, T, D]``, ``key``/``value``
    ``[R, H_kv, T, D]``; returns ``[R, T, H, D]`` and no weights); without, the library's
    ``sdpa`` attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if prefix_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    r, h, t, d = query.shape
    if (len(prefix_plan.rows), prefix_plan.length) != (r, t):
        raise ValueError(f"prefix_plan: planned for {len(prefix_plan.rows)} rows of "
                         f"{prefix_plan.length} tokens, got {r} rows of {t}")
    gqa = key.shape[1] != h
    outs = []
    for b, groups in enumerate(prefix_plan.rows):
        pieces = []
        for g in groups:
            sl = slice(*g.prompt)
            kp, vp = key[b:b + 1, :, sl], value[b:b + 1, :, sl]
            pieces.append(F.scaled_dot_product_attention(
                query[b:b + 1, :, sl], kp, vp, is_causal=True, dropout_p=dropout,
                scale=scaling, enable_gqa=gqa)[0])
            if g.positions is None:
                continue
            n, c = g.positions.shape
            flat = g.positions.reshape(-1)

            qc, kc, vc = (x[b][:, flat].reshape(x.shape[1], n, c, d).transpose(0, 1)
                          for x in (query, key, value))  # [n, H, C, D]
            kc = torch.cat([kp.expand(n, -1, -1, -1), kc], dim=2)
            vc = torch.cat([vp.expand(n, -1, -1, -1), vc], dim=2)
            out = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=g.mask,
                dropout_p=dropout, scale=scaling, enable_gqa=gqa)  # [n, H, C, D]
            pieces.append(out.transpose(0, 1).reshape(h, n * c, d)[:, g.valid])
        got = torch.cat(pieces, dim=1)
        outs.append(got.new_zeros(h, t, d).index_copy(1, prefix_plan.order[b], got))
    return torch.stack(outs).transpose(1, 2).contiguous(), None


def enable_prefix_attention(model: Any) -> bool:
    """Switch ``model`` (a ``transformers`` model, or a peft model around one) from ``"sdpa"``
    to :data:`NAME`: identical for every call without a ``prefix_plan``. Registers the
    function (and ``sdpa``'s mask builder) with ``transformers`` on first use. Returns whether
    the model now uses it (False for other attention implementations, which keep the dense
    mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config
    if config._attn_implementation == NAME:
        return True
    if config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, prefix_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    config._attn_implementation = NAME
    return True
