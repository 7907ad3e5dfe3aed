"""ZarrStorage: a TorchRL ``Storage`` whose rows live in an rlbuffers :class:`~rlbuffers.
ReplayBuffer` on disk, with atomic incremental commits and resume by reopening the path."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

from rlbuffers.integrations import require

require("torchrl", "torchrl")
require("tensordict", "torchrl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import is_tensor_collection  # noqa: E402
from torchrl.data.replay_buffers.storages import Storage, TensorStorage  # noqa: E402

from rlbuffers import ReplayBuffer, SaveReport  # noqa: E402
from rlbuffers.errors import NotABufferError  # noqa: E402
from rlbuffers.integrations.torchrl.keys import Layout, layout_of  # noqa: E402
from rlbuffers.sampling.base import Sampler as BufferSampler  # noqa: E402

__all__ = ["POINTER_FILE", "ZarrStorage"]

#: the file ``dumps(dir)`` writes in ``dir``: the buffer's path and commit number, as JSON
POINTER_FILE = "rlbuffers_storage.json"
#: the commit metadata key holding the stored rows' layout (:class:`keys.Layout` as JSON)
META_KEY = "torchrl"


class ZarrStorage(TensorStorage):
    """A TorchRL storage (``set``/``get``/``len``, ring overwrite with TorchRL's
    ``RoundRobinWriter``) over an rlbuffers :class:`~rlbuffers.ReplayBuffer` at ``path``.

    Each row (one TensorDict of batch ``[]``, or ``[*row_batch]``; or one tensor) is one
    transition of the buffer: every leaf a field (nested keys joined with ``.``), dtypes kept
    (bool, (u)int8-64, float16/32/64, complex; bfloat16 as its uint16 bits). The buffer is
    created at the first write, or opened here if ``path`` holds one (resume: its last commit;
    the replay buffer's writer is moved to the ring's cursor at its first write, whose
    returned indices are the writer's own: call ``rb.loads`` or write once before using
    them). ``commit()`` is one atomic, incremental
    commit; ``dumps(dir)`` commits and writes a pointer that ``loads(dir)`` reopens, so
    TorchRL's ``ReplayBuffer.dumps``/``loads`` work unchanged. Writes append at the ring's
    cursor only (TorchRL's round-robin writers do); ``get`` returns new CPU tensors.

    Args:
        path: the buffer's directory (or fsspec URL).
        max_size: rows held (the buffer's capacity); the oldest are overwritten beyond it.
        seed: seed of the buffer's generator (prioritized draws of ZarrPrioritizedSampler).
        chunk_transitions: rows per stored chunk (None: ~4 MiB of the largest field).
        codec: the chunks' codec, as :meth:`rlbuffers.ReplayBuffer.create`; the default
            ``"blosc-lz4"`` (not the library's ``"blosc-zstd"``) because a commit's time is
            its encoding: LZ4 encodes Atari frames ~7x and incompressible floats ~2.5x faster
            than zstd, for chunks ~2x (frames) or ~5% (floats) larger (docs/torchrl.md).
        working_dir, keep_commits: as :meth:`rlbuffers.ReplayBuffer.create`.

    Raises:
        ValueError: ``max_size`` < 1, or ``path`` holds a buffer of another capacity or one
            not written by a ZarrStorage.
    """

    def __init__(self, path: str | os.PathLike[str], max_size: int, *, seed: int | None = None,
                 chunk_transitions: int | None = None, codec: str = "blosc-lz4",
                 working_dir: str | os.PathLike[str] | None = None,
                 keep_commits: int | None = None) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"ZarrStorage max_size: expected an int >= 1, got {max_size!r}")
        Storage.__init__(self, max_size)  # TensorStorage's holds its rows in memory: not here
        self.ndim, self.device, self._last_cursor = 1, torch.device("cpu"), None
        self.path = os.fspath(path)
        self._create_args: dict[str, Any] = {"seed": seed, "chunk_transitions": chunk_transitions,
                             "codec": codec, "working_dir": working_dir,
                             "keep_commits": keep_commits}
        self._buffer: ReplayBuffer | None = None
        self._layout: Layout | None = None
        self._open_existing()

    # TensorStorage's in-memory state, as properties over the buffer (TorchRL's samplers,
    # writers and collate functions read these)
    initialized = property(lambda self: self._buffer is not None)
    _storage_keys = property(lambda self: None)
    _total_shape = property(lambda self: torch.Size([self.max_size]))

    @property
    def _len(self) -> int:
        return len(self)

    @_len.setter
    def _len(self, value: int) -> None:
        """Ignored: the length is the buffer's (writers set it after writing)."""

    # -- the buffer -----------------------------------------------------------------------------

    @property
    def buffer(self) -> ReplayBuffer | None:
        """The rlbuffers buffer (None until the first write of a new path)."""
        return self._buffer

    def _open_existing(self) -> None:
        try:
            buf = ReplayBuffer.open(self.path, working_dir=self._create_args["working_dir"])
        except NotABufferError:
            return
        if buf.capacity != self.max_size:
            buf.close()
            raise ValueError(f"ZarrStorage max_size: expected the capacity of the buffer at "
                             f"{self.path!r} ({buf.capacity}), got {self.max_size}")
        if META_KEY not in buf.metadata:
            buf.close()
            raise ValueError(f"ZarrStorage path: the buffer at {self.path!r} was not written "
                             f"by a ZarrStorage (no metadata[{META_KEY!r}])")
        self._buffer, self._layout = buf, Layout.from_json(buf.metadata[META_KEY])

    def _create(self, data: Any) -> ReplayBuffer:
        return self._create_from(layout_of(data))

    def _create_from(self, layout: Layout) -> ReplayBuffer:
        buf = ReplayBuffer.create(self.path, capacity=self.max_size, fields=layout.fields(),
                                  sampler=self._wanted_sampler(), overwrite=True,
                                  **self._create_args)
        buf.save(metadata={META_KEY: layout.to_json()})
        self._buffer, self._layout = buf, layout
        return buf

    def _wanted_sampler(self) -> BufferSampler | None:
        """The buffer sampler a ZarrPrioritizedSampler of an attached replay buffer asks for."""
        for ent in self._attached_entities:
            make = getattr(getattr(ent, "_sampler", None), "buffer_sampler", None)
            if make is not None:
                return make()
        return None

    def commit(self, metadata: dict[str, Any] | None = None) -> SaveReport | None:
        """Commit the rows written so far, atomically (only changed chunks are written), with
        the JSON ``metadata`` merged into the commit's. Returns the report (None: nothing was
        ever written).

        Raises:
            TypeError: ``metadata`` is not JSON. OSError: the write failed (the last commit
                stays intact).
        """
        if self._buffer is None or self._layout is None:
            return None
        meta = {**self._buffer.metadata, **(metadata or {}), META_KEY: self._layout.to_json()}
        return cast(SaveReport, self._buffer.save(metadata=meta))  # not background: a report

    def close(self) -> None:
        """Close the buffer (changes since the last commit are discarded)."""
        if self._buffer is not None:
            self._buffer.close()

    # -- TorchRL's Storage contract -------------------------------------------------------------

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write rows at ``cursor`` (an int, slice, int list or int64 tensor of storage
        indices), which must be the next slots of the ring (``cursor``, ``cursor + 1``, ...
        modulo ``max_size``), as TorchRL's round-robin writers give them. ``data``: one row
        (int cursor) or a TensorDict / tensor of ``len(cursor)`` rows (a list: stacked).

        Raises:
            NotImplementedError: ``set_cursor=False`` (``storage[i] = x``: no overwrite in
                place).
            ValueError: ``cursor`` is not the ring's next slots, or ``data`` differs from the
                first write's keys, dtypes or shapes.
            TypeError: ``data`` has a leaf that cannot be stored.
        """
        if not set_cursor:
            raise NotImplementedError("ZarrStorage: writing in place (set_cursor=False, "
                                      "storage[i] = x) is not supported; rows are appended")
        slots, single = self._slots(cursor, self.max_size)
        if isinstance(data, list):
            data = torch.stack(data) if data and is_tensor_collection(data[0]) else \
                torch.stack([torch.as_tensor(d) for d in data])
        if single:
            data = data.unsqueeze(0)
        n = len(slots)
        buf = self._buffer if self._buffer is not None else self._create(data)
        fresh_writer = self._check_cursor(buf, slots)
        fields = self._row_layout().to_fields(data, n)
        if fresh_writer is not None:  # a TensorDict writer stamped its own slots in "index"
            want = (buf.total_added + np.arange(n)) % self.max_size
            for e in self._row_layout().entries:
                if e.key == ("index",) and e.kind == "dense" and fields[e.field].shape[1:] == ():
                    fields[e.field] = want.astype(fields[e.field].dtype)
        buf.extend(fields)
        if fresh_writer is not None:
            fresh_writer.load_state_dict({"_cursor": buf.total_added % self.max_size,
                                          "_write_count": buf.total_added})
        for ent in self._attached_entities:  # its sampler learns its storage
            bind = getattr(getattr(ent, "_sampler", None), "bind", None)
            if bind is not None:
                bind(self)
        self._set_last_cursor(int(self._slot_of_newest()))
        self._bump_mutation_revision()

    def _check_cursor(self, buf: ReplayBuffer, slots: np.ndarray) -> Any:
        """None if ``slots`` are the ring's next ones. If they are another contiguous run that
        an attached replay buffer's writer gave (a fresh writer over a reopened buffer, or one
        whose cursor moved past a failed write), that writer, to move to the ring's cursor.
        Else ValueError."""
        n = len(slots)
        want = (buf.total_added + np.arange(n)) % self.max_size
        if np.array_equal(slots, want):
            return None
        if n and np.array_equal(slots, (slots[0] + np.arange(n)) % self.max_size):
            for ent in self._attached_entities:
                writer = getattr(ent, "_writer", None)
                if writer is not None and getattr(writer, "_storage", None) is self:
                    return writer
        raise ValueError(f"ZarrStorage.set cursor: expected the ring's next slots "
                         f"{want[:4].tolist()}{'...' if n > 4 else ''}, got "
                         f"{slots[:4].tolist()}{'...' if n > 4 else ''} (rows are "
                         "appended: use a round-robin writer)")

    def _row_layout(self) -> Layout:
        """The rows' layout (set with the buffer: by ``_create`` or from an opened commit)."""
        if self._layout is None:
            raise RuntimeError(f"{self.path}: ZarrStorage has a buffer but no row layout")
        return self._layout

    def _slot_of_newest(self) -> int:
        if self._buffer is None:
            raise RuntimeError(f"{self.path}: ZarrStorage holds no rows yet (no newest slot)")
        return (self._buffer.total_added - 1) % self.max_size

    @staticmethod
    def _slots(cursor: Any, bound: int) -> tuple[np.ndarray, bool]:
        if isinstance(cursor, (int, np.integer)) or (
                isinstance(cursor, torch.Tensor) and cursor.ndim == 0):
            return np.array([int(cursor)], dtype=np.int64), True
        if isinstance(cursor, slice):
            return np.arange(*cursor.indices(bound), dtype=np.int64), False
        if isinstance(cursor, range):
            return np.asarray(cursor, dtype=np.int64), False
        if isinstance(cursor, torch.Tensor):
            return cursor.detach().cpu().numpy().astype(np.int64).ravel(), False
        return np.asarray(cursor, dtype=np.int64).ravel(), False

    def get(self, index: Any) -> Any:
        """Rows at storage indices ``index`` (an int, slice, int list/array/tensor of any shape
        ``S``; negative: from ``len``) as a TensorDict of batch ``[*S, *row_batch]`` (a tensor
        for a storage of tensors), read from disk into new CPU tensors. A key (a str or tuple
        of str) gives that leaf of every row, ``[len, *shape]``.

        Raises:
            RuntimeError: nothing was written yet.
            IndexError: an index outside ``[-len, len)``.
        """
        n = len(self)
        if self._buffer is None or self._layout is None or n == 0:
            raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        if isinstance(index, str) or (isinstance(index, tuple) and index
                                      and all(isinstance(k, str) for k in index)):
            return self.get(slice(None))[index]  # a key: that leaf of every row, as TorchRL
        if isinstance(index, tuple) and len(index) == 1:  # (index,): dim 0 of a 1-d storage
            index = index[0]
        if isinstance(index, slice):
            idx = np.arange(*index.indices(n), dtype=np.int64)
        elif isinstance(index, torch.Tensor):
            idx = index.detach().cpu().numpy().astype(np.int64)
        else:
            idx = np.asarray(index, dtype=np.int64)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise IndexError(f"ZarrStorage.get index: expected indices in [{-n}, {n}), got "
                             f"{idx[bad].ravel()[:4].tolist()}")
        slots = idx % n
        buf = self._buffer
        start = (buf.total_added - n) % self.max_size
        rows = buf[(slots.ravel() - start) % self.max_size]
        return self._layout.from_fields(rows, idx.shape)

    def __len__(self) -> int:
        return 0 if self._buffer is None else len(self._buffer)

    def _empty(self) -> None:
        """Remove every row: the buffer at ``path`` is created anew, empty (commit 1 of a new
        buffer with the same layout)."""
        if self._buffer is not None and self._layout is not None:
            self._buffer.close()
            self._buffer = None
            self._create_from(self._layout)
        self._bump_mutation_revision()

    def contains(self, item: Any) -> Any:
        """Whether storage index ``item`` (an int or int tensor) holds a row."""
        if isinstance(item, int):
            return -len(self) <= item < len(self)
        t = torch.as_tensor(item)
        return (t >= -len(self)) & (t < len(self))

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the buffer's path, last commit number and length (the rows are on
        disk; ``load_state_dict`` reopens that commit)."""
        commit = None if self._buffer is None else self._buffer.commit
        return {"path": self.path, "commit": commit, "len": len(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reopen the buffer at ``state_dict['path']`` at its last commit, which must be
        ``state_dict['commit']``.

        Raises:
            ValueError: that buffer's last commit is another one (it moved on or is gone).
        """
        self._reopen(os.fspath(state_dict["path"]), state_dict["commit"])

    def _reopen(self, path: str, commit: int | None) -> None:
        self.close()
        self._buffer, self._layout, self.path = None, None, path
        self._open_existing()
        found = None if self._buffer is None else self._buffer.commit
        if found != commit:
            raise ValueError(f"ZarrStorage: expected commit {commit} of the buffer at "
                             f"{path!r}, found {found} (its last commit moved on, or it is "
                             "gone); reopen it with ZarrStorage(path, max_size) instead")
        self._bump_mutation_revision()

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Commit (incrementally), then write ``path/rlbuffers_storage.json`` pointing at that
        commit (no rows are copied).

        Raises:
            OSError: the commit or the pointer could not be written.
        """
        report = self.commit()
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        pointer = {"path": os.path.abspath(self.path) if "://" not in self.path else self.path,
                   "commit": None if report is None else report.commit,
                   "max_size": self.max_size}
        tmp = d / (POINTER_FILE + ".tmp")
        tmp.write_text(json.dumps(pointer))
        os.replace(tmp, d / POINTER_FILE)

    def loads(self, path: str | os.PathLike[str]) -> None:
        """Reopen the commit that ``dumps(path)`` pointed at (the buffer's last commit).

        Raises:
            FileNotFoundError: no pointer in ``path``.
            ValueError: the buffer's last commit is not that one, or another ``max_size``.
        """
        pointer = json.loads((Path(path) / POINTER_FILE).read_text())
        if pointer["max_size"] != self.max_size:
            raise ValueError(f"ZarrStorage.loads: expected max_size {pointer['max_size']} of "
                             f"the dumped storage, this storage has {self.max_size}")
        self._reopen(pointer["path"], pointer["commit"])

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("ZarrStorage cannot be pickled (it holds the buffer's writer lock); "
                        "share the path and open it read-only instead")

    def __repr__(self) -> str:
        return f"ZarrStorage({self.path!r}, max_size={self.max_size}, len={len(self)})"

