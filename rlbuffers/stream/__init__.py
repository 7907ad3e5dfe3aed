"""Streaming token pipeline: webdataset shards -> tokenize (cached) -> shuffle -> packing or
dynamic padding -> batches, with an exact, plain-data ``state_dict`` for mid-epoch resume.

See ``docs/stream.md``.
"""

from rlbuffers.stream.batching import Pack, PadBatch, Row, RowBatch, budget_batches
from rlbuffers.stream.config import Packing, Padding, StreamConfig
from rlbuffers.stream.errors import ShardError, StreamStateError, TokenStoreError
from rlbuffers.stream.loader import StreamLoader, build_pipeline
from rlbuffers.stream.packing import pack_bfd, split_overflow
from rlbuffers.stream.padding import IGNORE_INDEX, block_causal_mask, collate, padded_length
from rlbuffers.stream.shards import (
    iter_input_samples,
    iter_shard,
    open_shard,
    read_manifest,
    resolve_shards,
    write_shards,
)
from rlbuffers.stream.sources import IndexSource, ShardSource, split_shards
from rlbuffers.stream.stages import BlockShuffle, MapStage, Stage, WindowStage
from rlbuffers.stream.token_store import (
    TokenStore,
    TokenStoreWriter,
    build_token_store,
    dtype_for_vocab,
)
from rlbuffers.stream.tokenize import TextTokenizer, Tokenize, content_key, text_of

__all__ = [
    "IGNORE_INDEX", "BlockShuffle", "IndexSource", "MapStage", "Pack", "Packing", "PadBatch",
    "Padding", "Row",
    "RowBatch", "ShardError", "ShardSource", "Stage", "StreamConfig", "StreamLoader",
    "StreamStateError", "TextTokenizer", "TokenStore", "TokenStoreError", "TokenStoreWriter",
    "Tokenize", "WindowStage", "block_causal_mask", "budget_batches", "build_pipeline",
    "build_token_store", "collate", "content_key", "dtype_for_vocab", "iter_input_samples",
    "iter_shard", "open_shard", "pack_bfd", "padded_length", "read_manifest",
    "resolve_shards", "split_overflow", "split_shards", "text_of", "write_shards",
]
