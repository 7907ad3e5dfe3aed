"""``inspect_path``: a plain-data report on a stored buffer (what ``rlbuffers inspect`` shows).

Reads only committed data (the manifest and the chunks it points at), one chunk at a time, so
it is safe and bounded in memory while a writer is running.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.core.opening import open_checked
from rlbuffers.deprecation import UNSET, renamed_keyword
from rlbuffers.errors import CorruptChunkError, NotABufferError, SnapshotReclaimedError
from rlbuffers.sampling.samplers import PRIORITY
from rlbuffers.storage.location import make_location
from rlbuffers.storage.manifest import Manifest
from rlbuffers.storage.persistent import PersistentTier

#: Restarts of a report whose commit a running writer reclaimed while it was read.
READ_ATTEMPTS = 10


#: Float fields with at most this many values per transition (or per ragged row) get NaN/inf
#: counts; larger ones (float images) are not read just for the counts.
SCAN_MAX_VALUES = 256


class _Stats:
    """Streaming count / mean / std / min / max over the finite values (Chan et al. parallel
    variance update), and counts of NaN and +-inf."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0
        self.lo, self.hi = np.inf, -np.inf
        self.nan = self.inf = 0

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float64).ravel()
        finite = np.isfinite(x)
        if not finite.all():
            self.nan += int(np.isnan(x).sum())
            self.inf += int(np.isinf(x).sum())
            x = x[finite]
        if not len(x):
            return
        n, mean = len(x), float(x.mean())
        delta, tot = mean - self.mean, self.n + n
        self.m2 += float(((x - mean) ** 2).sum()) + delta**2 * self.n * n / tot
        self.mean += delta * n / tot
        self.n = tot
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def report(self) -> dict[str, float | None] | None:
        if not self.n and not (self.nan or self.inf):
            return None
        if not self.n:
            return {"count": 0, "mean": None, "std": None, "min": None, "max": None,
                    "nan": self.nan, "inf": self.inf}
        std = (self.m2 / self.n) ** 0.5
        return {"count": self.n, "mean": self.mean, "std": std, "min": self.lo, "max": self.hi,
                "nan": self.nan, "inf": self.inf}


def _column_stats(tier: PersistentTier, name: str) -> tuple[_Stats, int]:
    """Stats of a column's values over committed slots (ragged: of all its rows' values), and
    the raw bytes of a ragged column."""
    stats, raw = _Stats(), 0
    for c, n in tier.layout.filled_stored_chunks(name, tier.manifest.ring.size):
        data = tier.read_chunk(name, c)[:n]
        if tier.specs[name].ragged:
            raw += sum(int(a.nbytes) for a in data)
            if len(data):
                stats.add(np.concatenate([np.ravel(a) for a in data]))
        else:
            stats.add(data)
    return stats, raw


def _scanned(spec: Any) -> bool:
    return spec.dtype.kind == "f" and int(np.prod(spec.row_shape, dtype=np.int64)) \
        <= SCAN_MAX_VALUES


def inspect_path(
    path: str | os.PathLike[str],
    *,
    verify: bool = False,
    storage_options: dict[str, Any] | None = None,
    commit: int | None = None,
    generation: int | None = UNSET,
) -> dict[str, Any]:
    """Describe the buffer committed at ``path``.

    Returns:
        a JSON-serialisable dict with ``path``, ``format_version``, ``commit``,
        ``committed_at`` (ISO 8601, UTC), ``capacity``, ``size``, ``total_added``, ``episodes``,
        ``chunk_transitions``, ``fields`` (name -> ``shape``, ``dtype``, ``codec``, for a
        stacked field ``stack_axis``, ``stack`` (k), ``stored_shape`` (one frame: what a
        transition stores; ``raw_bytes`` counts frames) and ``next_of`` (its derived fields),
        ``stored_bytes``, ``raw_bytes``, ``ratio``, ``chunks``, ``chunk_transitions``, and
        ``nan`` / ``inf`` counts for float fields of at most ``SCAN_MAX_VALUES`` values per
        transition, else None; statistics are over the finite values),
        ``stored_bytes``, ``sampler``
        (its settings, plus priority stats if prioritized), ``reward`` (stats, if a ``reward``
        field exists), ``metadata``, and with ``verify`` a ``corrupt`` list of
        ``{field, chunk, reason}``.

    Args:
        path: a buffer directory or URL; ``storage_options`` as for ``ReplayBuffer.open``.
        commit: a kept older commit instead of the last (the report is of one commit:
            if a writer reclaims it meanwhile, the report restarts on the latest commit, at
            most ``READ_ATTEMPTS`` times, unless ``commit`` was given).
        generation: deprecated spelling of ``commit``.

    Raises:
        NotABufferError / FormatVersionError: as for ``ReplayBuffer.open``. CorruptChunkError:
        a chunk read for statistics is corrupt (with ``verify``, corrupt chunks are listed
        instead and skipped).
    """
    commit = renamed_keyword("generation", generation, "commit", commit)
    _not_a_run_dir(path)
    loc = make_location(path, storage_options)
    attempts = 0
    while True:
        try:
            return _report(open_checked(loc, commit), verify)
        except SnapshotReclaimedError:
            # a writer saved keep_commits times while we read: read the latest commit
            attempts += 1
            if commit is not None or attempts >= READ_ATTEMPTS:
                raise


