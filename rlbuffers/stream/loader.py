"""The resumable streaming loader: source -> tokenize -> shuffle -> pack or pad -> batches,
in-process or across torch DataLoader workers, with an exact ``state_dict``.

Exact resume: stopping after ``k`` batches, saving :meth:`StreamLoader.state_dict` (plain
data, JSON round-trip safe) and loading it into a loader built with the same arguments yields
exactly the batches an uninterrupted run yields from batch ``k + 1`` on. The work to resume is
one window per stage (tokenize batch, shuffle block, packing window) plus skipping into one
shard, whatever the position in the epoch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rlbuffers.stream.batch import StreamBatch
from rlbuffers.stream.batching import Pack, PadBatch, RowBatch, add_counts
from rlbuffers.stream.config import Packing, Padding, StreamConfig
from rlbuffers.stream.errors import StreamStateError
from rlbuffers.stream.padding import collate
from rlbuffers.stream.reading import resolve_shards, shard_table
from rlbuffers.stream.sources import IndexSource, ShardSource
from rlbuffers.stream.stages import BlockShuffle, Count, Marker, Stage
from rlbuffers.stream.state_schema import state_counters, state_dict_of, state_int, state_list
from rlbuffers.stream.tokenize import TextTokenizer, Tokenize
from rlbuffers.stream.workers import worker_loader

logger = logging.getLogger(__name__)

STATE_VERSION = 2
"""Version 2 added ``data`` (the shard-set fingerprint) and ``counters``."""


SKIP_COUNTERS = ("skipped_malformed", "skipped_unreadable", "shards_cut")
"""Counted by the source and the tokenizer (markers), reported with the next batch."""
COUNTERS = (*SKIP_COUNTERS, "documents_split", "split_extra_pieces", "truncated_tokens")
"""Every counter a batch's ``stats`` and the loader's state carry."""


def _collate(cfg: StreamConfig, rows: list[list[Any]], counts: dict[str, int]
             ) -> StreamBatch:
    pad = cfg.batching if isinstance(cfg.batching, Padding) else None
    return collate(rows, pad_token_id=cfg.pad_token_id, max_length=cfg.max_length,
                   pad_to=cfg.max_length if pad is not None and pad.fixed_padding else None,
                   pad_to_multiple_of=pad.pad_to_multiple_of if pad is not None else None,
                   attention=cfg.attention_kind, counters=counts)


def build_pipeline(source: Stage, tokenizer: TextTokenizer | None, cfg: StreamConfig, *,
                   epoch: int = 0) -> Stage:
    """The batch stages over ``source``: tokenize -> block shuffle (of token arrays) -> pack +
    row batches, or pad batches. Tokenizing before the shuffle feeds the tokenizer texts in
    shard order, which its word cache serves faster. Yields batches
    (:class:`~rlbuffers.stream.batch.StreamBatch`, see :mod:`rlbuffers.stream.padding`).
    Read-ahead threads are set in the stages' constructors from ``cfg.read_ahead_*``."""
    stage: Stage = Tokenize(source, tokenizer, text_field=cfg.text_field,
                            tokenize_batch_texts=cfg.tokenize_batch_texts,
                            read_ahead_windows=cfg.read_ahead_tokenize_batches,
                            on_error=cfg.on_error)
    if cfg.shuffle_buffer_samples > 1:
        stage = BlockShuffle(stage, cfg.shuffle_buffer_samples, seed=cfg.seed, epoch=epoch)
    collate_fn = functools.partial(_collate, cfg)
    b = cfg.batching
    if isinstance(b, Packing):
        pack = Pack(stage, max_length=cfg.max_length,
                    packing_window_sequences=b.packing_window_sequences, overflow=cfg.overflow,
                    seed=cfg.seed, epoch=epoch, read_ahead_windows=cfg.read_ahead_batch_windows)
        return RowBatch(pack, b.rows_per_batch, collate_fn)
    return PadBatch(stage, max_length=cfg.max_length,
                    bucket_window_sequences=b.bucket_window_sequences, batch_size=b.batch_size,
                    max_tokens=b.max_tokens, sort_by_length=b.sort_by_length,
                    overflow=cfg.overflow, pad_to_multiple_of=b.pad_to_multiple_of,
                    collate_fn=collate_fn, seed=cfg.seed, epoch=epoch,
                    read_ahead_windows=cfg.read_ahead_batch_windows)


