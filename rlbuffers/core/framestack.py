"""Frame-stack deduplication: a field that is a stack of the last ``k`` frames of an episode
(``FieldSpec((4, 84, 84), "uint8", stack_axis=0)``) stores each frame once, and a field
declared ``next_of`` it (``ReplayBuffer.create(next_of={"next_obs": "obs"})``) stores nothing
of its own. Stacks are rebuilt on every read (``sample``, ``buf[i]``), bit-identical to what
was added. The idea is cpprb's ``stack_compress`` / ``next_of`` and SB3's
``optimize_memory_usage``, with episode boundaries, the ring's seam and the last next
observation of every episode kept exact.

Columns of a stacked field ``F`` (``k`` frames of shape ``frame``; ``docs/format.md``, "Frame
stacks"):

- ``F``: ``[capacity, *frame]``, the newest frame of each transition's stack (``F[-1]`` along
  ``stack_axis``).
- ``_head_F`` (ragged, ``[n, *frame]`` per slot): the ``k - 1`` earlier entries of the stack
  of (a) the first transition of each episode, whatever they are (gymnasium
  ``FrameStackObservation`` pads with the reset frame repeated by default, ``padding_type=
  "zero"`` and SB3 ``VecFrameStack`` with zeros: all are stored as given), and (b) the oldest
  stored transition, rewritten whenever the ring overwrites the oldest ones, so the stacks
  of the first ``k - 1`` stored transitions, whose earlier frames were overwritten, stay
  exact (the ring seam: every stored transition reads back exactly). Empty elsewhere.
- ``_final_F`` (ragged, only with a ``next_of`` field): the newest frame of the next
  observation of each transition whose next transition is not stored: an episode's last
  transition (terminated or truncated; SB3's ``optimize_memory_usage`` loses it on
  truncation) and the newest transition (until the next one is added). Empty elsewhere.

So transition ``j``'s stack is: its ``m = min(k - 1, j - a)`` stored predecessors' frames and
its own, after the last ``k - 1 - m`` entries of the head of ``a``, where ``a`` is its
episode's first stored transition (the episode's start, or the oldest stored transition);
its next observation is its stack shifted by one frame plus the next transition's frame (same
episode) or its ``_final_F`` frame.

On ``add`` / ``extend`` the stacks are checked to be consistent (each non-first transition of
an episode continues the previous stack: frames ``0..k-2`` equal the previous frames
``1..k-1``; a next observation is the stack shifted plus one frame, and equals the next
transition's stack within an episode), else :class:`~rlbuffers.errors.FieldError` and the
buffer is unchanged: only then can a stack be rebuilt bit-identically.

A read of ``N`` stacks and their next observations costs one gather of ``2 N k`` frames,
straight into ``[2N, k, *frame]``, one gather of ``N k`` episode ids, and one ragged gather for
the few near an episode's start or end or the seam; no per-item loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers.errors import CorruptChunkError, FieldError
from rlbuffers.ring import RingState
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.framestack_columns import final_column, head_column, stacked

#: The episode-id column every buffer has (as ``rlbuffers.sampling.samplers.EPISODE_ID``).
EPISODE_ID = "_episode_id"

Gather = Callable[[str, np.ndarray], Any]


def _as_bits(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as unsigned integers of its item size (a copy only for 16-byte items):
    equality is then bit equality (NaN, -0.0)."""
    if a.dtype.itemsize in (1, 2, 4, 8):
        return a.view(f"u{a.dtype.itemsize}")
    return np.ascontiguousarray(a).view(np.uint8)


