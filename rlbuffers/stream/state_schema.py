"""The one schema every resume state of the streaming pipeline is checked against before it is
used, and the checks of ``shards.json``: each value's type and range, named in the error.

A loader state (:meth:`~rlbuffers.stream.StreamLoader.state_dict`)::

    {"kind": "stream_loader", "version": 1 | 2, "epoch": int >= 0,
     "batches_in_epoch": int >= 0 (<= batches_per_epoch when set; = sum(slot_batches)),
     "last_slot": int in [-1, slots), "slot_batches": [int >= 0] * slots,
     "slots": [stage state | None] * slots, "config": {...}, "data": {...},
     "counters": {"epoch": {name: int >= 0}, "total": {name: int >= 0}}}

where ``slots = max(num_workers, 1)``; a stage state is
``{"kind", "window": int >= 0, "emitted": int >= 0, "upstream": <stage state>}`` for a
windowed stage (tokenize, shuffle, pack, row_batch, pad_batch; ``emitted`` is checked against
the window's outputs when it is recomputed), ``{"kind": "shards", "pass", "shard", "offset"}``
for a shard source (``shard`` in ``[0, shards of the slot in that pass]``, ``offset`` at most
the shard's sample count when known, ``pass`` the loader's epoch unless it cycles) and
``{"kind": "index", "pass", "position"}`` for a sequence source (``position`` at most the
slot's item count). Integers are ``int`` (not ``bool``, ``float`` or ``str``). Anything else
raises :class:`~rlbuffers.stream.StreamStateError` naming the key, what was expected and what
was found; a state that fails leaves the loader as it was.
"""

from __future__ import annotations

from typing import Any

from rlbuffers.stream.errors import ShardError, StreamStateError


def state_dict_of(value: Any, where: str) -> dict[str, Any]:
    """``value`` if it is a dict.

    Raises:
        StreamStateError: it is not (``where`` named).
    """
    if not isinstance(value, dict):
        raise StreamStateError(f"state '{where}': expected a dict, got "
                               f"{type(value).__name__} {value!r:.60}")
    return value


def state_int(state: dict[str, Any], key: str, where: str, *, low: int = 0,
              high: int | None = None) -> int:
    """``state[key]``, an int in ``[low, high]``.

    Raises:
        StreamStateError: missing, not an int, or out of range (``where.key`` named).
    """
    name = f"{where}.{key}" if where else key
    if key not in state:
        raise StreamStateError(f"state '{name}': expected an int, got nothing (missing)")
    value = state[key]
    expected = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise StreamStateError(f"state '{name}': expected {expected}, got "
                               f"{type(value).__name__} {value!r:.60}")
    if value < low or high is not None and value > high:
        raise StreamStateError(f"state '{name}': expected {expected}, got {value}")
    return value


def state_list(state: dict[str, Any], key: str, where: str, length: int) -> list[Any]:
    """``state[key]``, a list of ``length`` items.

    Raises:
        StreamStateError: missing, not a list, or of another length.
    """
    name = f"{where}.{key}" if where else key
    value = state.get(key)
    if not isinstance(value, list) or len(value) != length:
        got = f"{len(value)} items" if isinstance(value, list) else \
            f"{type(value).__name__} {value!r:.60}"
        raise StreamStateError(f"state '{name}': expected a list of {length} items, got {got}")
    return value


def state_counters(value: Any, names: tuple[str, ...], where: str) -> dict[str, int]:
    """A ``{name: int >= 0}`` dict over ``names`` (missing ones 0; others refused)."""
    counts = state_dict_of(value if value is not None else {}, where)
    unknown = sorted(set(counts) - set(names))
    if unknown:
        raise StreamStateError(f"state '{where}': expected counters among {list(names)}, got "
                               f"{unknown}")
    return {k: state_int(counts, k, where) if k in counts else 0 for k in names}


class ShardManifestError(ShardError):
    """A ``shards.json`` is not a shard manifest: the key, what was expected and what was found
    are named."""


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """``manifest`` (a parsed ``shards.json``) if it has the manifest's shape:
    ``{"shards": [{"name": str, "samples": int >= 0, "bytes"?: int >= 0}, ...],
    "samples"?: int = the sum}``; shard names are plain file names (no directories).

    Raises:
        ShardManifestError: it does not (``where``, the key, expected and actual value named).
    """
    if not isinstance(manifest, dict):
        raise ShardManifestError(f"{where}: expected a JSON object, got "
                            f"{type(manifest).__name__}")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise ShardManifestError(f"{where}: 'shards': expected a list, got {shards!r:.60}")
    total = 0
    for i, entry in enumerate(shards):
        key = f"shards[{i}]"
        if not isinstance(entry, dict):
            raise ShardManifestError(f"{where}: '{key}': expected an object, got {entry!r:.60}")
        name = entry.get("name")
        if not isinstance(name, str) or not name or "/" in name or "\\" in name \
                or name in (".", ".."):
            raise ShardManifestError(f"{where}: '{key}.name': expected a file name, got "
                                f"{name!r:.60}")
        for field in ("samples", "bytes"):
            value = entry.get(field)
            if field == "bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ShardManifestError(f"{where}: '{key}.{field}': expected an int >= 0, got "
                                    f"{value!r:.60}")
        total += entry["samples"]
    if "samples" in manifest and (isinstance(manifest["samples"], bool)
                                  or manifest["samples"] != total):
        raise ShardManifestError(f"{where}: 'samples': expected {total} (the sum over its shards), "
                            f"got {manifest['samples']!r:.60}")
    return manifest
