"""Configuration of the streaming loader: what is common to both batching modes
(:class:`StreamConfig`), and what belongs to one of them only (:class:`Packing`,
:class:`Padding`), so that a packing option cannot sit unused beside a padding one.

Every field is checked when the dataclass is built: integers must be ``int`` (not ``bool``,
``float`` or ``str``), within their range; a bad value raises ``ValueError`` naming the field,
what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from rlbuffers.stream.padding import AttentionKind

SPEED_ONLY_FIELDS = ("read_ahead_tokenize_batches", "read_ahead_batch_windows")
"""Config fields that change speed, never the batches: left out of the state's fingerprint."""
UNFINGERPRINTED_FIELDS = (*SPEED_ONLY_FIELDS, "max_record_bytes")
"""Left out of the state's fingerprint: speed only, or a safety limit (which raises rather
than changing any batch)."""


def check_int(owner: str, name: str, value: Any, *, low: int, optional: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` >= ``low`` (or ``None`` when
    ``optional``); the message names ``owner.name``, the expectation and the value found."""
    if value is None and optional:
        return
    expected = f"{'None or ' if optional else ''}an int >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name}: expected {expected}, got {value!r} "
                         f"({type(value).__name__})")
    if value < low:
        raise ValueError(f"{owner}.{name}: expected {expected}, got {value}")


def check_choice(owner: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (field named)."""
    if value not in choices:
        raise ValueError(f"{owner}.{name}: expected one of {choices}, got {value!r}")


def check_bool(owner: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a ``bool`` (field named)."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name}: expected a bool, got {value!r} "
                         f"({type(value).__name__})")


@dataclass(frozen=True)
class Packing:
    """Sequence packing: best-fit decreasing into rows of ``StreamConfig.max_length`` tokens."""

    rows_per_batch: int = 8
    """Packed rows per batch: a token budget of ``rows * max_length``."""
    packing_window_sequences: int = 8192
    """Sequences packed together; bounds memory and the work to resume."""

    mode = "pack"

    def __post_init__(self) -> None:
        check_int("Packing", "rows_per_batch", self.rows_per_batch, low=1)
        check_int("Packing", "packing_window_sequences", self.packing_window_sequences, low=1)


@dataclass(frozen=True)
class Padding:
    """Dynamic padding: one sequence per row, rows padded to the longest of the batch.

    Raises:
        ValueError: neither ``batch_size`` nor ``max_tokens`` is given, or a field is out of
            range (named).
    """

    batch_size: int | None = None
    """Sequences per batch; ``None``: limited by ``max_tokens`` only."""
    max_tokens: int | None = None
    """Token budget of one padded batch, ``rows * padded length``."""
    sort_by_length: bool = True
    """Length bucketing within ``bucket_window_sequences``."""
    bucket_window_sequences: int = 1024
    """Sequences sorted and cut into batches together."""
    pad_to_multiple_of: int | None = None
    """Round the padded length up to a multiple of this."""
    fixed_padding: bool = False
    """Pad every batch to ``max_length`` (the baseline dynamic padding improves on)."""

    mode = "pad"

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_tokens", "pad_to_multiple_of"):
            check_int("Padding", name, getattr(self, name), low=1, optional=True)
        check_int("Padding", "bucket_window_sequences", self.bucket_window_sequences, low=1)
        check_bool("Padding", "sort_by_length", self.sort_by_length)
        check_bool("Padding", "fixed_padding", self.fixed_padding)
        if self.batch_size is None and self.max_tokens is None:
            raise ValueError("Padding: expected batch_size or max_tokens, got neither")


@dataclass(frozen=True)
class StreamConfig:
    """How the loader reads, tokenizes, shuffles and batches. Checked when built
    (``ValueError`` naming the field, the expectation and the value).

    ``batching`` is :class:`Packing` (default) or :class:`Padding`; the options of the other
    mode do not exist here, so none can be set without effect.
    """

    max_length: int = 2048
    """Tokens per packed row (packing) or per sequence (padding); at least 2, since a
    sequence's first token has no label."""
    batching: Packing | Padding = field(default_factory=Packing)
    """:class:`Packing` (rows of several sequences) or :class:`Padding` (one per row)."""
    shuffle_buffer_samples: int = 1024
    """Samples shuffled together (block shuffle); ``0`` or ``1`` disables it."""
    shuffle_shards: bool = True
    """Shuffle the shard (or item) order every pass."""
    tokenize_batch_texts: int = 256
    """Texts per tokenizer batch call."""
    read_ahead_tokenize_batches: int = 4
    """Tokenizer batches read from the source and JSON-decoded ahead of the
    tokenizer by a background thread (the Rust tokenizer releases the GIL, so reading and
    encoding overlap); ``0``: no thread. Speed only: batches and states are identical."""
    read_ahead_batch_windows: int = 1
    """Packing (or bucketing) windows tokenized ahead of packing and collation by a second
    background thread; ``0``: no thread. Speed only, like ``read_ahead_tokenize_batches``."""
    text_field: str = "text"
    """The JSON field holding the text of ``json`` samples."""
    overflow: Literal["split", "truncate"] = "split"
    """Sequences over ``max_length``: cut into pieces, or truncate (counted in stats)."""
    pad_token_id: int = 0
    """Token id written at padding positions (masked out of ``labels``)."""
    attention: AttentionKind | None = None
    """``"padding"`` (2-D), ``"block_causal"`` (4-D bool) or ``"none"``; ``None``: padding
    mask for :class:`Padding`, none for :class:`Packing` (use position_ids / cu_seqlens)."""
    seed: int = 0
    """Seed of every shuffle (shards, samples, packed rows, buckets)."""
    batches_per_epoch: int | None = None
    """Batches per epoch per rank; the stream then cycles over passes of the data so every
    rank yields exactly this many. Required when ``world_size > 1``. ``None``: one pass."""
    uneven_shards: Literal["wrap", "drop"] = "wrap"
    """Shard count not a multiple of world_size x workers: repeat or drop shards (logged)."""
    on_error: Literal["raise", "warn"] = "raise"
    """Unreadable shard or malformed sample: raise :class:`~rlbuffers.stream.ShardError`, or
    log it, skip the sample (or the unreadable rest of the shard) and count it in the stats."""
    max_record_bytes: int = 256 * 2**20
    """Largest tar member (record) read from a shard, in bytes (default 256 MiB): a larger
    one raises :class:`~rlbuffers.stream.ShardError` (``RecordTooLargeError``) naming the
    shard, the record and both sizes before any of it is read. Tokenizing a record costs
    several times its size in RAM (see docs/stream.md), so this bounds the loader's memory
    against one oversized or forged record. Not part of the state's fingerprint."""

    def __post_init__(self) -> None:
        owner = "StreamConfig"
        check_int(owner, "max_length", self.max_length, low=2)
        if not isinstance(self.batching, (Packing, Padding)):
            raise ValueError(f"StreamConfig.batching: expected Packing(...) or Padding(...), "
                             f"got {self.batching!r}")
        check_int(owner, "tokenize_batch_texts", self.tokenize_batch_texts, low=1)
        for name in ("shuffle_buffer_samples", "pad_token_id", *SPEED_ONLY_FIELDS):
            check_int(owner, name, getattr(self, name), low=0)
        check_int(owner, "batches_per_epoch", self.batches_per_epoch, low=1, optional=True)
        check_int(owner, "seed", self.seed, low=0)
        check_int(owner, "max_record_bytes", self.max_record_bytes, low=1)
        check_bool(owner, "shuffle_shards", self.shuffle_shards)
        if not isinstance(self.text_field, str):
            raise ValueError(f"StreamConfig.text_field: expected a str, got {self.text_field!r}")
        check_choice(owner, "overflow", self.overflow, ("split", "truncate"))
        check_choice(owner, "uneven_shards", self.uneven_shards, ("wrap", "drop"))
        check_choice(owner, "on_error", self.on_error, ("raise", "warn"))
        check_choice(owner, "attention", self.attention, (None, "none", "padding", "block_causal"))

    @property
    def mode(self) -> str:
        """``"pack"`` or ``"pad"``: the kind of ``batching``."""
        return self.batching.mode

    @property
    def attention_kind(self) -> AttentionKind:
        """The effective ``attention`` (its default depends on the batching mode)."""
        if self.attention is not None:
            return self.attention
        return "padding" if self.mode == "pad" else "none"

    def fingerprint(self) -> dict[str, Any]:
        """The fields that decide the batches, flat (``batching.rows_per_batch``, ...): what a
        loader state must match. Read-ahead fields are left out (speed only)."""
        out: dict[str, Any] = {"mode": self.mode}
        for f in dataclasses.fields(self):
            if f.name in UNFINGERPRINTED_FIELDS:
                continue
            value = getattr(self, f.name)
            if f.name == "batching":
                out.update({f"batching.{k}": v for k, v in dataclasses.asdict(value).items()})
            else:
                out[f.name] = value
        return out
