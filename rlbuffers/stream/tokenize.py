"""Batch tokenization with HF ``tokenizers`` and a byte-bounded LRU cache keyed by content hash.

The Rust tokenizer is rebuilt lazily in every process from its JSON text, so a
:class:`TextTokenizer` can be pickled or forked into DataLoader workers safely (each worker
gets its own tokenizer and its own cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from rlbuffers.cache import ByteLRUCache
from rlbuffers.stream.errors import ShardError
from rlbuffers.stream.stages import Count, Stage, WindowStage

logger = logging.getLogger(__name__)


def content_key(text: str) -> bytes:
    """16-byte BLAKE2b digest of the UTF-8 text: the cache key."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` (any ``tokenizer.json``) that batch-encodes texts into
    ``int32[n]`` token arrays, with an LRU cache of ``cache_max_bytes`` bytes.

    Args:
        tokenizer_json: the serialized tokenizer (the text of a ``tokenizer.json``).
        cache_max_bytes: cache capacity in bytes per process (token arrays + ~160 bytes per
            entry); 0 disables the cache.
        add_special_tokens: let the tokenizer's post-processor add its special tokens
            (e.g. BERT's ``[CLS]``/``[SEP]``).
        eos_token_id: appended to every sequence when not ``None`` (document separator).

    Raises:
        ValueError: ``tokenizer_json`` is not a valid tokenizer.
    """

    def __init__(self, tokenizer_json: str, *, cache_max_bytes: int = 0,
                 add_special_tokens: bool = False, eos_token_id: int | None = None) -> None:
        self.tokenizer_json = tokenizer_json
        self.add_special_tokens = add_special_tokens
        self.eos_token_id = eos_token_id
        self.cache = ByteLRUCache(cache_max_bytes)
        self._tok: Tokenizer | None = None
        self._pid = -1
        _ = self.tokenizer  # parse now, so that a bad tokenizer fails at construction

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> TextTokenizer:
        """Load a ``tokenizer.json``; ``kwargs`` as for the constructor.

        Raises:
            FileNotFoundError: no such file.
        """
        return cls(Path(path).read_text(encoding="utf-8"), **kwargs)

    @property
    def tokenizer(self) -> Tokenizer:
        """The Rust tokenizer of this process (rebuilt after a fork)."""
        if self._tok is None or self._pid != os.getpid():
            try:
                self._tok = Tokenizer.from_str(self.tokenizer_json)
            except Exception as exn:  # tokenizers raises a bare Exception
                raise ValueError(f"tokenizer_json: not a valid tokenizer ({exn})") from exn
            self._pid = os.getpid()
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int:
        """The id of ``token``.

        Raises:
            KeyError: the vocabulary has no such token.
        """
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r}: not in the vocabulary")
        return int(tid)

    def _encode_ids(self, texts: list[str]) -> list[np.ndarray]:
        tok = self.tokenizer
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        encs = encode(texts, add_special_tokens=self.add_special_tokens)
        return [np.array(e.ids, dtype=np.int32) for e in encs]

    def _encode_uncached(self, texts: list[str]) -> list[np.ndarray]:
        split = self._can_split()
        long = [i for i, t in enumerate(texts) if split and len(t) > 2 * PIECE_CHARS]
        if long:
            short = [i for i in range(len(texts)) if i not in set(long)]
            out: list[np.ndarray] = [None] * len(texts)  # type: ignore[list-item]
            for i, ids in zip(short, self._encode_ids([texts[i] for i in short]), strict=True):
                out[i] = ids
            for i in long:
                out[i] = self._encode_long(texts[i])
        else:
            out = self._encode_ids(texts)
        if self.eos_token_id is None:
            return out
        eos = np.array([self.eos_token_id], dtype=np.int32)
        return [np.concatenate([ids, eos]) for ids in out]

    # -- long texts in pieces -----------------------------------------------------------
    def _can_split(self) -> bool:
        """Whether texts may be tokenized in pieces: no special tokens added per call, no
        truncation or padding configured in the tokenizer (each applies to a whole text)."""
        tok = self.tokenizer
        return (not self.add_special_tokens and getattr(tok, "truncation", None) is None
                and getattr(tok, "padding", None) is None)

    def _encode_long(self, text: str) -> np.ndarray:
        """Token ids of a long text, tokenized in pieces of about :data:`PIECE_CHARS`
        characters cut where the tokenizer gives the same ids (see :func:`find_cuts`), a few
        pieces per batch call: the tokenizer's working memory (~70x the text for HF
        ``tokenizers``: per-byte alignments, one string per token) is then that of a few
        pieces, not of the whole text."""
        cuts = find_cuts(text, self._encode_ids, piece=PIECE_CHARS, window=CUT_WINDOW)
        bounds = list(zip([0, *cuts], [*cuts, len(text)], strict=True))
        parts = []
        for k in range(0, len(bounds), PIECES_PER_CALL):
            parts += self._encode_ids([text[a:b] for a, b in bounds[k:k + PIECES_PER_CALL]])
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text: a list of ``int32[n_i]`` arrays (read-only when cached).

        Texts found in the cache (by :func:`content_key`) are not re-encoded; the others are
        encoded in one ``encode_batch`` call (parallel in Rust).
        """
        if not self.cache.max_bytes:
            return self._encode_uncached(list(texts))
        keys = [content_key(t) for t in texts]
        out: list[np.ndarray | None] = [self.cache.get(k) for k in keys]
        todo = [i for i, ids in enumerate(out) if ids is None]
        if todo:
            for i, ids in zip(todo, self._encode_uncached([texts[i] for i in todo]), strict=True):
                ids.flags.writeable = False
                self.cache.put(keys[i], ids)
                out[i] = ids
        return out  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tok"], state["_pid"] = None, -1
        return state


