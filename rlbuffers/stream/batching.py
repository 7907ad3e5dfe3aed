"""Batching stages: sequence packing into fixed-length rows, and dynamic padding with a fixed
batch size or a token budget (length bucketing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers.intmath import round_up
from rlbuffers.stream.batch import StreamBatch
from rlbuffers.stream.packing import fit_sequences, pack_bfd
from rlbuffers.stream.stages import Stage, WindowStage


@dataclass
class Row:
    """One packed row: ``sequences`` (``int32[n_i]`` each, summing to <= max_length tokens)
    and what fitting them to ``max_length`` did (see
    :func:`~rlbuffers.stream.packing.fit_sequences`): tokens truncated from its sequences,
    split documents whose first piece it holds, and later pieces it holds."""

    sequences: list[np.ndarray]
    truncated_tokens: int = 0
    documents_split: int = 0
    split_extra_pieces: int = 0

    def counts(self) -> dict[str, int]:
        """The row's counters as a dict."""
        return {"truncated_tokens": self.truncated_tokens,
                "documents_split": self.documents_split,
                "split_extra_pieces": self.split_extra_pieces}


def add_counts(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Add ``more`` into ``total`` key by key (in place); returns ``total``."""
    for k, v in more.items():
        total[k] = total.get(k, 0) + v
    return total


def _notes_of(indices: list[int], notes: dict[int, dict[str, int]]) -> dict[str, int]:
    counts: dict[str, int] = {"truncated_tokens": 0, "documents_split": 0,
                              "split_extra_pieces": 0}
    if notes:
        for i in indices:
            note = notes.get(i)
            if note:
                add_counts(counts, note)
    return counts


class Pack(WindowStage):
    """Packs every ``packing_window_sequences`` token sequences into rows of ``max_length``
    tokens with best-fit decreasing (:func:`~rlbuffers.stream.packing.pack_bfd`); sequences
    longer than ``max_length`` are split or truncated first (``overflow``). Rows are emitted in
    a seeded random order, so batch composition is not sorted by length.

    Memory: one window of sequences. Resume: re-reads and re-packs one window.
    """

    kind = "pack"

    def __init__(self, upstream: Stage, *, max_length: int, packing_window_sequences: int,
                 overflow: str = "split", seed: int = 0, epoch: int = 0,
                 read_ahead_windows: int = 0) -> None:
        super().__init__(upstream, packing_window_sequences, seed=seed, epoch=epoch, salt=3,
                         read_ahead_windows=read_ahead_windows)
        self.max_length = int(max_length)
        self.overflow = overflow

    def process(self, items: list[Any], rng: np.random.Generator) -> list[Any]:
        seqs, notes = fit_sequences(items, self.max_length, self.overflow)
        bins = pack_bfd([len(s) for s in seqs], self.max_length)
        rows = []
        for k in rng.permutation(len(bins)):
            row = Row([seqs[i] for i in bins[k]])
            if notes:
                c = _notes_of(bins[k], notes)
                row.truncated_tokens = c["truncated_tokens"]
                row.documents_split = c["documents_split"]
                row.split_extra_pieces = c["split_extra_pieces"]
            rows.append(row)
        return rows


class RowBatch(WindowStage):
    """Groups ``rows_per_batch`` packed :class:`Row` s into one batch with ``collate_fn``."""

    kind = "row_batch"
    needs_rng = False

    cut_at_pass_end = False  # keeps order: a batch may hold the last and first rows of 2 passes

    def __init__(self, upstream: Stage, rows_per_batch: int,
                 collate_fn: Callable[[list[list[np.ndarray]], dict[str, int]], StreamBatch]
                 ) -> None:
        super().__init__(upstream, rows_per_batch, salt=4)
        self.collate_fn = collate_fn

    def process(self, items: list[Any], rng: np.random.Generator) -> list[Any]:
        return [items]

    def emit(self, output: list[Row]) -> StreamBatch:
        counts: dict[str, int] = {}
        for r in output:
            add_counts(counts, r.counts())
        return self.collate_fn([r.sequences for r in output], counts)


def budget_batches(lengths: list[int], *, max_tokens: int | None, batch_size: int | None,
                   pad_to_multiple_of: int | None = None) -> list[list[int]]:
    """Cut consecutive indices ``0..N-1`` into batches: at most ``batch_size`` sequences, and
    ``count * padded(longest)`` <= ``max_tokens`` (the token budget of the padded batch).
    A single sequence over the budget gets a batch of its own.
    """
    m = pad_to_multiple_of or 1
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        padded = round_up(new_longest, m)
        too_many = batch_size is not None and len(cur) >= batch_size
        too_big = max_tokens is not None and padded * (len(cur) + 1) > max_tokens
        if cur and (too_many or too_big):
            out.append(cur)
            cur, new_longest = [], n
        cur.append(i)
        longest = new_longest
    if cur:
        out.append(cur)
    return out


class PadBatch(WindowStage):
    """Dynamic padding: reads ``bucket_window_sequences`` sequences, fits them to
    ``max_length`` (``overflow``), optionally sorts them by length (length bucketing, so a batch
    holds similar lengths and little padding), cuts batches by ``batch_size`` and/or the token
    budget ``max_tokens`` (tokens of the padded batch), shuffles the batch order (seeded) when
    sorted, and collates each with ``collate_fn``.
    """

    kind = "pad_batch"

    def __init__(self, upstream: Stage, *, max_length: int, bucket_window_sequences: int,
                 batch_size: int | None, max_tokens: int | None, sort_by_length: bool,
                 overflow: str, pad_to_multiple_of: int | None,
                 collate_fn: Callable[[list[list[np.ndarray]], dict[str, int]], StreamBatch],
                 seed: int = 0, epoch: int = 0, read_ahead_windows: int = 0) -> None:
        super().__init__(upstream, bucket_window_sequences, seed=seed, epoch=epoch, salt=5,
                         read_ahead_windows=read_ahead_windows)
        self.max_length = int(max_length)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.sort_by_length, self.overflow = sort_by_length, overflow
        self.pad_to_multiple_of = pad_to_multiple_of
        self.collate_fn = collate_fn

    def process(self, items: list[Any], rng: np.random.Generator) -> list[Any]:
        seqs, notes = fit_sequences(items, self.max_length, self.overflow)
        order = list(range(len(seqs)))
        if self.sort_by_length:
            order = np.argsort([len(s) for s in seqs], kind="stable").tolist()
        groups = budget_batches([len(seqs[i]) for i in order], max_tokens=self.max_tokens,
                                batch_size=self.batch_size,
                                pad_to_multiple_of=self.pad_to_multiple_of)
        if self.sort_by_length:
            groups = [groups[i] for i in rng.permutation(len(groups))]
        out = []
        for g in groups:
            members = [order[i] for i in g]
            out.append(([[seqs[i]] for i in members], _notes_of(members, notes)))
        return out

    def emit(self, output: tuple[list[list[np.ndarray]], dict[str, int]]) -> StreamBatch:
        return self.collate_fn(*output)
