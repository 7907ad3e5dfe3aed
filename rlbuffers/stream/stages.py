"""Checkpointable pipeline stages.

A stage is an iterable over an upstream stage with a plain-data cursor. The contract:
after the consumer has received ``n`` items, ``state_dict()`` describes exactly that point,
and a stage built the same way that loads it yields item ``n + 1`` onwards.

Windowed stages (shuffle, tokenize, pack, bucket) hold a bounded buffer. They do not put the
buffer into the state; they keep the upstream state at the start of the current window and the
number of outputs already emitted from it. On resume they rewind upstream to the window start,
re-read the window and recompute it (every window's computation is a pure function of its items
and its seed), then skip what was emitted. The work to resume is therefore one window per
stage, whatever the position in the epoch.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rlbuffers.stream.errors import StreamStateError
from rlbuffers.stream.state_schema import state_dict_of, state_int


class Stage(ABC):
    """A checkpointable iterable (see the module docstring for the contract)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Any]: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) describing the current position."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next ``iter()``.

        Raises:
            StreamStateError: the state belongs to another kind of stage.
        """


def check_kind(state: dict[str, Any], kind: str) -> None:
    """Raise :class:`StreamStateError` unless ``state['kind'] == kind``."""
    found = state.get("kind") if isinstance(state, dict) else type(state).__name__
    if found != kind:
        raise StreamStateError(f"state 'kind': expected {kind!r}, got {found!r}")


def stage_rng(seed: int, salt: int, epoch: int, window: int) -> np.random.Generator:
    """The generator for one window of one stage: a pure function of its arguments."""
    return np.random.default_rng([seed, salt, epoch, window])


class Marker:
    """An in-band control item: every stage passes markers on (a windowed stage after its
    window's outputs) and never batches them; the loader consumes them."""

    __slots__ = ()


class Count(Marker):
    """Events to count (``{"skipped_malformed": 1}``, ...): the loader adds them to the stats
    of the next batch it yields and to its own counters."""

    __slots__ = ("counts",)

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def __repr__(self) -> str:
        return f"Count({self.counts})"


class PassEnd(Marker):
    """The end of one pass over a cycling source: shuffling windows end here, so no window
    mixes the items of two passes (see :class:`WindowStage`)."""

    __slots__ = ("pass_index",)

    def __init__(self, pass_index: int) -> None:
        self.pass_index = pass_index

    def __repr__(self) -> str:
        return f"PassEnd({self.pass_index})"


_NO_RNG = np.random.default_rng(0)  # given to stages with needs_rng = False, which ignore it
_END, _ITEM, _ERROR = 0, 1, 2


class _Producer(threading.Thread):
    """Puts the items of an iterator into a bounded queue until done or stopped."""

    def __init__(self, items: Iterator[Any], depth: int) -> None:
        super().__init__(name="rlbuffers-prefetch", daemon=True)
        self.items = items
        self.queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()

    def put(self, entry: tuple[int, Any]) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for item in self.items:
                if not self.put((_ITEM, item)):
                    return
            self.put((_END, None))
        except BaseException as exn:  # forwarded to the consumer, never swallowed
            self.put((_ERROR, exn))
        finally:
            close = getattr(self.items, "close", None)
            if close is not None:
                close()  # here, so that nested read-ahead threads stop before this one ends


def prefetch(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """Iterate ``items`` in a background thread, at most ``depth`` ahead (a bounded queue).

    Exceptions from ``items`` are re-raised here; closing this generator stops and joins the
    thread (after the item it is producing; the thread closes ``items`` itself), so the
    upstream objects are never used by two threads at once. Useful where the consumer releases
    the GIL (tokenizers' Rust batch encode) or the producer waits on I/O.
    """
    producer = _Producer(items, depth)
    producer.start()
    try:
        while True:
            kind, value = producer.queue.get()
            if kind == _END:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        producer.stop.set()
        producer.join()


class MapStage(Stage):
    """Applies ``fn`` to every item; its state is the upstream state."""

    def __init__(self, upstream: Stage, fn: Callable[[Any], Any]) -> None:
        self.upstream = upstream
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        return map(self.fn, self.upstream)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "map", "upstream": self.upstream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_kind(state, "map")
        self.upstream.load_state_dict(state_dict_of(state.get("upstream"), "map.upstream"))


class WindowStage(Stage):
    """Reads ``window_items`` items from upstream, turns them into a list of outputs with
    :meth:`process` (a pure function of the items, the epoch and the window index) and emits
    them. The state is ``{window, emitted, upstream: <upstream state at window start>}``.

    Read-ahead: with ``read_ahead_windows=k > 0`` (a constructor argument) a background
    thread reads the upstream items of up to ``k`` windows ahead, runs :meth:`prepare` on
    them and records the upstream state at each window's end, while this stage's consumer
    runs :meth:`process` (e.g. the tokenizer, which releases the GIL). The outputs and
    states are the same as without it: a state only ever names windows the consumer has
    processed.

    Markers (:class:`Marker`) do not count towards ``window_items``; they are passed on after
    the window's outputs. A :class:`PassEnd` ends the window early (unless
    ``cut_at_pass_end`` is False), so that a stage that reorders its window never moves an item
    of the next pass ahead of one of this pass.

    Memory: at most ``window_items`` inputs plus their outputs (``1 + k`` windows of inputs
    with read-ahead).
    """

    kind = "window"
    needs_rng = True
    """False: :meth:`process` ignores its ``rng`` (seeding a generator per window is skipped)."""
    cut_at_pass_end = True
    """End the window at a :class:`PassEnd` (False only for order-preserving stages)."""

    def __init__(self, upstream: Stage, window_items: int, *, seed: int = 0, epoch: int = 0,
                 salt: int = 0, read_ahead_windows: int = 0) -> None:
        if window_items < 1:
            raise ValueError(f"{self.kind} window: expected >= 1 items, got {window_items}")
        self.upstream = upstream
        self.window_items = int(window_items)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.salt = int(salt)
        self._window = 0
        self._emitted = 0
        self._start: dict[str, Any] | None = None  # None: wherever upstream is now
        if read_ahead_windows < 0:
            raise ValueError(f"read_ahead_windows: expected >= 0, got {read_ahead_windows}")
        self.read_ahead_windows = int(read_ahead_windows)

    def prepare(self, items: list[Any]) -> list[Any]:
        """Per-item work on one window's inputs that needs no RNG (runs in the read-ahead
        thread when there is one); the result is what :meth:`process` gets."""
        return items

    @abstractmethod
    def process(self, items: list[Any], rng: np.random.Generator) -> list[Any]:
        """Outputs of one window (deterministic given ``items`` and ``rng``)."""

    def emit(self, output: Any) -> Any:
        """Turn one output into the yielded item (called lazily, at yield time)."""
        return output

    def __iter__(self) -> Iterator[Any]:
        if self._start is None:
            self._start = self.upstream.state_dict()
        else:
            self.upstream.load_state_dict(self._start)
        skip = self._emitted
        emit = self.emit
        for outputs, end in self._windows(iter(self.upstream), self._window):
            last = len(outputs) - 1
            if skip and skip > last:  # a loaded state that emitted more than there is
                raise StreamStateError(
                    f"state '{self.kind}.emitted': expected < {len(outputs)} (the outputs of "
                    f"window {self._window}), got {skip}")
            for i in range(skip, last):
                self._emitted = i + 1
                out = outputs[i]
                yield out if isinstance(out, Marker) else emit(out)
            self._next_window(end)  # before the last output: its receiver is past the window
            if skip <= last:
                out = outputs[last]
                yield out if isinstance(out, Marker) else emit(out)
            skip = 0

    def _windows(self, source: Iterator[Any], window: int
                 ) -> Iterator[tuple[list[Any], dict[str, Any]]]:
        """(outputs, upstream state at the window end) per window, from ``window`` on."""
        inputs = self._inputs(source)
        if self.read_ahead_windows:
            inputs = prefetch(inputs, self.read_ahead_windows)
        for items, markers, end in inputs:
            if items:
                rng = (stage_rng(self.seed, self.salt, self.epoch, window) if self.needs_rng
                       else _NO_RNG)
                outputs = self.process(items, rng)
            else:
                outputs = []
            yield (outputs + markers if markers else outputs), end
            window += 1

    def _inputs(self, source: Iterator[Any]
                ) -> Iterator[tuple[list[Any], list[Marker], dict[str, Any]]]:
        """(prepared items, markers, upstream state at the window end) per window."""
        n = self.window_items
        cut = self.cut_at_pass_end
        while True:
            items: list[Any] = []
            markers: list[Marker] = []
            for item in source:
                if isinstance(item, Marker):
                    markers.append(item)
                    if cut and isinstance(item, PassEnd):
                        break
                    continue
                items.append(item)
                if len(items) == n:
                    break
            if not items and not markers:
                return
            yield (self.prepare(items) if items else items), markers, self.upstream.state_dict()

    def _next_window(self, end: dict[str, Any]) -> None:
        self._window += 1
        self._emitted = 0
        self._start = end

    def state_dict(self) -> dict[str, Any]:
        start = self._start if self._start is not None else self.upstream.state_dict()
        return {"kind": self.kind, "window": self._window, "emitted": self._emitted,
                "upstream": start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_kind(state, self.kind)
        window = state_int(state, "window", self.kind)
        emitted = state_int(state, "emitted", self.kind)
        start = state_dict_of(state.get("upstream"), f"{self.kind}.upstream")
        self.upstream.load_state_dict(start)  # checks it before anything here changes
        self._window, self._emitted, self._start = window, emitted, start


class BlockShuffle(WindowStage):
    """Sample shuffle over a bounded buffer: reads ``shuffle_buffer_samples`` items and emits
    them in a uniformly random order (seeded by seed, epoch and block index).

    Unlike webdataset's reservoir ``shuffle(n)``, the buffer is rebuilt on resume by re-reading
    one block, so the state stays a few integers. Memory: ``shuffle_buffer_samples`` samples.
    """

    kind = "shuffle"

    def __init__(self, upstream: Stage, shuffle_buffer_samples: int, *, seed: int = 0,
                 epoch: int = 0, read_ahead_windows: int = 0) -> None:
        super().__init__(upstream, shuffle_buffer_samples, seed=seed, epoch=epoch, salt=1,
                         read_ahead_windows=read_ahead_windows)

    def process(self, items: list[Any], rng: np.random.Generator) -> list[Any]:
        return [items[i] for i in rng.permutation(len(items))]
