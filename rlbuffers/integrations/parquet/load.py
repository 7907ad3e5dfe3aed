"""``from_parquet``: a Parquet export (:func:`~rlbuffers.integrations.parquet.to_parquet`'s
layout: ``data/**.parquet`` + ``meta/info.json``) back into a new buffer, read a record batch
at a time (``rlbuffers convert parquet``). Episodes end where ``episode_index`` changes (and
after the last row when ``last_episode_ended``), whatever the end flags say, so episodes that
ended without a flag come back too."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from rlbuffers.buffer import ReplayBuffer
from rlbuffers.integrations.parquet.columns import to_numpy
from rlbuffers.integrations.parquet.export import FORMAT
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.compression import DEFAULT_CODEC

__all__ = ["from_parquet", "read_info"]


def read_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta/info.json`` of an export at ``path``.

    Raises:
        FileNotFoundError: no ``meta/info.json``. ValueError: not this layout's info.
    """
    p = Path(path) / "meta" / "info.json"
    if not p.is_file():
        raise FileNotFoundError(f"path: expected a Parquet export (a directory with "
                                f"meta/info.json), got {str(path)!r}: no {p}")
    info = json.loads(p.read_text())
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"path: {p} is not an rlbuffers Parquet export (format "
                         f"{info.get('format') if isinstance(info, dict) else None!r}, "
                         f"expected {FORMAT!r})")
    return info


def _batches(root: Path, info: dict[str, Any], fields: dict[str, FieldSpec],
             rows: int) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    names = [*fields, "episode_index"]
    enc = {n: info["fields"][n].get("encoding", "list") for n in fields}
    for f in info["files"]:
        for batch in pq.ParquetFile(root / f["path"]).iter_batches(batch_size=rows,
                                                                   columns=names):
            cols = {n: to_numpy(tuple(s.shape), s.dtype, batch.column(n), enc[n])
                    for n, s in fields.items()}
            yield cols, batch.column("episode_index").to_numpy()


def from_parquet(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 capacity: int | None = None, chunk_transitions: int | None = None,
                 codec: str = DEFAULT_CODEC, seed: int | None = None, overwrite: bool = False,
                 batch_bytes: int = 32 * 2**20,
                 progress: Callable[[int, int], None] | None = None) -> ReplayBuffer:
    """Read an export into a new buffer at ``out`` (committed once, at the end; returned open).

    Args:
        path: the export's directory.
        capacity: ring size (default: the export's rows).
        chunk_transitions, codec, seed, overwrite: as :meth:`rlbuffers.ReplayBuffer.create`.
        batch_bytes: most raw bytes read at a time (>= 1).
        progress: called as ``progress(rows_done, total_rows)`` after each batch.

    Returns:
        the buffer: the export's fields, rows and episodes; its metadata is the exported
        buffer's plus ``converted_from``.

    Raises:
        FileNotFoundError: as :func:`read_info`.
        ValueError: as :func:`read_info`, or ``batch_bytes`` < 1.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
        raise ValueError(f"batch_bytes: expected an int >= 1, got {batch_bytes!r}")
    root = Path(path)
    info = read_info(root)
    fields = {n: FieldSpec(tuple(f["shape"]), f["dtype"]) for n, f in info["fields"].items()}
    total = int(info["total_frames"])
    row = sum(max(1, int(np.prod([d or 256 for d in s.shape], dtype=np.int64)))
              * np.dtype(s.dtype).itemsize for s in fields.values())
    buf = ReplayBuffer.create(out, capacity=capacity or total, fields=fields,
                              chunk_transitions=chunk_transitions, codec=codec, seed=seed,
                              overwrite=overwrite)
    try:
        done, prev = 0, None
        for cols, episode in _batches(root, info, fields, max(1, batch_bytes // row)):
            starts = np.flatnonzero(np.diff(episode)) + 1
            if prev is not None and len(episode) and episode[0] != prev:
                buf.end_episode()
            a = 0
            for b in (*starts.tolist(), len(episode)):
                buf.extend({n: v[a:b] for n, v in cols.items()})
                if b < len(episode):
                    buf.end_episode()
                a = b
            prev = episode[-1] if len(episode) else prev
            done += len(episode)
            if progress is not None:
                progress(done, total)
        if info.get("last_episode_ended"):
            buf.end_episode()
        buf.save(metadata={**(info.get("metadata") or {}),
                           "converted_from": {"format": "parquet", "path": str(root),
                                              "rows": done,
                                              "episodes": info["total_episodes"]}})
    except BaseException:
        buf.close()
        raise
    return buf