#: ``brief`` shows a metadata value whole up to this many characters of JSON.
BRIEF_CHARS = 100


def brief(value: Any, limit: int = BRIEF_CHARS, depth: int = 1) -> str:
    """A metadata value as JSON text of about ``limit`` characters at most: shown whole when
    its JSON fits, else a dict's items each shown the same way (``depth`` levels down), else a
    summary such as ``<dict of 3 keys, 21,802 bytes>`` (``rlbuffers inspect --json`` shows
    every value whole)."""
    text = json.dumps(value, sort_keys=True, allow_nan=True)
    if len(text) <= limit:
        return text
    if isinstance(value, dict) and depth > 0:
        inner = ", ".join(f"{json.dumps(str(k))}: {brief(v, limit // 2, depth - 1)}"
                          for k, v in sorted(value.items()))
        if len(inner) <= 5 * limit // 2:
            return "{" + inner + "}"
    if isinstance(value, str):
        return f"<string of {len(value):,} characters>"
    kind = (f"dict of {len(value)} keys" if isinstance(value, dict) else
            f"list of {len(value)} items" if isinstance(value, list) else type(value).__name__)
    return f"<{kind}, {len(text):,} bytes>"


def _not_a_run_dir(path: str | os.PathLike[str]) -> None:
    """Raise NotABufferError pointing at the buffer when ``path`` is a trainer's run directory
    (a local directory with ``config.json`` and ``buffer/``) rather than a buffer."""
    p = Path(path) if "://" not in str(path) else None
    if p is not None and (p / "buffer").is_dir() and not (p / "zarr.json").exists() \
            and not (p / ".zgroup").exists():
        raise NotABufferError(f"{path} is a run directory: its buffer is {p / 'buffer'} "
                              f"(rlbuffers inspect {p / 'buffer'})")


def _report(tier: PersistentTier, verify: bool) -> dict[str, Any]:
    m = tier.manifest
    report: dict[str, Any] = {
        "path": str(tier.loc),
        "format_version": m.format_version,
        "commit": m.commit,
        "committed_at": dt.datetime.fromtimestamp(m.committed_at, dt.timezone.utc).isoformat(),
        "capacity": m.capacity,
        "size": m.ring.size,
        "total_added": m.ring.total_added,
        "episodes": m.ring.episodes,
        "chunk_transitions": m.layout.base_chunk_rows,
        "metadata": m.metadata,
    }
    corrupt = tier.verify() if verify else []
    report["fields"] = _fields_report(tier, m, skip={(f, c) for f, c, _ in corrupt})
    report["stored_bytes"] = sum(sum(tier.stored_chunks(n).values()) for n in m.specs)
    report["sampler"] = dict(m.sampler)
    bad_fields = {f for f, _, _ in corrupt}
    if PRIORITY in m.specs and PRIORITY not in bad_fields:
        report["sampler"]["priorities"] = _column_stats(tier, PRIORITY)[0].report()
    if "reward" in m.fields and not m.fields["reward"].ragged and "reward" not in bad_fields:
        report["reward"] = _column_stats(tier, "reward")[0].report()
    if verify:
        report["corrupt"] = [{"field": f, "chunk": c, "reason": r} for f, c, r in corrupt]
    return report


def _fields_report(tier: PersistentTier, m: Manifest, skip: set[tuple[str, int]]) -> dict:
    out = {}
    for name, spec in m.fields.items():
        chunks = tier.stored_chunks(name)
        stored = sum(chunks.values())
        stats = None
        stored_spec = spec.column  # a stacked field stores one frame per transition
        if (spec.ragged or _scanned(stored_spec)) and not any(f == name for f, _ in skip):
            try:
                stats, raw = _column_stats(tier, name)
            except CorruptChunkError:
                raw = 0
        else:
            raw = 0
        if not spec.ragged:
            raw = m.ring.size * stored_spec.item_bytes
        counted = stats if stats is not None and _scanned(stored_spec) else None
        stacked = {} if spec.stack_axis is None else {
            "stack_axis": spec.stack_axis, "stack": spec.stack,
            "stored_shape": list(stored_spec.shape),
            "next_of": sorted(n for n, src in m.next_of.items() if src == name)}
        out[name] = {
            "shape": list(spec.shape),
            "dtype": str(spec.dtype),
            "codec": m.codecs[name],
            "stored_bytes": stored,
            "raw_bytes": raw,
            "ratio": round(raw / stored, 3) if stored else None,
            "chunks": len(chunks),
            "chunk_transitions": m.layout.stored_chunk_rows[name],
            "nan": counted.nan if counted is not None else None,
            "inf": counted.inf if counted is not None else None,
            **stacked,
        }
    return out
