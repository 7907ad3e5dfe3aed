"""Shared-prefix packing: a group's prompt once per row, its completions after it.

GRPO and its relatives score G completions of the same prompt. Packed one sequence at a time
(prompt + completion each), a row computes the prompt G times; here a row holds the prompt once
and each completion attends to it and to itself only, so the prompt's forward and backward are
done once per row and its gradient is the sum over the completions, exactly as if each
sequence had its own copy. With P prompt tokens and completions of C tokens, a group costs
``P + G * C`` tokens instead of ``G * (P + C)`` (e.g. 200 + 4 * 64 = 456 instead of 1,056).
The idea is the Shared-Prefix Forward of Liu et al. 2025, "Prefix Grouper: Efficient GRPO
Training through Shared-Prefix Forward" (arXiv 2506.05433, Sec. 3), which proves forward
outputs and gradients equal to standard GRPO's; here the attention is an ordinary 4D mask, so
any Hugging Face model whose attention takes a custom mask (``sdpa``, ``eager``) runs it
unchanged.

Layout of a row (``T = max_tokens``)::

    [prompt_a][completion_a1][completion_a2]...[prompt_b][completion_b1]...[padding]

- ``position_ids``: 0.. over a prompt, and each completion continues from its prompt's length;
- ``block`` / ``parent``: a query at position q may see key k <= q when
  ``block[k] == block[q]`` or ``block[k] == parent[q]`` (a prompt's parent is itself; padding
  positions get a block of their own and see only themselves);
- the token at position q of a completion is predicted by the hidden state at ``source[q]``:
  q - 1 inside the completion, the prompt's last position for its first token (so the G first
  tokens share one hidden state).

A group whose prompt and completions exceed ``max_tokens`` is split into several items, each
with its own copy of the prompt. Items are placed by best-fit decreasing (:func:`pack_bfd`)
into rows of ``row_tokens`` (default ``max_tokens``); an item longer than ``row_tokens`` gets a
row of its own. So short groups can be kept in short rows (a bound on the tokens, hence the
activations, of one row) while a long group still keeps its prompt once in a row of up to
``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rlbuffers.stream.packing import pack_bfd


def pack_shared_prefix(prompts: Sequence[np.ndarray], completions: Sequence[Sequence[np.ndarray]],
                       max_tokens: int, pad_id: int,
                       per_token: Mapping[str, Sequence[np.ndarray]] | None = None,
                       row_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Pack groups (a prompt and its completions) into rows of ``max_tokens`` tokens.

    Args:
        prompts: ``G`` prompts, int arrays of ``[P_g]`` token ids (``P_g >= 1``).
        completions: per prompt, its completions (int arrays ``[C_gi]``, ``C_gi >= 1``).
        max_tokens: tokens per row (int); every prompt plus any one of its completions must fit.
        pad_id: token id of padding positions.
        per_token: ``name -> arrays [C_gi]``, one per completion in the flat order of
            ``completions`` (group by group), scattered to the completion's token positions.
        row_tokens: items (a group, or the part of a group that fits ``max_tokens``) are
            combined in a row while their tokens add up to at most this (int, 1 to
            ``max_tokens``; None: ``max_tokens``); an item longer than it has a row of its own
            (a group is never split to meet ``row_tokens``, only ``max_tokens``).

    Returns:
        ``{name: array[R, T]}``: ``input_ids`` (int64), ``position_ids`` (int64), ``block``
        and ``parent`` (int64, see the module docstring), ``source`` (int64: position of the
        hidden state that predicts this token, -1 where the token is not a completion token),
        ``mask`` (bool: a completion token), ``index`` (int64: the token's position in the flat
        concatenation of all completions, -1 elsewhere), ``real`` (bool: not padding), and each
        ``per_token`` name (float32, 0 elsewhere).

    Raises:
        ValueError: ``prompts`` and ``completions`` of different lengths, an empty prompt or
            completion, a ``per_token`` array of the wrong length, a prompt plus completion
            longer than ``max_tokens`` (each naming the group and completion), or
            ``row_tokens`` outside ``[1, max_tokens]``.
    """
    per_token = dict(per_token or {})
    row_tokens = max_tokens if row_tokens is None else row_tokens
    if not 1 <= row_tokens <= max_tokens:
        raise ValueError(f"row_tokens: expected 1 <= row_tokens <= max_tokens={max_tokens}, "
                         f"got {row_tokens}")
    if len(prompts) != len(completions):
        raise ValueError(f"completions: expected one list per prompt ({len(prompts)}), "
                         f"got {len(completions)}")
    items, lengths, flat_len = _items(prompts, completions, max_tokens)
    for name, arrays in per_token.items():
        if len(arrays) != len(flat_len):
            raise ValueError(f"per_token[{name!r}]: expected {len(flat_len)} arrays, "
                             f"got {len(arrays)}")
        for k, (a, n) in enumerate(zip(arrays, flat_len, strict=True)):
            if len(a) != n:
                raise ValueError(f"per_token[{name!r}][{k}]: expected {n} values, got {len(a)}")
    flat = [c for comps in completions for c in comps]
    starts = np.concatenate([[0], np.cumsum(flat_len)]).astype(np.int64)
    bins = _rows(lengths, row_tokens)
    r, t = len(bins), max_tokens
    out = {"input_ids": np.full((r, t), pad_id, np.int64),
           "position_ids": np.zeros((r, t), np.int64),
           "block": np.zeros((r, t), np.int64), "parent": np.zeros((r, t), np.int64),
           "source": np.full((r, t), -1, np.int64), "mask": np.zeros((r, t), bool),
           "index": np.full((r, t), -1, np.int64), "real": np.zeros((r, t), bool)}
    out.update({name: np.zeros((r, t), np.float32) for name in per_token})
    for row, members in enumerate(bins):
        col, block = 0, 0
        for m in members:
            g, comp_ids = items[m]
            col, block = _write_item(out, row, col, block, np.asarray(prompts[g]),
                                     [(k, np.asarray(flat[k]), starts[k]) for k in comp_ids],
                                     per_token)
        out["real"][row, :col] = True
        # Padding: a block per position, so each padding query sees only itself.
        out["block"][row, col:] = out["parent"][row, col:] = block + np.arange(t - col)
    out["mask"] = out["source"] >= 0
    return out


