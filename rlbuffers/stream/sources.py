"""Checkpointable sources: samples from tar shards (split across ranks and DataLoader workers)
and items of any indexable sequence (a list, a :class:`~rlbuffers.stream.TokenStore`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from rlbuffers.intmath import ceil_div
from rlbuffers.stream.errors import ShardError
from rlbuffers.stream.reading import iter_shard
from rlbuffers.stream.stages import Count, PassEnd, Stage, check_kind
from rlbuffers.stream.state_schema import state_int
from rlbuffers.stream.tario import MAX_RECORD_BYTES

logger = logging.getLogger(__name__)

UnevenPolicy = Literal["drop", "wrap"]


def split_shards(urls: Sequence[str], slot: int, num_slots: int, *,
                 uneven: UnevenPolicy = "wrap") -> list[str]:
    """The shards of ``slot`` out of ``num_slots`` (= world_size x num_workers): every
    ``num_slots``-th shard of ``urls`` starting at ``slot``, after making ``len(urls)`` a
    multiple of ``num_slots`` so that every slot gets the same number of shards:

    - ``"wrap"``: repeat shards from the start of ``urls`` (some shards are read twice);
    - ``"drop"``: leave out the last ``len(urls) % num_slots`` shards.

    Pass ``urls`` already shuffled per epoch, so different shards repeat or drop each epoch.

    Raises:
        ShardError: no shards, or ``"drop"`` with fewer shards than slots.
        ValueError: ``slot`` outside ``[0, num_slots)`` or an unknown policy.
    """
    if not 0 <= slot < num_slots:
        raise ValueError(f"slot: expected 0 <= slot < {num_slots}, got {slot}")
    if uneven not in ("drop", "wrap"):
        raise ValueError(f"uneven: expected 'drop' or 'wrap', got {uneven!r}")
    n = len(urls)
    if n == 0:
        raise ShardError("shards: expected at least one shard, got none")
    extra = n % num_slots
    if extra and uneven == "drop":
        if n < num_slots:
            raise ShardError(f"uneven='drop': {n} shards cannot feed {num_slots} slots "
                             "(world_size x num_workers); use uneven='wrap' or more shards")
        urls = list(urls[: n - extra])
    elif extra:
        urls = [urls[i % n] for i in range(n + num_slots - extra)]
    return list(urls[slot::num_slots])


class ShardSource(Stage):
    """Samples of the shards ``urls``: per pass, the shard list is shuffled with
    ``np.random.default_rng([seed, pass])`` (identical on every rank), split with
    :func:`split_shards` and this slot's shards are read in order.

    Args:
        urls: shard URLs (see :func:`~rlbuffers.stream.resolve_shards`).
        slot, num_slots: this reader's slot, ``rank * num_workers + worker`` of
            ``world_size * num_workers``.
        first_pass: the pass to start at (the loader passes the epoch).
        cycle: continue with the next pass when this one ends (an infinite stream), with a
            :class:`~rlbuffers.stream.stages.PassEnd` marker between passes.
        shuffle_shards: shuffle the shard order per pass.
        uneven: policy when the shard count is not a multiple of ``num_slots``
            (logged once at WARNING).
        on_error: ``"raise"`` a :class:`ShardError`, or ``"warn"``: log it, skip the rest of
            that shard and count it (a ``Count({"shards_cut": 1, "skipped_unreadable": n})``
            marker, ``n`` from the expected count, 0 when unknown).
        expected_samples: samples per shard URL (e.g. from ``shards.json``), checked against
            what each shard yields; ``None``: each shard looks up its own manifest.
        markers: yield :class:`~rlbuffers.stream.stages.Count` and ``PassEnd`` markers among
            the samples (the loader's pipeline counts and cuts windows with them).
        max_record_bytes: largest tar member read (see :func:`~rlbuffers.stream.iter_shard`).

    State: ``{pass, shard, offset}``: shard index in this slot's list and samples read from it.
    """

    def __init__(self, urls: Sequence[str], *, seed: int = 0, slot: int = 0, num_slots: int = 1,
                 first_pass: int = 0, cycle: bool = False, shuffle_shards: bool = True,
                 uneven: UnevenPolicy = "wrap", on_error: Literal["raise", "warn"] = "raise",
                 expected_samples: dict[str, int] | None = None, markers: bool = False,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.urls = list(urls)
        self.max_record_bytes = max_record_bytes
        self.seed = int(seed)
        self.slot, self.num_slots = int(slot), int(num_slots)
        self.cycle = cycle
        self.shuffle_shards = shuffle_shards
        self.uneven: UnevenPolicy = uneven
        self.on_error = on_error
        self.expected_samples = expected_samples
        self.markers = markers
        self._failure: Count | None = None
        self.first_pass = int(first_pass)
        self._pass, self._shard, self._offset = int(first_pass), 0, 0
        split_shards(self.urls, self.slot, self.num_slots, uneven=uneven)  # validate early
        extra = len(self.urls) % self.num_slots
        if extra:
            logger.warning(
                "%d shards do not divide evenly over %d slots (world_size x num_workers): "
                "policy uneven=%r %s %d shard(s) per pass", len(self.urls), self.num_slots,
                uneven, "drops" if uneven == "drop" else "repeats",
                extra if uneven == "drop" else self.num_slots - extra)

    def shards_for_pass(self, pass_index: int) -> list[str]:
        """This slot's shard URLs in pass ``pass_index``."""
        urls = self.urls
        if self.shuffle_shards:
            order = np.random.default_rng([self.seed, pass_index]).permutation(len(urls))
            urls = [urls[i] for i in order]
        return split_shards(urls, self.slot, self.num_slots, uneven=self.uneven)

    def __iter__(self) -> Iterator[Any]:
        while True:
            shards = self.shards_for_pass(self._pass)
            fresh = self._shard == 0 and self._offset == 0
            read = 0
            while self._shard < len(shards):
                url = shards[self._shard]
                for sample in self._read(url):
                    read += 1
                    yield sample
                cut = self._failure
                self._shard, self._offset, self._failure = self._shard + 1, 0, None
                if cut is not None and self.markers:  # after the cursor moved on: never twice
                    yield cut
            if not self.cycle or (fresh and read == 0):
                return  # a whole pass without samples: cycling would spin for ever
            self._pass, self._shard, self._offset = self._pass + 1, 0, 0
            if self.markers:
                yield PassEnd(self._pass - 1)

    def _read(self, url: str) -> Iterator[dict[str, Any]]:
        known = self.expected_samples
        expected = None if known is None else known.get(url)
        try:
            for sample in iter_shard(url, skip_samples=self._offset, expected_samples=expected,
                                     find_manifest=known is None,
                                     max_record_bytes=self.max_record_bytes):
                self._offset += 1
                yield sample
        except ShardError as exn:
            if self.on_error == "raise":
                raise
            lost = max(expected - self._offset, 0) if expected is not None else 0
            logger.warning("skipping the rest of shard %s (%s samples lost): %s", url,
                           lost if expected is not None else "unknown number of", exn)
            self._failure = Count({"shards_cut": 1, "skipped_unreadable": lost})

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "shards", "pass": self._pass, "shard": self._shard,
                "offset": self._offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; checked against this source's shards (see
        :mod:`rlbuffers.stream.state_schema`).

        Raises:
            StreamStateError: a key missing, of another type, or out of range: ``pass`` (this
                source's first pass unless it cycles), ``shard`` (at most the slot's shard
                count in that pass), ``offset`` (at most that shard's known sample count).
        """
        check_kind(state, "shards")
        pass_ = _source_pass(state, "shards", self.first_pass, self.cycle)
        shards = self.shards_for_pass(pass_)
        shard = state_int(state, "shard", "shards", high=len(shards))
        known = (self.expected_samples or {}).get(shards[shard]) if shard < len(shards) else 0
        offset = state_int(state, "offset", "shards", high=known)
        self._pass, self._shard, self._offset = pass_, shard, offset


class IndexSource(Stage):
    """Items of an indexable ``data`` (``len`` and ``data[i]``: a list, a TokenStore), in a
    per-pass permutation (``np.random.default_rng([seed, pass])``) when ``shuffle``, split
    across slots by striding (slot ``s`` gets positions ``s, s + num_slots, ...``; with
    ``uneven='drop'`` every slot gets ``len(data) // num_slots`` items, with ``'wrap'`` the
    permutation wraps around to give every slot the ceiling).

    Resuming is O(1): the state is ``{pass, position}``. ``markers``: a ``PassEnd`` marker
    between passes when cycling (as for :class:`ShardSource`).
    """

    def __init__(self, data: Sequence[Any], *, seed: int = 0, shuffle: bool = True,
                 slot: int = 0, num_slots: int = 1, first_pass: int = 0, cycle: bool = False,
                 uneven: UnevenPolicy = "wrap", markers: bool = False) -> None:
        if len(data) == 0:
            raise ValueError("data: expected at least one item, got an empty sequence")
        self.data = data
        self.seed, self.shuffle = int(seed), shuffle
        self.slot, self.num_slots = int(slot), int(num_slots)
        self.cycle, self.uneven = cycle, uneven
        self.markers = markers
        self.first_pass = int(first_pass)
        self._pass, self._position = int(first_pass), 0

    def _count(self) -> int:
        n, s = len(self.data), self.num_slots
        return n // s if self.uneven == "drop" else ceil_div(n, s)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.data)
        while True:
            order = (np.random.default_rng([self.seed, self._pass]).permutation(n)
                     if self.shuffle else None)
            count = self._count()
            while self._position < count:
                k = (self._position * self.num_slots + self.slot) % n
                self._position += 1
                yield self.data[int(order[k]) if order is not None else k]
            if not self.cycle:
                return
            self._pass, self._position = self._pass + 1, 0
            if self.markers:
                yield PassEnd(self._pass - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "index", "pass": self._pass, "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``.

        Raises:
            StreamStateError: ``pass`` or ``position`` missing, not an int, or out of range
                (``position`` at most this slot's item count).
        """
        check_kind(state, "index")
        pass_ = _source_pass(state, "index", self.first_pass, self.cycle)
        self._pass, self._position = pass_, state_int(state, "position", "index",
                                                      high=self._count())


def _source_pass(state: dict[str, Any], kind: str, first_pass: int, cycle: bool) -> int:
    """The state's ``pass``: the source's first pass, or a later one when it cycles."""
    if cycle:
        return state_int(state, "pass", kind, low=first_pass)
    return state_int(state, "pass", kind, low=first_pass, high=first_pass)
