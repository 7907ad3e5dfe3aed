"""The vocabulary every sampler shares: the columns samplers may keep (:data:`PRIORITY`,
:data:`EPISODE_ID`), what a sampler may know of the buffer (:class:`SampleContext`), what it
returns (:class:`Draw`), the :class:`Sampler` protocol, and the registry
(:func:`register_sampler`). Sampler modules (:mod:`rlbuffers.sampling.samplers`,
:mod:`rlbuffers.sampling.group`) import this one and never each other's names, so there is no
import cycle between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from rlbuffers.ring import RingState
from rlbuffers.spec import FieldSpec

#: The column holding raw priorities (float64[capacity]) for samplers that declare it.
PRIORITY = "_priority"
#: The column holding each slot's episode number (int64[capacity]); every buffer has it.
EPISODE_ID = "_episode_id"


@dataclass
class SampleContext:
    """What a sampler may know about the buffer: its occupancy and two column readers.

    Attributes:
        size: stored transitions.
        capacity: slots in the ring.
        start_slot: slot of the oldest transition (logical index 0).
        episode_ids: slots int64[N] -> episode ids int64[N].
        priorities: () -> float64[capacity] raw priorities of all slots (0 where empty).
    """

    size: int
    capacity: int
    start_slot: int
    episode_ids: Callable[[np.ndarray], np.ndarray]
    priorities: Callable[[], np.ndarray]

    def slots(self, logical: np.ndarray) -> np.ndarray:
        """Slots of logical indices (0 = oldest)."""
        return (self.start_slot + logical) % self.capacity

    @classmethod
    def over(cls, ring: RingState, gather: Callable[[str, np.ndarray], Any],
             block: int) -> SampleContext:
        """The context of a buffer in state ``ring`` whose columns ``gather(name, slots)``
        reads (priorities are read ``block`` slots at a time)."""

        def priorities() -> np.ndarray:
            out = np.zeros(ring.capacity, dtype=np.float64)
            for a in range(0, ring.size, block):
                b = min(a + block, ring.size)
                out[a:b] = gather(PRIORITY, np.arange(a, b))
            return out

        return cls(ring.size, ring.capacity, ring.start_slot,
                   episode_ids=lambda slots: gather(EPISODE_ID, slots), priorities=priorities)


@dataclass
class Draw:
    """A sampled batch of slots. ``slots``: int64[B] (or [B, L] for sequences);
    ``weights``: float32[B] importance weights (ones unless prioritized)."""

    slots: np.ndarray
    weights: np.ndarray


@runtime_checkable
class Sampler(Protocol):
    """What a sampler must do. It holds settings, never transition data; randomness comes only
    from the generator passed in, so the buffer's saved RNG state makes sampling resumable.

    Class attributes:
        name: the registry key, stored in the manifest as ``state_dict()["type"]``.
        extra_columns: columns the buffer must keep for it (name -> spec), e.g.
            ``{PRIORITY: FieldSpec((), "float64")}``; the buffer stores what :meth:`on_write`
            returns there and reads it back through ``SampleContext.priorities``.
    """

    name: ClassVar[str]
    extra_columns: ClassVar[dict[str, FieldSpec]]

    def sample(self, batch_size: int, ctx: SampleContext, rng: np.random.Generator) -> Draw:
        """Draw ``batch_size`` slots among the ``ctx.size`` stored transitions.

        Raises:
            BufferEmptyError: too few transitions to draw from.
        """
        ...

    def on_write(self, slots: np.ndarray, ctx: SampleContext) -> np.ndarray | None:
        """Called as new transitions land in ``slots`` (int64[k]); returns the values of the
        sampler's extra column for them (float64[k]), or None if it has none."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: ``{"type": name, **settings}``; enough for
        :meth:`from_state_dict` to rebuild an equal sampler."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the settings of :meth:`state_dict` (derived structures are rebuilt lazily)."""
        ...

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Sampler:
        """A new sampler from :meth:`state_dict`."""
        ...


_REGISTRY: dict[str, type[Sampler]] = {}
S = TypeVar("S", bound=type)


def registered_samplers() -> dict[str, type[Sampler]]:
    """Registry name -> sampler class, of every sampler registered so far (a copy)."""
    return dict(_REGISTRY)


def register_sampler(cls: S) -> S:
    """Class decorator: register a :class:`Sampler` under ``cls.name``.

    Raises:
        ValueError: the name is taken by another class.
    """
    name = cls.name  # type: ignore[attr-defined]
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"sampler name {name!r}: already registered by {_REGISTRY[name]}")
    _REGISTRY[name] = cls  # type: ignore[assignment]
    return cls
