"""Rows in and out of a buffer's working tier: appending transitions (episode ids, frame
stacks, sampler columns, the ring advanced) and gathering sampled slots as whole fields, ragged
fields as lists, :class:`~rlbuffers.packed.Packed` or :class:`~rlbuffers.padded.Padded`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rlbuffers import spec
from rlbuffers.core.framestack import FrameStacks
from rlbuffers.ring import RingState
from rlbuffers.sampling.samplers import EPISODE_ID, SampleContext, Sampler
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.store import ReadOnlyStorage, WritableStorage

Gather = Callable[[str, np.ndarray], Any]


def write_rows(storage: WritableStorage, ring: RingState, sampler: Sampler, stacks: FrameStacks,
               gather: Gather, block: int, rows: dict[str, Any], n: int) -> RingState:
    """Append ``n`` checked transitions ``rows`` (``{field: [n, *shape]}``, ragged: a list)
    at the ring's cursor; returns the ring after them. Only the last ``capacity`` are written
    when ``n`` exceeds it. ``gather(name, slots)`` reads stored columns (frame stacks, sampler
    context; priorities ``block`` slots at a time)."""
    if n == 0:
        return ring
    done = spec.episode_ends(rows, n)
    episode, ended = ring.episode_ids(done)
    side: list[tuple[int, dict[str, Any]]] = []
    if stacks:
        rows, side = stacks.encode(rows, n, done, ring, gather)
    first, slots = ring.append_slots(n)
    kept = {name: data[n - len(slots):] for name, data in rows.items()}
    kept[EPISODE_ID] = episode[n - len(slots):]
    extra = sampler.on_write(slots, SampleContext.over(ring, gather, block))
    for name in sampler.extra_columns:
        kept[name] = extra
    storage.write(first, kept)
    for slot, columns in side:
        storage.write(slot, columns)
    return ring.appended(n, ended)


def read_rows(fields: dict[str, FieldSpec], stacks: FrameStacks, ring: RingState,
              storage: ReadOnlyStorage | WritableStorage, gather: Gather,
              open_check: Callable[[], None], slots: np.ndarray,
              ragged: str = "list") -> dict[str, Any]:
    """``{field: [*slots.shape, *shape]}`` of stored ``slots`` (int64, any shape): frame
    stacks rebuilt, ragged fields as ``ragged`` says (``"list"``, ``"packed"``, ``"padded"``:
    see :meth:`rlbuffers.ReplayBuffer.sample`). ``gather`` reads one column (checking the
    buffer is open); ``open_check`` raises BufferClosedError on a closed buffer."""
    if stacks:
        plain = stacks.reader(ring, gather, slots)
    else:  # what gather does, once for all fields
        open_check()
        flat, column = np.asarray(slots, dtype=np.int64).ravel(), storage.gather
        plain = lambda n: column(n, flat)  # noqa: E731
    if ragged == "list":  # the default path stays as it was: no wrapper per field
        return spec.batch_rows(fields, slots.shape, plain)
    flat = np.asarray(slots, dtype=np.int64).ravel()
    joined = storage.gather_packed if ragged == "packed" else storage.gather_padded

    def get(name: str) -> Any:
        if fields[name].ragged:
            open_check()
            return joined(name, flat)
        return plain(name)

    return spec.batch_rows(fields, slots.shape, get)


def end_episode(ring: RingState, gather: Gather) -> RingState | None:
    """The ring with the newest transition's episode ended (no field changes), or None when
    the buffer is empty or that episode has ended already (``gather`` reads the episode-id
    column)."""
    total = ring.total_added
    if total == 0:
        return None
    newest = np.array([(total - 1) % ring.capacity], dtype=np.int64)
    if int(gather(EPISODE_ID, newest)[0]) < ring.episodes:
        return None
    return ring.appended(0, 1)
