"""A stored buffer read in order, oldest first, in bounded memory: pieces of at most
``block_bytes`` (each inside one episode) and whole episodes, one at a time. What the offline
exports (:mod:`rlbuffers.integrations.minari`, :mod:`rlbuffers.integrations.parquet`) stream
from; it reads through the public :class:`~rlbuffers.ReplayBuffer` API only (``buf[a:b]``,
``buf.episode_ids(slice(a, b))``).

Episode boundaries are the buffer's own (:meth:`~rlbuffers.ReplayBuffer.episode_ids`): a row
ends its episode when the next row's episode number differs, or, for the newest row, when
``buf.episodes`` has moved past it. That covers the ``terminated``, ``truncated`` and ``done``
flags and :meth:`~rlbuffers.ReplayBuffer.end_episode` (a reset with no flag) alike. A row also
ends its episode when the next row's ``episode_field`` (e.g. the ``episode`` index that
``rlbuffers convert minari`` stores) differs from its own.

A ring buffer that has wrapped (``total_added > capacity``) overwrote its oldest rows, and with
them, in general, the start of its oldest stored episode: the rows before its first episode
end are dropped (``drop_partial_first``, default True) and counted in
:attr:`EpisodeReader.dropped_rows`. Whether that episode began exactly at the oldest stored
row depends on the episode number of the row just before it, which was overwritten; the ring
keeps only ``total_added`` and ``episodes`` (no start marker per row). One case is certain:
episode ``e`` began at transition id ``>= e`` (every episode has a row), so when the oldest
row's episode number equals its transition id (``total_added - len(buf)``; every earlier
episode was one row long, as in bandit or single-turn data), its episode began there and is
kept whole. The newest episode may be unfinished (``ends`` False).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers.core.opening import READ_CACHE_BYTES
from rlbuffers.storage.location import make_location
from rlbuffers.storage.manifest import read_manifest

#: default most raw bytes read per piece
BLOCK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Piece:
    """Consecutive rows of one episode.

    Attributes:
        rows: ``{field: [n, *shape]}`` (ragged fields: a list of ``n`` arrays).
        episode: the episode's number in this read (0 = the first episode kept).
        start: buffer position (0 = oldest stored) of the first row.
        ends: the last row ends the episode.
    """

    rows: dict[str, Any]
    episode: int
    start: int
    ends: bool

    def __len__(self) -> int:
        return len(next(iter(self.rows.values())))


def row_bytes(spec: Any) -> int:
    """Raw bytes of one row of a field spec (a ragged field counts 1 KiB per row)."""
    if spec.shape and spec.shape[0] is None:
        return 1024
    return max(1, int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize)


def scan_cache_bytes(path: Any, *, block_bytes: int = BLOCK_BYTES,
                     storage_options: dict[str, Any] | None = None) -> int:
    """A reader's decoded-chunk cache (``ReplayBuffer.open(path, mode="r", cache_bytes=...)``)
    big enough to read the buffer at ``path`` once, oldest first, in blocks of
    ``block_bytes`` (an :class:`EpisodeReader`) with every chunk decoded once: one block plus
    two decoded chunks of each column (a smaller field's chunk spans many blocks and must
    stay cached between them), at most ``ReplayBuffer.open``'s default (256 MiB). Ragged
    columns count 1 KiB per row. Reads the last commit's manifest only.

    Raises:
        NotABufferError, FormatVersionError: as ``ReplayBuffer.open``.
    """
    m = read_manifest(make_location(path, storage_options))
    chunks = 0
    for name, spec in m.specs.items():
        rows = min(m.layout.stored_chunk_rows[name], m.capacity)
        chunks += rows * (1024 if spec.ragged else max(1, spec.item_bytes))
    return int(min(READ_CACHE_BYTES, block_bytes + 2 * chunks))


def _take(rows: dict[str, Any], a: int, b: int) -> dict[str, Any]:
    return {k: v[a:b] for k, v in rows.items()}


def concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows of consecutive pieces joined (arrays concatenated, ragged lists chained)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for k, first in parts[0].items():
        if isinstance(first, list):
            out[k] = [r for p in parts for r in p[k]]
        else:
            out[k] = np.concatenate([p[k] for p in parts])
    return out


class EpisodeReader:
    """Read ``buf`` (an open :class:`~rlbuffers.ReplayBuffer`) oldest first, split into
    episodes where :meth:`~rlbuffers.ReplayBuffer.episode_ids` says (end flags and
    ``end_episode()`` alike) and where ``episode_field`` changes.

    Args:
        buf: the buffer (any mode; ``mode="r"`` reads one commit).
        block_bytes: most raw bytes per piece (> 0).
        episode_field: an integer field whose change also ends an episode (None: none; the
            default ``"episode"`` is used only when the buffer has it).
        drop_partial_first: drop the oldest episode of a wrapped ring unless it provably
            began at the oldest stored row: when its episode number equals that row's
            transition id (every earlier episode was one row long; no other case can be
            told, see the module docstring).

    Raises:
        ValueError: ``block_bytes`` < 1, or ``episode_field`` not a field of ``buf``.
    """

    def __init__(self, buf: Any, *, block_bytes: int = BLOCK_BYTES,
                 episode_field: str | None = "episode", drop_partial_first: bool = True) -> None:
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes: expected an int >= 1, got {block_bytes!r}")
        fields = buf.fields
        if episode_field is not None and episode_field not in fields:
            if episode_field != "episode":
                raise ValueError(f"episode_field: expected one of {sorted(fields)}, got "
                                 f"{episode_field!r}")
            episode_field = None
        self.buf = buf
        self.episode_field = episode_field
        self.block_rows = max(1, block_bytes // sum(row_bytes(s) for s in fields.values()))
        #: the ring has overwritten rows (``total_added > capacity``)
        self.wrapped = buf.total_added > buf.capacity
        #: the oldest stored episode began at the oldest stored row (always, unless wrapped)
        self.first_whole = not self.wrapped or (
            len(buf) > 0 and int(buf.episode_ids(0)) == buf.total_added - len(buf))
        self.drop_partial_first = drop_partial_first and not self.first_whole
        #: rows dropped as the partial first episode (known once the read passed them)
        self.dropped_rows = 0
        #: rows read after the dropped ones
        self.rows = 0

    def _ends(self, rows: dict[str, Any], ids: np.ndarray, n: int,
              next_episode: Any) -> np.ndarray:
        """bool[n]: which of ``n`` rows end their episode; ``ids`` holds their episode numbers
        and, when the block is not the last, the next row's."""
        ends = np.zeros(n, dtype=bool)
        ends[:len(ids) - 1] = ids[1:] != ids[:-1]
        if len(ids) == n:  # the newest row: ended when the buffer's count moved past it
            ends[-1] = ids[-1] < self.buf.episodes
        if self.episode_field is not None:
            ep = np.asarray(rows[self.episode_field])
            ends[:-1] |= ep[1:] != ep[:-1]
            if next_episode is not None:
                ends[-1] |= ep[-1] != next_episode
        return ends

    def pieces(self) -> Iterator[Piece]:
        """The rows in pieces of at most ``block_bytes``, each inside one episode."""
        size, step = len(self.buf), self.block_rows
        episode, skipping = 0, self.drop_partial_first
        self.dropped_rows = self.rows = 0
        pos = 0
        while pos < size:
            end = min(size, pos + step)
            block = self.buf[pos:end]
            ids = self.buf.episode_ids(slice(pos, end + 1))  # and the next row's, if any
            nxt = None
            if self.episode_field is not None and end < size:
                nxt = self.buf[end][self.episode_field]
            ends = self._ends(block, ids, end - pos, nxt)
            a = 0
            for b in (*(np.flatnonzero(ends) + 1).tolist(), end - pos):
                if b <= a:
                    continue
                stop = bool(ends[b - 1])
                if skipping:
                    self.dropped_rows += b - a
                    skipping = not stop
                else:
                    self.rows += b - a
                    yield Piece(_take(block, a, b), episode, pos + a, stop)
                    episode += stop
                a = b
            pos = end
    def __iter__(self) -> Iterator[Piece]:
        """Whole episodes, one at a time (each a :class:`Piece`; the newest may be unfinished:
        ``ends`` False)."""
        parts: list[Piece] = []
        for piece in self.pieces():
            parts.append(piece)
            if piece.ends:
                yield self._join(parts)
                parts = []
        if parts:
            yield self._join(parts)

    @staticmethod
    def _join(parts: list[Piece]) -> Piece:
        return Piece(concat([p.rows for p in parts]), parts[0].episode, parts[0].start,
                     parts[-1].ends)
