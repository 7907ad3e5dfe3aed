"""How a buffer's slots are cut into chunks: the one home of the chunk arithmetic.

Two units, used everywhere under these names:

- a **base chunk** holds ``base_chunk_rows`` consecutive slots (the public
  ``chunk_transitions``). It is the unit that ``add`` marks dirty and that the working tier
  rebuilds; every field shares it.
- a **stored chunk** of a field holds ``stored_chunk_rows[field]`` slots, a whole multiple of
  ``base_chunk_rows``: one Zarr chunk (one file) of the persistent tier. The largest field and
  ragged fields store one base chunk per stored chunk; smaller fixed fields store several, so
  an incremental save writes a few files per scalar column instead of one per base chunk.

Chunk indices are always counted in the unit their name says (``base`` or ``stored``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np

from rlbuffers.intmath import ceil_div
from rlbuffers.spec import FieldSpec


def plan_stored_chunk_rows(
    specs: dict[str, FieldSpec], base_chunk_rows: int, capacity: int,
    size_by: Collection[str] | None = None,
) -> dict[str, int]:
    """Slots per stored chunk of each field (internal fields included).

    The largest field of ``size_by`` (default: all; by :meth:`FieldSpec.estimate_bytes`) and
    ragged fields keep ``base_chunk_rows``; a smaller fixed field takes as many base chunks as
    make about the raw bytes of one chunk of that largest field, at most the whole capacity.
    ``size_by`` leaves out columns whose size guess is no transition's size: a stacked
    field's ``_head_F`` / ``_final_F`` hold frames at episode starts and ends only, and their
    ragged guess (256 frames per slot) made a one-frame column's stored chunk 256 base chunks
    (7 GB of 84x84 frames at capacity 1M, read and compressed whole at every commit).

    Returns:
        field name -> slots per stored chunk (a multiple of ``base_chunk_rows``).
    """
    n_base = ceil_div(capacity, base_chunk_rows)
    sizing = specs if size_by is None else [n for n in specs if n in size_by] or specs
    target = base_chunk_rows * max(specs[n].estimate_bytes() for n in sizing)
    out = {}
    for name, spec in specs.items():
        m = 1 if spec.ragged else target // (base_chunk_rows * max(spec.item_bytes, 1))
        out[name] = base_chunk_rows * int(max(1, min(m, n_base)))
    return out


@dataclass(frozen=True)
class ChunkLayout:
    """The chunking of one buffer.

    Attributes:
        capacity: slots in the ring.
        base_chunk_rows: slots per base chunk.
        stored_chunk_rows: field name -> slots per stored chunk (multiples of the base).
    """

    capacity: int
    base_chunk_rows: int
    stored_chunk_rows: dict[str, int]

    @property
    def n_base_chunks(self) -> int:
        """Base chunks in the ring (the last may be partial)."""
        return ceil_div(self.capacity, self.base_chunk_rows)

    def base_chunks_of_slots(self, slots: np.ndarray) -> set[int]:
        """The base chunks holding ``slots`` (int64[N])."""
        return set(np.unique(np.asarray(slots) // self.base_chunk_rows).tolist())

    def filled_base_chunks(self, size: int) -> set[int]:
        """The base chunks holding any of slots ``[0, size)``."""
        return set(range(ceil_div(size, self.base_chunk_rows)))

    def stored_of(self, name: str, base_chunks: Iterable[int]) -> list[int]:
        """The stored chunks of ``name`` holding base chunks ``base_chunks``, sorted."""
        m = self.stored_chunk_rows[name] // self.base_chunk_rows
        return sorted({c // m for c in base_chunks})

    def base_of(self, name: str, stored: Iterable[int]) -> set[int]:
        """The base chunks that stored chunks ``stored`` of ``name`` hold (inverse of
        :meth:`stored_of`)."""
        m = self.stored_chunk_rows[name] // self.base_chunk_rows
        return {b for c in stored for b in range(c * m, (c + 1) * m)}

    def stored_slots(self, name: str, c: int) -> tuple[int, int]:
        """Slots ``[a, b)`` of stored chunk ``c`` of ``name`` (the last may be short)."""
        k = self.stored_chunk_rows[name]
        return c * k, min((c + 1) * k, self.capacity)

    def filled_stored_chunks(self, name: str, size: int) -> list[tuple[int, int]]:
        """``(stored chunk, rows in use)`` for each stored chunk of ``name`` holding any of
        slots ``[0, size)``."""
        k = self.stored_chunk_rows[name]
        return [(c, min(k, size - c * k)) for c in range(ceil_div(size, k))]
