"""Best-fit-decreasing (BFD) bin packing of token sequences into rows of ``max_length`` tokens.

Algorithm: BFD bin packing (Johnson 1973, "Near-optimal bin packing algorithms"; worst case
11/9 OPT + 4 bins), as applied to LM training data by Ding et al. 2024, "Fewer Truncations
Improve Language Modeling" (ICML; best-fit packing of document chunks). Sequences are taken
longest first; each goes into the open bin with the *smallest* remaining capacity that still
fits it, or opens a new bin.

Data structure: ``buckets[c]`` holds the bins whose remaining capacity is exactly ``c``
(0 <= c < max_length, integers), and ``caps`` is the sorted list of capacities with a
non-empty bucket. "Smallest capacity >= n" is one ``bisect`` (O(log L) comparisons, L =
max_length). Adding or removing a capacity from ``caps`` is a C ``memmove`` over at most L
entries (O(L) machine words in the worst case, in practice a few hundred bytes), so a window
of N sequences costs O(N log N) for the sort plus O(N log L) comparisons and O(N L) bytes moved
at worst. Capacities smaller than the shortest sequence of the window are never re-opened.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np


def pack_bfd(lengths: Sequence[int] | np.ndarray, max_length: int) -> list[list[int]]:
    """Pack sequences of the given ``lengths`` (tokens, int[N]) into bins of ``max_length``
    tokens with best-fit decreasing.

    Returns:
        bins: a list of bins, each the list of indices into ``lengths`` it holds, in
        placement order (longest first). Every index appears in exactly one bin; no bin's
        total exceeds ``max_length``. Deterministic: ties keep input order.

    Raises:
        ValueError: ``max_length`` < 1, or a length outside ``[1, max_length]`` (index named).
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if max_length < 1:
        raise ValueError(f"max_length: expected >= 1, got {max_length}")
    if lens.size == 0:
        return []
    if lens.min() < 1 or lens.max() > max_length:
        bad = int(np.flatnonzero((lens < 1) | (lens > max_length))[0])
        raise ValueError(f"lengths[{bad}]: expected 1 <= length <= {max_length}, got {lens[bad]}")
    order = np.argsort(-lens, kind="stable").tolist()
    return _bfd_loop(order, lens.tolist(), int(max_length), int(lens.min()))


def _bfd_loop(order: list[int], lens: list[int], max_length: int, min_len: int) -> list[list[int]]:
    bins: list[list[int]] = []
    buckets: list[list[int]] = [[] for _ in range(max_length + 1)]
    caps: list[int] = []
    for idx in order:
        n = lens[idx]
        i = bisect_left(caps, n)
        if i == len(caps):
            b = len(bins)
            bins.append([idx])
            rem = max_length - n
        else:
            c = caps[i]
            bucket = buckets[c]
            b = bucket.pop()
            if not bucket:
                del caps[i]
            bins[b].append(idx)
            rem = c - n
        if rem >= min_len:
            bucket = buckets[rem]
            if not bucket:
                insort(caps, rem)
            bucket.append(b)
    return bins


def fit_sequences(seqs: list[np.ndarray], max_length: int, overflow: str
                  ) -> tuple[list[np.ndarray], dict[int, dict[str, int]]]:
    """Make every sequence fit ``max_length`` tokens, and say what that did to each piece.

    ``overflow="split"`` cuts a long sequence into consecutive pieces of ``max_length`` tokens
    (the last one shorter; no token lost; each piece is a sequence of its own), ``"truncate"``
    keeps its first ``max_length`` tokens. Empty sequences are dropped.

    Returns:
        (pieces, notes): the fitted sequences in order, and for the pieces that were changed,
        ``index -> counts``: ``truncated_tokens`` (tokens cut off that sequence),
        ``documents_split`` (1 on the first piece of a split sequence) and
        ``split_extra_pieces`` (1 on every later piece).

    Raises:
        ValueError: ``overflow`` is neither ``"split"`` nor ``"truncate"``.
    """
    if overflow not in ("split", "truncate"):
        raise ValueError(f"overflow: expected 'split' or 'truncate', got {overflow!r}")
    out: list[np.ndarray] = []
    notes: dict[int, dict[str, int]] = {}
    for s in seqs:
        n = len(s)
        if n <= max_length:
            if n:
                out.append(s)
        elif overflow == "truncate":
            notes[len(out)] = {"truncated_tokens": n - max_length}
            out.append(s[:max_length])
        else:
            notes[len(out)] = {"documents_split": 1}
            for i in range(0, n, max_length):
                if i:
                    notes[len(out)] = {"split_extra_pieces": 1}
                out.append(s[i:i + max_length])
    return out, notes


def split_overflow(seqs: list[np.ndarray], max_length: int, overflow: str
                   ) -> tuple[list[np.ndarray], int]:
    """:func:`fit_sequences` with only the total of truncated tokens.

    Returns:
        (sequences, truncated_tokens): the fitted sequences in order, and tokens dropped.

    Raises:
        ValueError: ``overflow`` is neither ``"split"`` nor ``"truncate"``.
    """
    out, notes = fit_sequences(seqs, max_length, overflow)
    return out, sum(n.get("truncated_tokens", 0) for n in notes.values())
