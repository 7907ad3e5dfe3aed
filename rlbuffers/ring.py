"""The ring state of a replay buffer as a value (as in flashbax): how many transitions were ever
added and how many episodes ended. Everything else (size, cursor, oldest slot, the mapping
between positions, slots and transition ids) is derived here, in one place.

Three ways to name a transition:
- **slot**: its row in storage, ``0 <= slot < capacity``;
- **position** (logical index): ``0`` is the oldest stored transition, ``size - 1`` the newest;
- **transition id**: ``0`` for the first transition ever added, growing forever; ids
  ``[first_live_id, total_added)`` are stored, and ``slot = id % capacity``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers.errors import FieldError


@dataclass(frozen=True)
class RingState:
    """A FIFO ring of ``capacity`` slots after ``total_added`` appends.

    Attributes:
        capacity: slots in the ring (> 0).
        total_added: transitions ever appended.
        episodes: episodes ended so far (also the id of the episode being written).
    """

    capacity: int
    total_added: int = 0
    episodes: int = 0

    @property
    def size(self) -> int:
        """Stored transitions: ``min(total_added, capacity)``."""
        return min(self.total_added, self.capacity)

    @property
    def cursor(self) -> int:
        """Slot the next transition goes to."""
        return self.total_added % self.capacity

    @property
    def start_slot(self) -> int:
        """Slot of the oldest stored transition (position 0)."""
        return (self.total_added - self.size) % self.capacity

    @property
    def first_live_id(self) -> int:
        """Transition id of the oldest stored transition."""
        return self.total_added - self.size

    def slots(self, positions: Any) -> np.ndarray:
        """Slots (int64, same shape) of positions in ``[0, size)``."""
        return (self.start_slot + np.asarray(positions, dtype=np.int64)) % self.capacity

    def ids(self, slots: Any) -> np.ndarray:
        """Transition ids (int64, same shape) of stored slots."""
        positions = (np.asarray(slots, dtype=np.int64) - self.start_slot) % self.capacity
        return positions + self.first_live_id

    def positions(self, key: int | slice | Any) -> np.ndarray:
        """Positions selected by an index ``key`` (an int, a slice, or a 1-d int array; negative
        ints count from the newest), as int64 (0-d for an int).

        Raises:
            IndexError: a position outside ``[-size, size)``, or an array of more than 1 dim.
            TypeError: a key that is not integers (e.g. a field name).
        """
        if isinstance(key, slice):
            return np.arange(self.size, dtype=np.int64)[key]
        raw = np.asarray(key)
        if raw.size and raw.dtype.kind not in "iu":
            hint = (f"; to read field {key!r}, select rows first: buf[positions][{key!r}]"
                    if isinstance(key, str) else "")
            raise TypeError(f"index: expected an int, slice or 1-d int array of positions, got "
                            f"{type(key).__name__} {key!r:.60}{hint}")
        pos = raw.astype(np.int64, copy=False)
        if pos.ndim > 1:
            raise IndexError(f"index: expected an int, slice or 1-d int array, got {pos.shape}")
        bad = (pos < -self.size) | (pos >= self.size)
        if bad.any():
            raise IndexError(f"index {np.atleast_1d(pos[bad]).tolist()[:5]} out of range for "
                             f"buffer of {self.size} transitions")
        return pos % max(self.size, 1)

    def append_slots(self, n: int) -> tuple[int, np.ndarray]:
        """Where ``n`` appended transitions land: ``(first, slots)``, the slots (int64[k]) of the
        last ``k = min(n, capacity)`` of them, which survive; ``first = slots[0]``."""
        keep = min(n, self.capacity)
        first = (self.total_added + n - keep) % self.capacity
        return first, (first + np.arange(keep, dtype=np.int64)) % self.capacity

    def appended(self, n: int, episodes_ended: int) -> RingState:
        """The state after appending ``n`` transitions that end ``episodes_ended`` episodes."""
        return dataclasses.replace(self, total_added=self.total_added + n,
                                   episodes=self.episodes + episodes_ended)

    def episode_ids(self, done: np.ndarray) -> tuple[np.ndarray, int]:
        """Episode ids (int64[n]) of ``n`` transitions about to be appended whose episode-end
        flags are ``done`` (bool[n]), and how many episodes they end."""
        ends = np.cumsum(np.asarray(done, dtype=bool))
        return self.episodes + np.concatenate([[0], ends[:-1]]).astype(np.int64), int(ends[-1])

    def live(self, ids: np.ndarray) -> np.ndarray:
        """Which transition ids (int64[N]) are still stored (bool[N]).

        Raises:
            FieldError: an id that was never added (negative or ``>= total_added``).
        """
        if ((ids < 0) | (ids >= self.total_added)).any():
            raise FieldError(f"indices: expected transition ids in [0, {self.total_added}), "
                             f"got min {ids.min()} max {ids.max()}")
        return ids >= self.first_live_id
