"""The reading half of :class:`rlbuffers.ReplayBuffer`: drawing a batch with the sampler,
transitions and their episode numbers by position, and priority updates of sampled
transitions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.core import rows
from rlbuffers.core.framestack import FrameStacks
from rlbuffers.errors import BufferClosedError, ReadOnlyError
from rlbuffers.packed import check_ragged_format
from rlbuffers.ring import RingState
from rlbuffers.sampling import samplers
from rlbuffers.sampling.samplers import EPISODE_ID, PRIORITY, SampleContext, Sampler
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.create import positive_int
from rlbuffers.storage.store import ReadOnlyStorage, WritableStorage

__all__ = ["BufferReads"]


class BufferReads:
    """Sampling and reading methods of :class:`rlbuffers.ReplayBuffer` (its base class; not
    built on its own). They read the buffer's ring state, sampler and storage."""

    _ring: RingState
    _rng: np.random.Generator
    _fields: dict[str, FieldSpec]
    _stacks: FrameStacks
    _storage: ReadOnlyStorage | WritableStorage
    sampler: Sampler
    chunk_transitions: int
    path: Path | str
    _closed: bool

    def _open_check(self) -> None:
        if self._closed:
            raise BufferClosedError(f"{self.path}: buffer is closed")

    def _writer(self) -> WritableStorage:
        self._open_check()
        if not isinstance(self._storage, WritableStorage):
            raise ReadOnlyError(f"{self.path}: opened read-only (mode='r')")
        return self._storage

    def _context(self) -> SampleContext:
        return SampleContext.over(self._ring, self._gather, self.chunk_transitions)

    def _gather(self, name: str, slots: np.ndarray) -> Any:
        self._open_check()
        return self._storage.gather(name, np.asarray(slots, dtype=np.int64).ravel())

    def _rows(self, slots: np.ndarray, ragged: str = "list") -> dict[str, Any]:
        return rows.read_rows(self._fields, self._stacks, self._ring, self._storage,
                              self._gather, self._open_check, slots, ragged)

    def sample(self, batch_size: int, *, rng: np.random.Generator | None = None,
               ragged: str = "list") -> dict[str, Any]:
        """Draw ``batch_size`` (B) transitions with the sampler, from ``rng`` (default: the
        buffer's own generator, saved by ``save``).

        Args:
            ragged: ragged fields as ``"list"`` (default; B arrays ``[len_i, *row]``),
                ``"packed"`` (one :class:`~rlbuffers.Packed`: ``values [sum_len, *row]``,
                ``cu_seqlens`` int32[B + 1]) or ``"padded"`` (one :class:`~rlbuffers.Padded`:
                ``values [B, T, *row]`` zero-padded, ``lengths`` int64[B]); the same draw in
                each. Sequence samplers: B lists of L rows, or B * L rows in row-major order.

        Returns:
            ``{field: [B, *shape]}`` (sequences ``[B, L, *shape]``), ``indices`` int64[B]
            (``[B, L]``) transition ids, ``weights`` float32[B] importance weights.

        Raises:
            BufferEmptyError: too few transitions.
            ValueError: batch_size < 1 or an unknown ``ragged`` (nothing is drawn: the
                generator does not move).
        """
        batch_size = positive_int("batch_size", batch_size)
        ragged = check_ragged_format(ragged)
        draw = self.sampler.sample(batch_size, self._context(), rng or self._rng)
        return {**self._rows(draw.slots, ragged), "indices": self._ring.ids(draw.slots),
                "weights": draw.weights}

    def draw(self, batch_size: int, *, rng: np.random.Generator | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """The sampler's draw of :meth:`sample` without reading any field (the same
        generator steps, so ``draw`` then ``buf[...]`` equals ``sample``).

        Returns:
            ``(indices, weights)``: int64[B] transition ids (``[B, L]`` for sequence samplers;
            slot = id % capacity) and float32[B] importance weights.

        Raises:
            BufferEmptyError: too few transitions. ValueError: batch_size < 1.
        """
        batch_size = positive_int("batch_size", batch_size)
        self._open_check()
        d = self.sampler.sample(batch_size, self._context(), rng or self._rng)
        return self._ring.ids(d.slots), d.weights

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> dict[str, Any]:
        """Transitions by position (0 = oldest, -1 = newest): an int gives ``{field:
        [*shape]}``, a slice or int array ``{field: [N, *shape]}`` (ragged: a list).

        Raises:
            IndexError: a position outside ``[-len, len)``. TypeError: a key that is not
            integer positions (a field name: ``buf[positions]["obs"]`` reads a field; a
            boolean mask: ``buf[np.flatnonzero(mask)]``).
        """
        positions = self._ring.positions(key)
        out = self._rows(self._ring.slots(np.atleast_1d(positions)))
        return {n: v[0] for n, v in out.items()} if positions.ndim == 0 else out

    def episode_ids(self, key: int | slice | np.ndarray | list[int]) -> Any:
        """The episode number of transitions by position, ``key`` as in ``buf[key]`` (0 =
        oldest, -1 = newest): int64 ``[N]`` for a slice or int array, an ``np.int64`` for an
        int. For the ``indices`` (transition ids) that ``sample`` returns, pass
        ``indices - (buf.total_added - len(buf))``.

        Episodes are numbered 0, 1, 2, ... in the order they began, over the buffer's whole
        life: a transition's number is how many episodes had ended when it was added. An
        episode ends at a transition with ``terminated``, ``truncated`` or ``done`` set, or
        at :meth:`end_episode` (a reset with no flag). So the numbers never decrease from
        oldest to newest and step by one at each episode start: transition ``i`` is the last
        of its episode exactly when ``ids[i + 1] != ids[i]`` (the newest: when
        ``ids[-1] < buf.episodes``, the number the next transition gets). Every episode has a
        transition, so episode ``e`` began at transition id ``>= e``.

        Raises:
            IndexError: a position outside ``[-len, len)``, or an array of more than 1 dim.
            BufferClosedError: the buffer is closed.
        """
        positions = self._ring.positions(key)
        ids = self._gather(EPISODE_ID, self._ring.slots(np.atleast_1d(positions)))
        ids = np.asarray(ids, dtype=np.int64)
        return ids[0] if positions.ndim == 0 else ids

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set new priorities (e.g. ``|TD error|``, float[N], finite, >= 0) of sampled
        transitions ``indices`` (int64[N] ids from ``sample``); returns how many were updated
        (ids overwritten since they were sampled are skipped).

        Raises:
            NotPrioritizedError: the sampler keeps no priorities.
            FieldError: unequal lengths, negative or non-finite priorities, or ids never
                added.
        """
        storage = self._writer()
        slots, raw, n = samplers.priority_update(self.sampler, self._context(), self._ring,
                                                 indices, priorities)
        if n:
            storage.scatter(PRIORITY, slots, raw)
        return n

