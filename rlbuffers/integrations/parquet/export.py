"""``to_parquet``: a buffer as Parquet files plus ``meta/info.json`` (``rlbuffers export
parquet``), the tabular layout LeRobot v3 uses, which ``datasets.load_dataset("parquet", ...)``
reads and the Hugging Face Hub serves::

    OUT/data/chunk-000/file-000.parquet   rows in buffer order, oldest first
    OUT/data/chunk-000/file-001.parquet   a new file past ~file_bytes of raw data
    OUT/meta/info.json                    fields, shapes, dtypes, episode offsets, files

Columns: every field (:mod:`~rlbuffers.integrations.parquet.columns`: nested lists, or each
row's raw bytes for rows of >= 4 KiB such as images), plus ``index`` (row number),
``episode_index`` and ``frame_index`` (step within the episode), all int64.
Episodes are the buffer's own (:class:`~rlbuffers.maintenance.episodes.EpisodeReader`, from
:meth:`~rlbuffers.ReplayBuffer.episode_ids`: flags and ``end_episode()`` alike): a wrapped
ring's partial oldest episode is dropped (``source.dropped_rows`` in ``info.json``), and
``last_episode_ended`` says whether the newest episode had ended. Written a piece at a time
(<= 32 MiB raw), so memory stays bounded whatever the buffer's size; the output appears
complete or not at all (written beside ``OUT`` and renamed in).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlbuffers.buffer import ReplayBuffer
from rlbuffers.integrations.parquet.columns import BINARY_BYTES, arrow_type, encoding, to_arrow
from rlbuffers.maintenance.episodes import BLOCK_BYTES, EpisodeReader, Piece, scan_cache_bytes

__all__ = ["FORMAT", "to_parquet"]

#: ``info.json``'s ``format``
FORMAT = "rlbuffers-parquet"
#: files per ``chunk-NNN`` folder (as LeRobot v3)
FILES_PER_CHUNK = 1000
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EXTRA = ("index", "episode_index", "frame_index")


class _Files:
    """Parquet files of at most ~``file_bytes`` raw bytes each, one writer open at a time."""

    def __init__(self, root: Path, schema: pa.Schema, file_bytes: int) -> None:
        self.root, self.schema, self.file_bytes = root, schema, file_bytes
        self.files: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._bytes = 0

    def write(self, table: pa.Table, raw: int) -> None:
        writer = self._writer
        if writer is None or self._bytes + raw > self.file_bytes and self._bytes:
            writer = self._open(int(table.column("index")[0].as_py()))
        writer.write_table(table)
        self._bytes += raw
        self.files[-1]["rows"] += table.num_rows

    def _open(self, first: int) -> pq.ParquetWriter:
        """Close the current file and start the next one (its first row: index ``first``)."""
        self.close()
        n = len(self.files)
        rel = DATA_PATH.format(chunk_index=n // FILES_PER_CHUNK, file_index=n % FILES_PER_CHUNK)
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(self.root / rel, self.schema, compression="zstd")
        self.files.append({"path": rel, "rows": 0, "first_index": first})
        self._bytes = 0
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _table(piece: Piece, fields: dict[str, Any], enc: dict[str, str], schema: pa.Schema,
           index: int, frame: int) -> pa.Table:
    n = len(piece)
    cols = [to_arrow(name, tuple(spec.shape), spec.dtype, piece.rows[name], enc[name])
            for name, spec in fields.items()]
    cols += [pa.array(np.arange(index, index + n, dtype=np.int64)),
             pa.array(np.full(n, piece.episode, dtype=np.int64)),
             pa.array(np.arange(frame, frame + n, dtype=np.int64))]
    return pa.Table.from_arrays(cols, schema=schema)


def _raw_bytes(piece: Piece) -> int:
    return sum(sum(np.asarray(r).nbytes for r in v) if isinstance(v, list) else v.nbytes
               for v in piece.rows.values())


def to_parquet(buffer: ReplayBuffer | str | os.PathLike[str], out: str | os.PathLike[str], *,
               file_bytes: int = 100 * 2**20, overwrite: bool = False,
               drop_partial_first: bool = True, binary_bytes: int | None = BINARY_BYTES,
               cache_bytes: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write the buffer as Parquet files under ``out`` (see the module docstring).

    Args:
        buffer: an open buffer, or its path (opened read-only: the last commit).
        out: a new directory (``overwrite``: replace an earlier export there).
        file_bytes: most raw bytes per file (>= 1; default 100 MiB; files are compressed
            with zstd, so usually smaller).
        drop_partial_first: drop a wrapped ring's partial oldest episode (True) or keep it.
        binary_bytes: fixed-shape fields with rows of at least this many bytes are written as
            raw bytes (``"binary"``; None: every field as lists), see
            :mod:`~rlbuffers.integrations.parquet.columns`.
        cache_bytes: the decoded-chunk cache of the reader opened for a path (None: what one
            ordered read needs, :func:`~rlbuffers.maintenance.episodes.scan_cache_bytes`,
            at most 256 MiB); an open buffer reads through its own.
        progress: called as ``progress(rows_read, buffer_size)`` after each piece.

    Returns:
        the ``info.json`` dict.

    Raises:
        ValueError: ``file_bytes`` < 1, a negative ``cache_bytes``, a complex field, an
            empty buffer, or ``out`` holding something other than an earlier export.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    if isinstance(file_bytes, bool) or not isinstance(file_bytes, int) or file_bytes < 1:
        raise ValueError(f"file_bytes: expected an int >= 1, got {file_bytes!r}")
    dest = Path(out)
    _check_out(dest, overwrite)
    block = min(BLOCK_BYTES, file_bytes)
    own = not isinstance(buffer, ReplayBuffer)
    buf = buffer if isinstance(buffer, ReplayBuffer) else ReplayBuffer.open(
        buffer, mode="r", cache_bytes=scan_cache_bytes(buffer, block_bytes=block)
        if cache_bytes is None else cache_bytes)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    try:
        fields = buf.fields
        if len(buf) == 0:
            raise ValueError(f"buffer: {buf.path} holds no transitions")
        enc = {n: encoding(tuple(s.shape), s.dtype, binary_bytes) for n, s in fields.items()}
        schema = pa.schema([pa.field(n, arrow_type(n, tuple(s.shape), s.dtype, enc[n]))
                            for n, s in fields.items()] + [pa.field(n, pa.int64())
                                                           for n in EXTRA])
        shutil.rmtree(tmp, ignore_errors=True)
        info = _write(buf, tmp, schema, enc, file_bytes, block, drop_partial_first, progress)
        (tmp / "meta").mkdir(parents=True, exist_ok=True)
        (tmp / "meta" / "info.json").write_text(json.dumps(info, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        return info
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own:
            buf.close()


def _check_out(dest: Path, overwrite: bool) -> None:
    if not dest.exists():
        return
    if not overwrite:
        raise FileExistsError(f"out: {dest} exists (overwrite=True replaces an earlier export)")
    if any(dest.iterdir()) and not (dest / "meta" / "info.json").is_file():
        raise ValueError(f"out: {dest} is not empty and holds no Parquet export "
                         "(meta/info.json); refusing to replace it")


def _write(buf: ReplayBuffer, root: Path, schema: pa.Schema, enc: dict[str, str],
           file_bytes: int, block_bytes: int, drop_partial_first: bool,
           progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    fields = buf.fields
    reader = EpisodeReader(buf, block_bytes=block_bytes, drop_partial_first=drop_partial_first)
    files = _Files(root, schema, file_bytes)
    offsets, index, frame, last_ended = [0], 0, 0, True
    try:
        for piece in reader.pieces():
            files.write(_table(piece, fields, enc, schema, index, frame), _raw_bytes(piece))
            index += len(piece)
            frame = 0 if piece.ends else frame + len(piece)
            if piece.ends:
                offsets.append(index)
            last_ended = piece.ends
            if progress is not None:
                progress(reader.rows + reader.dropped_rows, len(buf))
    finally:
        files.close()
    if not last_ended:
        offsets.append(index)
    if index == 0:
        raise ValueError(f"buffer: {buf.path}: no rows left after dropping the wrapped "
                         f"ring's partial first episode ({reader.dropped_rows} rows)")
    return {
        "format": FORMAT, "version": 1, "data_path": DATA_PATH,
        "total_frames": index, "total_episodes": len(offsets) - 1,
        "fields": {n: {"dtype": np.dtype(s.dtype).name, "shape": list(s.shape),
                       "encoding": enc[n]} for n, s in fields.items()},
        "columns": list(schema.names), "episode_offsets": offsets,
        "last_episode_ended": last_ended, "files": files.files,
        "source": {"path": str(buf.path), "commit": buf.commit, "capacity": buf.capacity,
                   "total_added": buf.total_added, "dropped_rows": reader.dropped_rows},
        "metadata": buf.metadata,
    }
