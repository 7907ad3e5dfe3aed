"""Streaming token pipeline: webdataset shards -> tokenize (cached) -> shuffle -> packing or
dynamic padding -> batches, with an exact, plain-data ``state_dict`` for mid-epoch resume.

See ``docs/stream.md``.

Names are imported on first use (PEP 562): ``rlbuffers shards --help`` needs none of them.
"""

from __future__ import annotations

from rlbuffers.lazy import lazy_attributes

#: name -> module of every public name.
_LAZY = {
    "StreamBatch": "rlbuffers.stream.batch",
    "Pack": "rlbuffers.stream.batching",
    "PadBatch": "rlbuffers.stream.batching",
    "Row": "rlbuffers.stream.batching",
    "RowBatch": "rlbuffers.stream.batching",
    "budget_batches": "rlbuffers.stream.batching",
    "Packing": "rlbuffers.stream.config",
    "Padding": "rlbuffers.stream.config",
    "StreamConfig": "rlbuffers.stream.config",
    "ShardError": "rlbuffers.stream.errors",
    "StreamStateError": "rlbuffers.stream.errors",
    "RecordTooLargeError": "rlbuffers.stream.tario",
    "ShardManifestError": "rlbuffers.stream.state_schema",
    "TarFormatError": "rlbuffers.stream.tario",
    "TokenStoreError": "rlbuffers.stream.errors",
    "StreamLoader": "rlbuffers.stream.loader",
    "build_pipeline": "rlbuffers.stream.loader",
    "pack_bfd": "rlbuffers.stream.packing",
    "split_overflow": "rlbuffers.stream.packing",
    "IGNORE_INDEX": "rlbuffers.stream.padding",
    "pack_shared_prefix": "rlbuffers.stream.prefix_packing",
    "shared_prefix_mask": "rlbuffers.stream.prefix_packing",
    "block_causal_mask": "rlbuffers.stream.padding",
    "collate": "rlbuffers.stream.padding",
    "padded_length": "rlbuffers.stream.padding",
    "iter_input_samples": "rlbuffers.stream.shards",
    "iter_shard": "rlbuffers.stream.shards",
    "open_shard": "rlbuffers.stream.shards",
    "read_manifest": "rlbuffers.stream.shards",
    "resolve_shards": "rlbuffers.stream.shards",
    "write_shards": "rlbuffers.stream.shards",
    "IndexSource": "rlbuffers.stream.sources",
    "ShardSource": "rlbuffers.stream.sources",
    "split_shards": "rlbuffers.stream.sources",
    "BlockShuffle": "rlbuffers.stream.stages",
    "MapStage": "rlbuffers.stream.stages",
    "Stage": "rlbuffers.stream.stages",
    "WindowStage": "rlbuffers.stream.stages",
    "TokenStore": "rlbuffers.stream.token_store",
    "TokenStoreWriter": "rlbuffers.stream.token_store",
    "build_token_store": "rlbuffers.stream.token_store",
    "dtype_for_vocab": "rlbuffers.stream.token_store",
    "TextTokenizer": "rlbuffers.stream.tokenize",
    "Tokenize": "rlbuffers.stream.tokenize",
    "content_key": "rlbuffers.stream.tokenize",
    "text_of": "rlbuffers.stream.tokenize",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "IGNORE_INDEX", "BlockShuffle", "IndexSource", "ShardManifestError", "MapStage", "Pack",
    "Packing", "PadBatch",
    "Padding", "RecordTooLargeError", "Row",
    "RowBatch", "ShardError", "ShardSource", "Stage", "StreamBatch", "StreamConfig", "StreamLoader",
    "StreamStateError", "TarFormatError", "TextTokenizer", "TokenStore", "TokenStoreError",
    "TokenStoreWriter",
    "Tokenize", "WindowStage", "block_causal_mask", "budget_batches", "build_pipeline",
    "build_token_store", "collate", "content_key", "dtype_for_vocab", "iter_input_samples",
    "iter_shard", "open_shard", "pack_bfd", "padded_length", "read_manifest",
    "resolve_shards", "split_overflow", "split_shards", "text_of", "write_shards",
]