PIECE_CHARS = 64 * 2**10
"""A text longer than twice this (characters) is tokenized in pieces of about this size."""
PIECES_PER_CALL = 8
"""Pieces of one long text per tokenizer batch call (tokenized in parallel)."""
CUT_WINDOW = 2048
"""Characters each side of a candidate cut that must tokenize the same cut or whole."""


def find_cuts(text: str, encode: Any, *, piece: int = PIECE_CHARS,
              window: int = CUT_WINDOW, tries: int = 8) -> list[int]:
    """Positions, about ``piece`` characters apart, where ``text`` can be cut into pieces that
    tokenize to the same ids as the whole: each is just before a single space that follows a
    non-space and precedes a non-space (where every whitespace-splitting pre-tokenizer, BPE's
    byte-level and SentencePiece's metaspace included, puts a boundary), and is kept only if
    the ``window`` characters on each side give the same ids with ``encode`` (a function
    ``list[str] -> list[ids]``) cut there as whole. At most ``tries`` candidates per cut; a
    stretch without a verified one stays in one piece (no cut is ever a guess)."""
    cuts: list[int] = []
    start = 0
    n = len(text)
    while n - start > 2 * piece:
        target = start + piece
        found = None
        pos = target
        for _ in range(tries):
            j = text.rfind(" ", start + piece // 2, pos)
            if j <= start:
                break
            pos = j
            if text[j - 1].isspace() or text[j + 1].isspace():
                continue
            lo, hi = max(start, j - window), min(n, j + window)
            whole, left, right = encode([text[lo:hi], text[lo:j], text[j:hi]])
            if np.array_equal(whole, np.concatenate([left, right])):
                found = j
                break
        if found is None:  # no verified cut near here: the next piece starts further on
            start = target
            continue
        cuts.append(found)
        start = found
    return cuts


def text_of(item: Any, text_field: str) -> str:
    """The text of one pipeline item: a ``str``, or a shard sample with ``txt`` (UTF-8) or
    ``json`` (the record's ``text_field``, or the record itself when it is a JSON string, as
    grouped shards store texts).

    Raises:
        ShardError: the sample has neither, its ``txt`` is not UTF-8, its ``json`` does not
            parse or lacks a string ``text_field`` (sample key and shard URL named).
    """
    if isinstance(item, str):
        return item
    where = f"sample {item.get('__key__')!r} of {item.get('__url__')!r}"
    try:
        if "txt" in item:
            return item["txt"].decode("utf-8")
        if "json" in item:
            record = json.loads(item["json"])
        else:
            raise ShardError(f"{where}: expected a 'txt' or 'json' entry, got {sorted(item)}")
    except (UnicodeDecodeError, ValueError) as exn:  # JSONDecodeError is a ValueError
        if isinstance(exn, ShardError):
            raise
        kind = "txt" if "txt" in item else "json"
        raise ShardError(f"{where}: its {kind!r} is malformed ({type(exn).__name__}: "
                         f"{exn})") from exn
    if isinstance(record, str):
        return record
    value = record.get(text_field) if isinstance(record, dict) else None
    if isinstance(value, str):
        return value
    raise ShardError(f"{where}: expected a string field {text_field!r} in its json, "
                     f"got keys {sorted(record) if isinstance(record, dict) else record!r}")


def json_texts(items: list[Any], text_field: str) -> list[str] | None:
    """The texts of a window of ``json`` samples decoded in one ``json.loads`` call (about 8x
    cheaper per sample than one call each, which matters for short documents), or None when
    that does not apply cleanly (another kind of item, a malformed record, a record without a
    string ``text_field``): the caller then decodes one by one and names the bad sample.

    The joined array must hold exactly one string or object per sample; a line holding
    several values, or one split over two lines, changes the count or the types and falls
    back to per-sample decoding."""
    try:
        payloads = [x["json"] for x in items]
        records = json.loads(b"[" + b",".join(payloads) + b"]")
    except (TypeError, KeyError, ValueError):
        return None
    if len(records) != len(items):
        return None
    texts = []
    for record in records:
        if type(record) is dict:
            record = record.get(text_field)
        if type(record) is not str:
            return None
        texts.append(record)
    return texts


class Tokenize(WindowStage):
    """Tokenizes ``tokenize_batch_texts`` items at a time (one Rust batch call); yields
    ``int32[n]`` token arrays. Items that already are integer arrays pass through unchanged
    (pre-tokenized sources such as a TokenStore); ``tokenizer`` may then be ``None``.
    """

    kind = "tokenize"
    needs_rng = False

    def __init__(self, upstream: Stage, tokenizer: TextTokenizer | None, *,
                 text_field: str = "text", tokenize_batch_texts: int = 256,
                 read_ahead_windows: int = 0, on_error: str = "raise") -> None:
        super().__init__(upstream, tokenize_batch_texts, salt=2,
                         read_ahead_windows=read_ahead_windows)
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.on_error = on_error

    def prepare(self, items: list[Any]) -> list[Any]:
        """The texts of a window (JSON decoded here, in the read-ahead thread if any), or the
        items unchanged when they all are token arrays. A malformed sample raises
        :class:`ShardError` (``on_error="raise"``) or becomes a
        ``Count({"skipped_malformed": 1})`` marker in its place, logged (``"warn"``)."""
        if all(isinstance(x, np.ndarray) for x in items):
            return items
        field = self.text_field
        texts = json_texts(items, field)
        if texts is not None:
            return texts
        try:
            return [x if isinstance(x, str) else text_of(x, field) for x in items]
        except ShardError:
            if self.on_error == "raise":
                raise
        return [self._text_or_skip(x) for x in items]

    def _text_or_skip(self, item: Any) -> str | Count:
        try:
            return text_of(item, self.text_field)
        except ShardError as exn:
            logger.warning("skipping a malformed sample: %s", exn)
            return Count({"skipped_malformed": 1})

    def process(self, items: list[Any], rng: np.random.Generator) -> list[Any]:
        texts = [x for x in items if isinstance(x, str)]
        if not texts:
            return items
        if self.tokenizer is None:
            raise ValueError("tokenizer: expected a TextTokenizer for text items, got None")
        ids = self.tokenizer.encode_batch(texts)
        if len(texts) == len(items):
            return ids
        it = iter(ids)
        return [next(it) if isinstance(x, str) else x for x in items]
