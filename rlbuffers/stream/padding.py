"""Collate rows of token sequences into padded arrays (dynamic padding, packed rows) and the
block-diagonal causal mask for attention implementations without varlen support.

Layout of a batch (a :class:`~rlbuffers.stream.batch.StreamBatch`: a dict of arrays, plus
two attributes) of ``B`` rows padded to ``T`` tokens (a row holds one sequence when padding,
several when packing):

- ``input_ids: int64[B, T]``: the row's sequences back to back, then ``pad_token_id``.
- ``labels: int64[B, T]``: ``input_ids`` (unshifted, HF convention: the model shifts) with
  ``-100`` at padding and at the first position of every sequence, so no token is predicted
  across a sequence boundary.
- ``position_ids: int64[B, T]``: ``0, 1, ...`` restarting at every sequence; the padding tail of
  a row counts as one more segment (restarting at 0).
- ``cu_seqlens: int32[S + 1]``: segment boundaries in the flattened ``B * T`` token stream
  (flash-attention varlen layout); segments are the sequences plus each row's padding tail, so
  ``cu_seqlens[-1] == B * T`` and ``cu_seqlens[:-1]`` are exactly the flat positions where
  ``position_ids == 0``.
- ``attention_mask`` (optional): ``int64[B, T]`` 1 = token, 0 = padding (``"padding"``), or
  ``bool[B, 1, T, T]`` block-diagonal causal, True = may attend (``"block_causal"``).

Attributes, not entries (so every entry is an array and ``{k: v.to(device) for k, v in
batch.items()}`` works):

- ``batch.max_seqlen: int``: the longest segment in ``cu_seqlens`` (padding tails included).
- ``batch.stats: dict``: ``num_sequences``, ``num_tokens`` (real tokens), ``padding_fraction``
  (padding / ``B * T``), ``packing_efficiency`` (real tokens / (``B * max_length``)),
  ``truncated_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from rlbuffers.intmath import round_up
from rlbuffers.stream.batch import StreamBatch

AttentionKind = Literal["none", "padding", "block_causal"]
IGNORE_INDEX = -100


def padded_length(longest: int, *, pad_to_multiple_of: int | None = None,
                  pad_to: int | None = None) -> int:
    """The padded row length: ``pad_to`` when given (fixed padding), else ``longest`` rounded
    up to a multiple of ``pad_to_multiple_of``.

    Raises:
        ValueError: ``pad_to`` < ``longest``.
    """
    if pad_to is not None:
        if pad_to < longest:
            raise ValueError(f"pad_to: expected >= the longest row ({longest}), got {pad_to}")
        return int(pad_to)
    m = pad_to_multiple_of or 1
    return int(round_up(longest, m))


def collate(rows: Sequence[Sequence[np.ndarray]], *, pad_token_id: int,
            max_length: int | None = None, pad_to: int | None = None,
            pad_to_multiple_of: int | None = None, attention: AttentionKind = "none",
            truncated_tokens: int = 0, counters: dict[str, int] | None = None
            ) -> StreamBatch:
    """One batch from ``rows`` (each a list of ``int[n]`` token arrays placed back to back);
    see the module docstring for the keys, shapes and dtypes, and the attributes
    ``max_seqlen`` and ``stats``.

    Args:
        max_length: the row capacity used for ``packing_efficiency`` (default: ``T``).
        pad_to: pad every row to exactly this many tokens (fixed padding).
        pad_to_multiple_of: otherwise pad to the longest row rounded up to this multiple.
        attention: which ``attention_mask`` to add, if any.
        truncated_tokens: reported in ``stats``.
        counters: more counts to report in ``stats`` (``truncated_tokens`` among them
            overrides the argument).

    Raises:
        ValueError: no rows, an empty row, or a row longer than ``pad_to``.
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("rows: expected at least one row, each with at least one sequence")
    row_lens = [[len(s) for s in row] for row in rows]
    totals = [sum(ls) for ls in row_lens]
    t = padded_length(max(totals), pad_to_multiple_of=pad_to_multiple_of, pad_to=pad_to)
    b = len(rows)
    input_ids = np.full((b, t), pad_token_id, dtype=np.int64)
    position_ids = np.empty((b, t), dtype=np.int64)
    seg_lens: list[int] = []
    for r, (row, lens, n) in enumerate(zip(rows, row_lens, totals, strict=True)):
        input_ids[r, :n] = np.concatenate(row) if len(row) > 1 else row[0]
        starts = np.cumsum([0, *lens[:-1]])
        position_ids[r, :n] = np.arange(n) - np.repeat(starts, lens)
        position_ids[r, n:] = np.arange(t - n)
        seg_lens += lens if n == t else [*lens, t - n]
    is_pad = np.arange(t)[None, :] >= np.asarray(totals)[:, None]
    labels = input_ids.copy()
    labels[(position_ids == 0) | is_pad] = IGNORE_INDEX
    cu = np.zeros(len(seg_lens) + 1, dtype=np.int32)
    np.cumsum(seg_lens, out=cu[1:])
    real = int(sum(totals))
    batch = StreamBatch({"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                         "cu_seqlens": cu}, max_seqlen=max(seg_lens))
    if attention == "padding":
        batch["attention_mask"] = (~is_pad).astype(np.int64)
    elif attention == "block_causal":
        batch["attention_mask"] = block_causal_mask(position_ids)
    elif attention != "none":
        raise ValueError("attention: expected 'none', 'padding' or 'block_causal', "
                         f"got {attention!r}")
    batch.stats = {
        "num_sequences": int(sum(len(r) for r in rows)), "num_tokens": real,
        "padding_fraction": 1.0 - real / (b * t),
        "packing_efficiency": real / (b * (max_length or t)),
        "truncated_tokens": int(truncated_tokens),
    }
    if counters:
        batch.stats.update(counters)
    return batch


def block_causal_mask(position_ids: np.ndarray) -> np.ndarray:
    """Block-diagonal causal mask from ``position_ids: int[B, T]`` (a segment starts wherever
    the position is 0): ``bool[B, 1, T, T]``, ``mask[b, 0, i, j]`` is True when token ``j`` is
    in the same segment as token ``i`` and ``j <= i``. Memory: ``B * T * T`` bytes.

    Pass it as ``attention_mask`` to an HF model with ``attn_implementation="sdpa"``; for
    ``"eager"`` convert it to an additive float mask (0 where True, ``finfo.min`` elsewhere).
    """
    pos = np.asarray(position_ids)
    seg = np.cumsum(pos == 0, axis=1)
    same = seg[:, :, None] == seg[:, None, :]
    t = pos.shape[1]
    causal = np.tril(np.ones((t, t), dtype=bool))
    return (same & causal)[:, None, :, :]