def _rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """Items longer than ``row_tokens`` one per row (longest first), then the others packed by
    best-fit decreasing into rows of ``row_tokens``."""
    long = sorted((i for i, n in enumerate(lengths) if n > row_tokens), key=lambda i: -lengths[i])
    short = [i for i, n in enumerate(lengths) if n <= row_tokens]
    bins = pack_bfd([lengths[i] for i in short], row_tokens) if short else []
    return [[i] for i in long] + [[short[j] for j in b] for b in bins]


def _items(prompts: Sequence[np.ndarray], completions: Sequence[Sequence[np.ndarray]],
           max_tokens: int) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """Split groups into items that fit a row: (group, flat completion indices), each item's
    tokens, and every completion's length."""
    items: list[tuple[int, list[int]]] = []
    lengths: list[int] = []
    flat_len: list[int] = []
    for g, (p, comps) in enumerate(zip(prompts, completions, strict=True)):
        if len(p) < 1:
            raise ValueError(f"prompts[{g}]: expected at least 1 token, got 0")
        item: list[int] = []
        used = len(p)
        for i, c in enumerate(comps):
            n = len(c)
            if n < 1:
                raise ValueError(f"completions[{g}][{i}]: expected at least 1 token, got 0")
            if len(p) + n > max_tokens:
                raise ValueError(f"completions[{g}][{i}]: prompt + completion is "
                                 f"{len(p) + n} tokens, more than max_tokens={max_tokens}")
            if item and used + n > max_tokens:
                items.append((g, item))
                lengths.append(used)
                item, used = [], len(p)
            item.append(len(flat_len))
            flat_len.append(n)
            used += n
        if item:
            items.append((g, item))
            lengths.append(used)
    return items, lengths, flat_len


def _write_item(out: dict[str, np.ndarray], row: int, col: int, block: int, prompt: np.ndarray,
                comps: list[tuple[int, np.ndarray, int]],
                per_token: Mapping[str, Sequence[np.ndarray]]) -> tuple[int, int]:
    """Write a prompt and its completions ``(flat index, tokens, flat start)`` at ``col`` of
    ``row``; returns the next free column and block."""
    n_p = len(prompt)
    span = slice(col, col + n_p)
    out["input_ids"][row, span] = prompt
    out["position_ids"][row, span] = np.arange(n_p)
    out["block"][row, span] = out["parent"][row, span] = block
    prompt_block, last = block, col + n_p - 1
    col += n_p
    for k, c, start in comps:
        n = len(c)
        block += 1
        span = slice(col, col + n)
        out["input_ids"][row, span] = c
        out["position_ids"][row, span] = np.arange(n_p, n_p + n)
        out["block"][row, span] = block
        out["parent"][row, span] = prompt_block
        out["source"][row, span] = np.arange(col - 1, col + n - 1)
        out["source"][row, col] = last  # the first token: predicted from the prompt's end
        out["index"][row, span] = np.arange(start, start + n)
        for name, arrays in per_token.items():
            out[name][row, span] = arrays[k]
        col += n
    return col, block + 1


def shared_prefix_mask(block: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """The attention mask of :func:`pack_shared_prefix` rows: ``bool[R, 1, T, T]``, True where
    query ``q`` may attend to key ``k`` (``k <= q`` and ``block[k]`` is ``block[q]`` or
    ``parent[q]``). Memory: ``R * T * T`` bytes. Accepts numpy arrays or torch tensors
    (``int[R, T]``) and returns the same kind.

    Pass it as ``attention_mask`` to a Hugging Face model with ``attn_implementation="sdpa"``;
    for ``"eager"`` convert it to an additive float mask (0 where True, ``finfo.min`` else).
    """
    k_block = block[:, None, :]
    allowed = (k_block == block[:, :, None]) | (k_block == parent[:, :, None])
    t = block.shape[1]
    if isinstance(block, np.ndarray):
        return (allowed & np.tril(np.ones((t, t), dtype=bool)))[:, None]
    import torch

    causal = torch.ones((t, t), dtype=torch.bool, device=block.device).tril()
    return (allowed & causal)[:, None]