def _differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool[n]: rows of ``a`` and ``b`` ([n, ...], same dtype) that are not bit-identical."""
    if a.size == 0:
        return np.zeros(len(a), dtype=bool)
    return (_as_bits(a) != _as_bits(b)).reshape(len(a), -1).any(axis=1)


@dataclass
class StackSlots:
    """Where the stacks of ``N`` stored transitions keep their frames
    (:meth:`FrameStacks.stack_slots`)."""

    #: int64[N, k]: the slot of each frame, oldest first (frames that come from the head of
    #: the episode's first stored transition point at that transition)
    slots: np.ndarray
    #: int64[N]: stored predecessors of each in its episode (at most ``k - 1``)
    m: np.ndarray
    #: int64[N, k]: the slots of the next observations' frames (``slots`` shifted by one,
    #: then the next transition; itself where that is not stored in the same episode)
    next_slots: np.ndarray | None = None
    #: bool[N]: whether the next transition is stored, in the same episode
    same: np.ndarray | None = None


class FrameStacks:
    """Encoding (on write) and rebuilding (on read) of the stacked fields of one buffer.

    Args:
        fields: the buffer's fields (user specs; the stacked ones have ``stack_axis``).
        next_of: derived field name -> stacked source field.
    """

    def __init__(self, fields: Mapping[str, FieldSpec], next_of: Mapping[str, str]) -> None:
        self.stacked = stacked(fields)
        self.next_of = dict(next_of)
        self.next_by_source = {src: n for n, src in self.next_of.items()}
        self.frame_shape = {n: spec.column.shape for n, spec in self.stacked.items()}
        #: per stacked field, what the last ``encode`` left: ``(total_added after it, the
        #: newest stack [k, *frame], the oldest's id, the oldest's stack)`` -- saves reading
        #: them back on the next ``add`` (keyed by ``total_added``: a write that failed after
        #: ``encode`` leaves a key the ring never has, and they are read from storage)
        self._last: dict[str, tuple[int, np.ndarray, int, np.ndarray | None]] = {}

    def __bool__(self) -> bool:
        return bool(self.stacked)

    # -- reads -----------------------------------------------------------------------------

    def _to_user(self, name: str, frames: np.ndarray) -> np.ndarray:
        """``[N, k, *frame]`` -> ``[N, *shape]`` (the stack axis where the spec puts it)."""
        axis = self.stacked[name].stack_axis
        return np.ascontiguousarray(np.moveaxis(frames, 1, 1 + axis))  # type: ignore[operator]

    def stack_slots(self, name: str, ring: RingState, gather: Gather, ids: np.ndarray,
                    episode: np.ndarray, *, with_next: bool) -> StackSlots:
        """Where the stacks of stored transitions ``ids`` (int64[N], episode ids ``episode``)
        of stacked field ``name`` keep their frames (and, ``with_next``, those of their next
        observations): one gather of the episode ids of the ``k - 1`` transitions before each
        (and the one after)."""
        k, cap, first = self.stacked[name].stack, ring.capacity, ring.first_live_id
        n = len(ids)
        look = ids[:, None] - np.arange(1, k)  # [N, k - 1]: predecessors, nearest first
        valid = look >= first
        if with_next:
            nxt = ids + 1
            stored = nxt < ring.total_added
            look = np.concatenate([look, nxt[:, None]], axis=1)
            valid = np.concatenate([valid, stored[:, None]], axis=1)
        eps = np.asarray(gather(EPISODE_ID, (np.where(valid, look, ids[:, None]) % cap).ravel()))
        match = valid & (eps.reshape(n, -1) == episode[:, None])
        # stored predecessors in the same episode: the leading run of matches
        m = np.logical_and.accumulate(match[:, : k - 1], axis=1).sum(axis=1, dtype=np.int64)
        back = np.minimum(np.arange(k - 1, -1, -1), m[:, None])  # frames back from ids
        slots = (ids[:, None] - back) % cap
        if not with_next:
            return StackSlots(slots, m)
        same = match[:, -1]
        shifted = np.empty_like(slots)
        shifted[:, :-1] = slots[:, 1:]
        shifted[:, -1] = np.where(same, nxt, ids) % cap
        return StackSlots(slots, m, shifted, same)

    def read(self, name: str, ring: RingState, gather: Gather, ids: np.ndarray,
             where: StackSlots) -> tuple[np.ndarray, np.ndarray | None]:
        """The stacks of stored transitions ``ids`` (int64[N]) of stacked field ``name``,
        ``[N, k, *frame]``, oldest frame first, and (where ``where`` has them) their next
        observations' stacks, each the stack shifted by one frame plus the next transition's
        newest frame (same episode) or its ``_final_<name>`` frame: one gather of all ``N *
        k`` (``2 N k``) frames straight into that layout, then the few frames that come from
        an episode's head and final frames.

        Raises:
            CorruptChunkError: a head row (``_head_<name>``) that is not ``k - 1`` frames, or a
                needed ``_final_<name>`` row that is not one frame.
        """
        k, cap, n = self.stacked[name].stack, ring.capacity, len(ids)
        slots, m = where.slots, where.m
        both = slots if where.next_slots is None else np.concatenate([slots, where.next_slots])
        out = np.asarray(gather(name, both.ravel())).reshape(*both.shape, *self.frame_shape[name])
        if not out.flags.writeable:
            out = out.copy()
        own, nxt = out[:n], (None if where.next_slots is None else out[n:])
        need = np.flatnonzero(m < k - 1)
        if len(need):
            self._heads_into(name, gather, own, slots[need, 0], m[need], need)
            if nxt is not None:  # frames 1.. of these stacks are the next stacks' 0..
                nxt[need, :-1] = own[need, 1:]
        if nxt is not None:
            last = np.flatnonzero(~where.same)  # type: ignore[operator]
            if len(last):
                finals = gather(final_column(name), ids[last] % cap)
                for i, f in zip(ids[last].tolist(), finals, strict=True):
                    if len(f) != 1:
                        raise CorruptChunkError(final_column(name), -1, f"slot {i % cap}: "
                                                f"expected 1 final frame, got {len(f)}")
                nxt[last, -1] = np.concatenate(finals)
        return own, nxt

    def _heads_into(self, name: str, gather: Gather, out: np.ndarray, anchors: np.ndarray,
                    m: np.ndarray, rows: np.ndarray) -> None:
        """Write the head frames of the stacks ``out[rows]`` (``m`` int64 stored predecessors
        each, ``< k - 1``; ``anchors``: the slots of their episodes' first stored
        transitions) into their first ``k - 1 - m`` entries.

        Raises:
            CorruptChunkError: a head row (``_head_<name>``) that is not ``k - 1`` frames.
        """
        k = self.stacked[name].stack
        heads = gather(head_column(name), anchors)
        for a, h in zip(anchors.tolist(), heads, strict=True):
            if len(h) != k - 1:
                raise CorruptChunkError(head_column(name), -1, f"slot {a}: expected "
                                        f"{k - 1} head frames, got {len(h)}")
        head = np.stack(heads)
        for p in range(k - 1):
            use = p + m < k - 1
            out[rows[use], p] = head[use, p + m[use]]

    def stacks(self, name: str, ring: RingState, gather: Gather, ids: np.ndarray,
               episode: np.ndarray) -> np.ndarray:
        """The stacks of stored transitions ``ids`` (int64[N], episode ids ``episode``):
        ``[N, k, *frame]`` (:meth:`read` without next observations)."""
        where = self.stack_slots(name, ring, gather, ids, episode, with_next=False)
        return self.read(name, ring, gather, ids, where)[0]

    def reader(self, ring: RingState, gather: Gather, slots: np.ndarray) -> Callable[[str], Any]:
        """``get(field)``: the flat rows of any user field at stored ``slots`` (stacked and
        derived fields rebuilt, ``[N, *shape]``; others as ``gather`` reads them). A stacked
        field and its ``next_of`` field are read together, once."""
        flat = np.asarray(slots, dtype=np.int64).ravel()
        ids = ring.ids(flat)
        cache: dict[str, Any] = {}

        def episode() -> np.ndarray:
            if EPISODE_ID not in cache:
                cache[EPISODE_ID] = np.asarray(gather(EPISODE_ID, flat))
            return cache[EPISODE_ID]

        def stacks(src: str) -> tuple[np.ndarray, np.ndarray | None]:
            if src not in cache:
                where = self.stack_slots(src, ring, gather, ids, episode(),
                                         with_next=src in self.next_by_source)
                cache[src] = self.read(src, ring, gather, ids, where)
            return cache[src]

        def get(name: str) -> Any:
            if name in self.stacked:
                return self._to_user(name, stacks(name)[0])
            src = self.next_of.get(name)
            if src is None:
                return gather(name, flat)
            return self._to_user(src, stacks(src)[1])  # type: ignore[arg-type]

        return get

    # -- writes ----------------------------------------------------------------------------

    def encode(self, rows: dict[str, Any], n: int, done: np.ndarray, ring: RingState,
               gather: Gather) -> tuple[dict[str, Any], list[tuple[int, dict[str, Any]]]]:
        """The column rows of ``n`` checked transitions ``rows`` (user fields, ``[n, *shape]``)
        about to be appended to a ring in state ``ring`` (``done``: bool[n] episode ends), and
        the writes of single slots outside them (``[(slot, {column: rows})]``: the new
        oldest transition's head, then the previous newest transition's cleared final frame,
        last so that a write failing before it leaves that frame), to apply in order after
        the rows. Reads the stored transitions through ``gather`` (before any
        write).

        Raises:
            FieldError: a stack that does not continue the previous one of its episode, or a
                next observation that is not the stack shifted by one frame, or that differs
                from the next transition's stack (the message names the field).
        """
        out = {k: v for k, v in rows.items() if k not in self.next_of}
        total = ring.total_added
        prev = _Previous(ring, gather)
        start = np.concatenate([[prev.ended], np.asarray(done[:-1], dtype=bool)])
        new_first = total + n - min(total + n, ring.capacity)
        side: dict[int, dict[str, Any]] = {}  # heads of the new oldest
        clears: list[tuple[int, dict[str, Any]]] = []  # the previous newest's final frames
        for name, spec in self.stacked.items():
            f = np.moveaxis(rows[name], 1 + spec.stack_axis, 1)  # type: ignore[operator]
            last = self._last.pop(name, None)
            if last is not None and last[0] != total:
                last = None
            self._check_continues(name, f, start, prev, None if last is None else last[1])
            out[name] = np.ascontiguousarray(f[:, -1])
            empty = np.empty((0, *self.frame_shape[name]), dtype=spec.dtype)
            heads = [np.ascontiguousarray(f[j, :-1]) if start[j] else empty for j in range(n)]
            oldest = None
            if new_first >= total:  # the oldest transition is in the batch: its head is given
                oldest = np.ascontiguousarray(f[new_first - total])
                heads[new_first - total] = oldest[:-1]
            elif new_first > ring.first_live_id:  # a stored one becomes the oldest
                oldest = self._oldest(name, ring, gather, new_first,
                                      None if last is None else last[2:])
                if oldest is not None:
                    side.setdefault(new_first % ring.capacity, {})[head_column(name)] = [
                        oldest[:-1].copy()]
            out[head_column(name)] = heads
            self._last[name] = (total + n, np.ascontiguousarray(f[-1]), new_first, oldest)
            nx = self.next_by_source.get(name)
            if nx is not None:
                g = np.moveaxis(rows[nx], 1 + spec.stack_axis, 1)  # type: ignore[operator]
                self._check_next(name, nx, f, g, start, prev)
                keep = np.asarray(done, dtype=bool).copy()
                keep[-1] = True
                out[final_column(name)] = [np.ascontiguousarray(g[j, -1:]) if keep[j] else empty
                                           for j in range(n)]
                if not prev.ended and n < ring.capacity:  # its next frame is stored now
                    clears.append((prev.slot, {final_column(name): [empty]}))
        # the clears last: a write that fails before them leaves the newest's final frame
        return out, sorted(side.items()) + clears

    def _oldest(self, name: str, ring: RingState, gather: Gather, o: int,
                 cached: tuple[int, np.ndarray | None] | None) -> np.ndarray | None:
        """The stack ``[k, *frame]`` of stored transition ``o``, about to become the oldest,
        or None when it starts an episode (its head is stored already). ``cached``: the id
        and stack (or None) of the oldest the last ``encode`` left."""
        cap = ring.capacity
        if cached is not None and cached[0] == o - 1 and cached[1] is not None:
            ep = np.asarray(gather(EPISODE_ID, np.array([o - 1, o], dtype=np.int64) % cap))
            if ep[0] != ep[1]:
                return None
            frame = np.asarray(gather(name, np.array([o % cap], dtype=np.int64)))
            return np.concatenate([cached[1][1:], frame])
        ids = np.array([o], dtype=np.int64)
        return self.stacks(name, ring, gather, ids, np.asarray(gather(EPISODE_ID, ids % cap)))[0]

    def _check_continues(self, name: str, f: np.ndarray, start: np.ndarray,
                         prev: _Previous, newest: np.ndarray | None) -> None:
        """Each stack of ``f`` (``[n, k, *frame]``) not starting an episode continues the one
        before it (the stored newest for the first: ``newest`` if known)."""
        k, axis = self.stacked[name].stack, self.stacked[name].stack_axis
        bad = np.zeros(len(f), dtype=bool)
        bad[1:] = _differs(f[1:, :-1], f[:-1, 1:])
        if not prev.ended:
            stored = (newest[None] if newest is not None else
                      self.stacks(name, prev.ring, prev.gather, prev.ids, prev.episode))
            bad[:1] = _differs(f[:1, :-1], stored[:, 1:])
        bad &= ~start
        if bad.any():
            raise FieldError(
                f"field {name!r}: transition {int(np.argmax(bad))} of the batch does not "
                f"continue the stack of the previous transition of its episode (its frames "
                f"0..{k - 2} along stack_axis={axis} must equal the previous stack's frames "
                f"1..{k - 1}); a stacked field stores each frame once, so it only takes stacks "
                "of consecutive frames (an episode starts after terminated/truncated/done)")

    def _check_next(self, name: str, nx: str, f: np.ndarray, g: np.ndarray, start: np.ndarray,
                    prev: _Previous) -> None:
        """Next observations ``g`` are the stacks ``f`` shifted by one frame, and (within an
        episode) the next transition's stack (the stored newest's pending final frame for
        the first)."""
        k, axis = self.stacked[name].stack, self.stacked[name].stack_axis
        bad = _differs(g[:, :-1], f[:, 1:])
        if bad.any():
            raise FieldError(
                f"field {nx!r}: transition {int(np.argmax(bad))} of the batch is not its "
                f"{name!r} stack shifted by one frame (its frames 0..{k - 2} along "
                f"stack_axis={axis} must equal {name!r}'s frames 1..{k - 1})")
        first = f[:1, -1]
        if not prev.ended:
            first = prev.gather(final_column(name), np.array([prev.slot]))[0]
            if len(first) != 1:
                raise CorruptChunkError(final_column(name), -1, f"slot {prev.slot}: expected "
                                        f"1 final frame, got {len(first)}")
        bad = ~start & _differs(f[:, -1], np.concatenate([first, g[:-1, -1]]))
        if bad.any():
            raise FieldError(
                f"field {nx!r}: the next observation of the transition before transition "
                f"{int(np.argmax(bad))} of the batch differs from that transition's {name!r} "
                f"(within an episode, {nx!r} must be the next transition's {name!r})")


class _Previous:
    """The newest stored transition of a ring in state ``ring`` (before a write): its id
    (``ids``: int64[1]), slot, episode id and whether it ended its episode (True when the
    ring is empty)."""

    def __init__(self, ring: RingState, gather: Gather) -> None:
        self.ring, self.gather = ring, gather
        total = ring.total_added
        self.ids = np.array([max(total - 1, 0)], dtype=np.int64)
        self.slot = int(self.ids[0] % ring.capacity)
        self.episode = self.episode_of(self.ids) if total else self.ids
        self.ended = total == 0 or int(self.episode[0]) < ring.episodes

    def episode_of(self, ids: np.ndarray) -> np.ndarray:
        """Episode ids (int64[N]) of stored transitions ``ids``."""
        return np.asarray(self.gather(EPISODE_ID, ids % self.ring.capacity))