@dataclass(frozen=True)
class _SourceFactory:
    """Builds the source of one slot (picklable, for DataLoader workers)."""

    urls: tuple[str, ...] | None
    """Shard URLs, or None for a sequence source."""
    data: Sequence[Any]
    """The sequence (unused, ``()``, for shards)."""
    cfg: StreamConfig
    table: tuple[tuple[Any, ...], ...] = ()
    """``(name, samples, bytes)`` per shard (see :func:`~rlbuffers.stream.shards.shard_table`)."""

    @classmethod
    def for_shards(cls, shards: Any, cfg: StreamConfig) -> _SourceFactory:
        urls = tuple(resolve_shards(shards))
        return cls(urls, (), cfg, tuple(tuple(row) for row in shard_table(urls)))

    def identity(self) -> dict[str, Any]:
        """What the data is, for the state: the shard table and its digest, or the length of
        the sequence (and its token count when it has one, as a TokenStore does)."""
        if self.urls is None:
            return {"kind": "sequence", "items": len(self.data),
                    "tokens": getattr(self.data, "num_tokens", None)}
        rows = [list(r) for r in self.table]
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
        return {"kind": "shards", "count": len(rows), "sha256": digest, "shards": rows}

    def __call__(self, slot: int, num_slots: int, first_pass: int, cycle: bool) -> Stage:
        c = self.cfg
        if self.urls is not None:
            counts = {u: r[1] for u, r in zip(self.urls, self.table, strict=True)
                      if r[1] is not None}
            return ShardSource(self.urls, seed=c.seed, slot=slot, num_slots=num_slots,
                               first_pass=first_pass, cycle=cycle, shuffle_shards=c.shuffle_shards,
                               uneven=c.uneven_shards, on_error=c.on_error,
                               expected_samples=counts, markers=True,
                               max_record_bytes=c.max_record_bytes)
        return IndexSource(self.data, seed=c.seed, shuffle=c.shuffle_shards, slot=slot,
                           num_slots=num_slots, first_pass=first_pass, cycle=cycle,
                           uneven=c.uneven_shards, markers=True)


def _data_difference(mine: dict[str, Any], theirs: Any) -> str | None:
    """Where the state's data identity ``theirs`` differs from ``mine`` (None: the same)."""
    if not isinstance(theirs, dict):
        return f"state 'data': expected {mine.get('kind')!r} data, got {theirs!r}"
    for key in ("kind", "count", "items", "tokens"):
        if theirs.get(key) != mine.get(key):
            return (f"state 'data.{key}': expected {mine.get(key)!r} (this loader), got "
                    f"{theirs.get(key)!r}: the state belongs to another data set")
    shards = theirs.get("shards") or []
    if theirs.get("sha256") == mine.get("sha256") and shards == mine.get("shards", shards):
        return None
    if not isinstance(shards, list):
        return (f"state 'data.shards': expected a list of [name, samples, bytes], got "
                f"{type(shards).__name__} {shards!r:.60}")
    for i, (a, b) in enumerate(zip(mine.get("shards", []), shards, strict=False)):
        if a != b:
            return (f"state 'data.shards[{i}]': expected [name, samples, bytes] {a} (this "
                    f"loader), got {b}: the state belongs to another shard set")
    return "state 'data.sha256': the shard table differs from this loader's"


