"""A memory-mapped token store: sequences of token ids in one flat file plus offsets.

Directory layout (format ``rlbuffers.token_store/1``)::

    tokens.bin    dtype[total_tokens]   every sequence back to back (uint16 / uint32 / int32)
    offsets.bin   int64[N + 1]          sequence i is tokens[offsets[i]:offsets[i + 1]]
    meta.json     {"format", "dtype", "sequences", "tokens"}   written last (the commit)

The writer fills ``<path>.tmp-<pid>`` and renames it to ``<path>`` on close, so a crash never
leaves a half-written store under ``path``. Reading maps both files: ``store[i]`` costs O(1)
time and memory whatever the store size.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from rlbuffers.stream.errors import TokenStoreError
from rlbuffers.stream.tokenize import TextTokenizer

FORMAT = "rlbuffers.token_store/1"
_DTYPES = ("uint16", "uint32", "int32")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest supported token dtype for ids in ``[0, vocab_size)``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TokenStoreWriter:
    """Appends sequences to a new token store at ``path`` with bounded RAM (one batch).

    Args:
        dtype: ``"uint16"``, ``"uint32"`` or ``"int32"``.
        overwrite: replace an existing store at ``path``.

    Raises:
        TokenStoreError: ``path`` exists and ``overwrite`` is False.
        ValueError: an unsupported ``dtype``.
    """

    def __init__(self, path: str | os.PathLike[str], *, dtype: str = "uint32",
                 overwrite: bool = False) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {_DTYPES}, got {dtype!r}")
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise TokenStoreError(f"token store {str(self.path)!r}: already exists "
                                  "(pass overwrite=True to replace it)")
        self.dtype = np.dtype(dtype)
        self._tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._tokens = open(self._tmp / "tokens.bin", "wb")
        self._offsets = open(self._tmp / "offsets.bin", "wb")
        self._offsets.write(np.zeros(1, np.int64).tobytes())
        self.sequences = 0
        self.tokens = 0

    def extend(self, seqs: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append sequences (token ids each).

        Raises:
            ValueError: an id does not fit ``dtype`` (value and dtype named).
        """
        if not seqs:
            return
        arrays = [np.asarray(s) for s in seqs]
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        info = np.iinfo(self.dtype)
        if flat.size and (flat.min() < info.min or flat.max() > info.max):
            raise ValueError(f"token ids: expected values in [{info.min}, {info.max}] for "
                             f"dtype {self.dtype}, got [{flat.min()}, {flat.max()}]")
        self._tokens.write(flat.astype(self.dtype, copy=False).tobytes())
        ends = self.tokens + np.cumsum([len(a) for a in arrays], dtype=np.int64)
        self._offsets.write(ends.tobytes())
        self.sequences += len(arrays)
        self.tokens = int(ends[-1])

    def close(self) -> TokenStore:
        """Flush, write ``meta.json``, move the store into place; returns it opened."""
        for f in (self._tokens, self._offsets):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        meta = {"format": FORMAT, "dtype": self.dtype.name, "sequences": self.sequences,
                "tokens": self.tokens}
        (self._tmp / "meta.json").write_text(json.dumps(meta))
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self._tmp, self.path)
        return TokenStore(self.path)

    def __enter__(self) -> TokenStoreWriter:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._tokens.close()
            self._offsets.close()
            shutil.rmtree(self._tmp, ignore_errors=True)


class TokenStore(Sequence[np.ndarray]):
    """Read-only, memory-mapped token store (see the module docstring for the layout).

    ``store[i]`` is a read-only ``dtype[n_i]`` view (O(1) time and memory); ``len(store)`` is
    the number of sequences. Usable as the data of
    :meth:`~rlbuffers.stream.StreamLoader.from_sequence`.

    Raises:
        TokenStoreError: no ``meta.json`` (missing or unfinished store), an unknown format, or
            files whose sizes disagree with it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.exists():
            raise TokenStoreError(f"token store {str(self.path)!r}: no meta.json "
                                  "(not a token store, or its writer was not closed)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise TokenStoreError(f"token store {str(self.path)!r}: 'format' expected "
                                  f"{FORMAT!r}, got {meta.get('format')!r}")
        self.dtype = np.dtype(meta["dtype"])
        self.num_tokens = int(meta["tokens"])
        n = int(meta["sequences"])
        self._offsets = self._map("offsets.bin", np.dtype(np.int64), n + 1)
        self._tokens = self._map("tokens.bin", self.dtype, self.num_tokens)

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        path = self.path / name
        expected = count * dtype.itemsize
        if not path.exists() or path.stat().st_size != expected:
            found = path.stat().st_size if path.exists() else "no file"
            raise TokenStoreError(f"token store {str(self.path)!r}: {name} expected "
                                  f"{expected} bytes, got {found}")
        if count == 0:
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        """Sequence ``index`` (negative indices count from the end).

        Raises:
            IndexError: out of range (a :class:`TokenStoreError` too).
        """
        n = len(self)
        i = int(index) + n if int(index) < 0 else int(index)
        if not 0 <= i < n:
            raise _StoreIndexError(f"token store index: expected -{n} <= index < {n}, got {index}")
        return self._tokens[int(self._offsets[i]):int(self._offsets[i + 1])]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def length(self, index: int) -> int:
        """Tokens in sequence ``index`` (O(1))."""
        return int(self._offsets[index + 1] - self._offsets[index])


class _StoreIndexError(TokenStoreError, IndexError):
    """Index out of range."""


def build_token_store(path: str | os.PathLike[str], texts: Iterable[str],
                      tokenizer: TextTokenizer, *, batch_texts: int = 1024,
                      dtype: str | None = None, overwrite: bool = False,
                      progress: bool = True, total: int | None = None) -> TokenStore:
    """Tokenize ``texts`` in one streaming pass (``batch_texts`` at a time, so RAM holds one
    batch) into a token store at ``path``, with a tqdm progress bar (``total``: texts, if
    known). ``dtype`` defaults to :func:`dtype_for_vocab` of the tokenizer.

    Raises:
        TokenStoreError: ``path`` exists and ``overwrite`` is False.
    """
    dtype = dtype or dtype_for_vocab(tokenizer.vocab_size)
    bar = tqdm(desc=f"building token store {path}", unit=" texts", total=total,
               disable=not progress)
    writer = TokenStoreWriter(path, dtype=dtype, overwrite=overwrite)
    with writer, bar:
        batch: list[str] = []
        for text in texts:
            batch.append(text)
            if len(batch) >= batch_texts:
                writer.extend(tokenizer.encode_batch(batch))
                bar.update(len(batch))
                batch = []
        writer.extend(tokenizer.encode_batch(batch))
        bar.update(len(batch))
    return TokenStore(path)