class StreamLoader:
    """Batches of token ids streamed from shards (or any indexable sequence), resumable.

    Use :meth:`from_shards` or :meth:`from_sequence`. Iterating yields one epoch of batches
    (:class:`~rlbuffers.stream.batch.StreamBatch`): dicts of arrays only (``input_ids:
    int64[B, T]`` etc., see :mod:`rlbuffers.stream.padding`; torch tensors when ``as_torch``)
    with ``max_seqlen`` and ``stats`` as attributes. With ``num_workers > 0`` a
    ``torch.utils.data.DataLoader`` runs the pipeline in forked worker processes, each worker
    on its own shards.

    Args:
        rank, world_size: this process's data-parallel rank; shards are split over
            ``world_size * max(num_workers, 1)`` slots (see ``StreamConfig.uneven_shards``).
        num_workers: DataLoader worker processes (0: in this process).
        as_torch: yield ``torch.Tensor`` instead of numpy arrays.

    Raises:
        ValueError: ``world_size > 1`` without ``config.batches_per_epoch`` (ranks would yield
            different numbers of batches), or a rank outside ``[0, world_size)``.
    """

    def __init__(self, factory: _SourceFactory, tokenizer: TextTokenizer | None,
                 config: StreamConfig, *, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, as_torch: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        if world_size > 1 and config.batches_per_epoch is None:
            raise ValueError("StreamConfig.batches_per_epoch: expected an int when world_size > 1 "
                             "(so every rank yields the same number of batches), got None")
        self._factory, self.tokenizer, self.config = factory, tokenizer, config
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.as_torch = as_torch
        self._slots_n = max(num_workers, 1)
        self._data = factory.identity()
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._reset_epoch(0)
        self._live: dict[int, tuple[Stage, Iterator[Any]]] = {}

    @classmethod
    def from_shards(cls, shards: Any, tokenizer: TextTokenizer, config: StreamConfig,
                    **kwargs: Any) -> StreamLoader:
        """Loader over webdataset shards (directory, glob, brace pattern, URL or a list; see
        :func:`~rlbuffers.stream.resolve_shards`); ``kwargs`` as for the class."""
        return cls(_SourceFactory.for_shards(shards, config), tokenizer, config, **kwargs)

    @classmethod
    def from_sequence(cls, data: Sequence[Any], tokenizer: TextTokenizer | None,
                      config: StreamConfig, **kwargs: Any) -> StreamLoader:
        """Loader over an indexable sequence of texts (``str``) or token arrays (``int[n]``,
        e.g. a :class:`~rlbuffers.stream.TokenStore`; ``tokenizer`` may then be ``None``)."""
        return cls(_SourceFactory(None, data, config), tokenizer, config, **kwargs)

    # -- epochs and slots -------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    def _reset_epoch(self, epoch: int) -> None:
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._epoch = epoch
        self._batches = 0
        self._last_slot = -1
        self._slot_batches = [0] * self._slots_n
        if self.config.batches_per_epoch is None or epoch == 0:
            self._states: list[dict[str, Any] | None] = [None] * self._slots_n

    def _quota(self, slot: int) -> int | None:
        n = self.config.batches_per_epoch
        if n is None:
            return None
        return n // self._slots_n + (slot < n % self._slots_n) - self._slot_batches[slot]

    def _build(self, slot: int, state: dict[str, Any] | None = None,
               epoch: int | None = None) -> Stage:
        """The pipeline of ``slot`` (default: at this loader's epoch and saved state)."""
        if epoch is None:
            epoch, state = self._epoch, self._states[slot]
        cycle = self.config.batches_per_epoch is not None
        source = self._factory(self.rank * self._slots_n + slot, self.world_size * self._slots_n,
                               0 if cycle else epoch, cycle)
        pipe = build_pipeline(source, self.tokenizer, self.config,
                              epoch=0 if cycle else epoch)
        if state is not None:
            pipe.load_state_dict(state)
        return pipe

    def __iter__(self) -> Iterator[StreamBatch]:
        items = self._iter_workers() if self.num_workers else self._iter_local()
        for item in items:
            if isinstance(item, Count):  # counted after the epoch's last batch
                self._count(item.counts)
                continue
            self._count(item.stats)
            self._batches += 1
            yield self._to_torch(item) if self.as_torch else item
        self._end_epoch()

    def _count(self, counts: dict[str, Any]) -> None:
        for key in COUNTERS:
            n = counts.get(key, 0)
            self._counts[key] += n
            self._totals[key] += n

    def _end_epoch(self) -> None:
        c = self._counts
        if not self._batches:
            logger.warning("epoch %d yielded no batches (empty shards or sequence?)", self._epoch)
        level = logging.WARNING if c["shards_cut"] or c["skipped_malformed"] else logging.INFO
        logger.log(level, "epoch %d: %d batches; skipped %d malformed samples, %d shards cut "
                   "short (%d samples lost); %d documents split into %d extra pieces; %d tokens "
                   "truncated", self._epoch, self._batches, c["skipped_malformed"],
                   c["shards_cut"], c["skipped_unreadable"], c["documents_split"],
                   c["split_extra_pieces"], c["truncated_tokens"])
        self._reset_epoch(self._epoch + 1)

    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """``{"epoch": {...}, "total": {...}}``: samples skipped (``skipped_malformed``,
        ``skipped_unreadable``: lost with the rest of a cut shard when its count is known),
        ``shards_cut``, ``documents_split``, ``split_extra_pieces`` and ``truncated_tokens``,
        for the current epoch and since the start of training (kept in the state)."""
        return {"epoch": dict(self._counts), "total": dict(self._totals)}

    def _run(self, slot: int, items: Iterator[Any]) -> Iterator[Any]:
        """The quota runner, shared by the in-process and the DataLoader-worker paths: yields
        the batches of ``slot`` for this epoch, at most its quota (see :meth:`_quota`), each
        with the counts of the markers read before it added to its ``stats`` (a last
        :class:`Count` with the ones read after the epoch's last batch). Without
        ``batches_per_epoch`` the epoch ends with the data. With it, the source cycles over
        passes and never ends unless the data yields no batches at all; running out before
        the quota then raises, in both paths, since a rank that yields fewer batches than
        the others would hang a collective operation.

        Raises:
            StreamStateError: ``batches_per_epoch`` is set and the data ran out first.
        """
        quota = self._quota(slot)
        count = 0
        pending: dict[str, int] = {}
        while quota is None or count < quota:
            item = next(items, None)
            if isinstance(item, Marker):
                if isinstance(item, Count):
                    add_counts(pending, item.counts)
                continue
            if item is None:
                if quota is not None:
                    raise StreamStateError(
                        f"StreamConfig.batches_per_epoch={self.config.batches_per_epoch}: rank "
                        f"{self.rank} slot {slot} expected {quota} more batches this epoch, but "
                        f"the data ran out after {count} (does it yield any batch at all?)")
                if pending:
                    yield Count(pending)
                return
            stats = item.stats
            for key in SKIP_COUNTERS:
                stats[key] = stats.get(key, 0) + pending.pop(key, 0)
            count += 1
            yield item

    def _run_slot(self, slot: int) -> Iterator[tuple[Any, dict[str, Any]]]:
        """``slot``'s pipeline through the quota runner, each item with the pipeline's state
        after it: what a DataLoader worker runs (see :mod:`rlbuffers.stream.workers`)."""
        pipe = self._build(slot)
        for item in self._run(slot, iter(pipe)):
            yield item, pipe.state_dict()

    def _iter_local(self) -> Iterator[Any]:
        if 0 not in self._live:
            pipe = self._build(0)
            self._live[0] = (pipe, iter(pipe))
        pipe, it = self._live[0]
        for item in self._run(0, it):
            if not isinstance(item, Count):
                self._slot_batches[0] += 1
                self._last_slot = 0
            yield item
        self._states[0] = pipe.state_dict()
        if self.config.batches_per_epoch is None:
            self._live.clear()

    def _iter_workers(self) -> Iterator[Any]:
        offset = (self._last_slot + 1) % self._slots_n
        for slot, item, state in worker_loader(self._run_slot, offset, self.num_workers):
            self._states[slot] = state
            if not isinstance(item, Count):
                self._slot_batches[slot] += 1
                self._last_slot = slot
            yield item

    @staticmethod
    def _to_torch(batch: StreamBatch) -> StreamBatch:
        return batch.to("cpu")  # torch.from_numpy: no copy

    # -- state -------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        return {**self.config.fingerprint(), "rank": self.rank, "world_size": self.world_size,
                "num_workers": self.num_workers}

    def state_dict(self) -> dict[str, Any]:
        """Plain data: epoch, batches yielded in it, per-slot pipeline states (source cursor:
        pass, shard, sample offset; and per stage: window index, outputs emitted, upstream
        state at the window start), the configuration and the data it belongs to (``data``:
        the shard table ``[name, samples, bytes]`` per shard and its SHA-256, or the length of
        a sequence)."""
        states = list(self._states)
        if 0 in self._live:
            states[0] = self._live[0][0].state_dict()
        return {"kind": "stream_loader", "version": STATE_VERSION, "epoch": self._epoch,
                "batches_in_epoch": self._batches, "last_slot": self._last_slot,
                "slot_batches": list(self._slot_batches), "slots": states,
                "config": self._fingerprint(), "data": self._data,
                "counters": self.counters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken, on the next ``iter()``.

        The state is checked against the schema of :mod:`rlbuffers.stream.state_schema`
        (every key's type and range, and each slot's cursor against this loader's shards)
        before anything changes: a state that fails leaves the loader as it was.

        Raises:
            StreamStateError: not a loader state, a key missing, of another type or out of
                range (the key, the expected and the actual value named), or taken with
                another configuration, rank, world size or worker count, or over another
                data set: other shards (names, sample counts or bytes), another order, or a
                sequence of another length (what differs is named). A state over re-sharded
                data is refused too, since no cursor into the old shards maps exactly onto
                the new ones.
        """
        if not isinstance(state, dict) or state.get("kind") != "stream_loader":
            raise StreamStateError("state 'kind': expected 'stream_loader', got "
                                   f"{state.get('kind') if isinstance(state, dict) else state!r}")
        version = state_int(state, "version", "", low=1, high=STATE_VERSION) \
            if "version" in state else 1
        config = state_dict_of(state.get("config"), "config")
        for key, value in self._fingerprint().items():
            if config.get(key) != value:
                raise StreamStateError(f"state 'config.{key}': expected {value!r} (this loader), "
                                       f"got {config.get(key)!r}")
        if version < 2:
            logger.warning("loading a version-1 loader state: it names no data set, so it "
                           "cannot be checked against this loader's shards")
        else:
            differs = _data_difference(self._data, state.get("data"))
            if differs:
                raise StreamStateError(differs)
        n = self._slots_n
        epoch = state_int(state, "epoch", "")
        quota = self.config.batches_per_epoch
        batches = state_int(state, "batches_in_epoch", "", high=quota)
        last_slot = state_int(state, "last_slot", "", low=-1, high=n - 1)
        slot_batches = [state_int({"slot_batches": x}, "slot_batches", "")
                        for x in state_list(state, "slot_batches", "", n)]
        if sum(slot_batches) != batches:
            raise StreamStateError(f"state 'slot_batches': expected a sum of {batches} "
                                   f"(batches_in_epoch), got {slot_batches}")
        slots = state_list(state, "slots", "", n)
        counters = state_dict_of(state.get("counters") or {}, "counters")
        counts = state_counters(counters.get("epoch"), COUNTERS, "counters.epoch")
        totals = state_counters(counters.get("total"), COUNTERS, "counters.total")
        for slot, slot_state in enumerate(slots):  # each cursor against this loader's data
            if slot_state is not None:
                self._build(slot, state_dict_of(slot_state, f"slots[{slot}]"), epoch)
        self._epoch, self._batches, self._last_slot = epoch, batches, last_slot
        self._slot_batches, self._states = slot_batches, list(slots)
        self._counts, self._totals = counts, totals
        self._live.clear()
