import json
from pathlib import Path

import numpy as np
import pytest

from rlbuffers.stream import (
    TokenStore,
    TokenStoreError,
    TokenStoreWriter,
    build_token_store,
    dtype_for_vocab,
)

from .test_tokenize import reference


def test_writer_round_trip_and_random_access(tmp_path: Path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 60_000, size=int(rng.integers(0, 50))) for _ in range(300)]
    with TokenStoreWriter(tmp_path / "ts", dtype="uint16") as w:
        w.extend(seqs[:100])
        w.extend([])
        w.extend(seqs[100:])
    store = TokenStore(tmp_path / "ts")
    assert len(store) == 300 and store.num_tokens == sum(len(s) for s in seqs)
    for i in (0, 17, 299, -1):
        assert store[i].tolist() == seqs[i].tolist() and store.length(i % 300) == len(seqs[i])
    assert isinstance(store[5], np.memmap) and not store[5].flags.writeable
    with pytest.raises(IndexError, match="300"):
        store[300]
    meta = json.loads((tmp_path / "ts" / "meta.json").read_text())
    assert meta == {"format": "rlbuffers.token_store/1", "dtype": "uint16", "sequences": 300,
                    "tokens": store.num_tokens}


def test_unfinished_or_existing_store_errors(tmp_path: Path):
    w = TokenStoreWriter(tmp_path / "ts", dtype="uint16")
    w.extend([[1, 2, 3]])
    with pytest.raises(TokenStoreError, match="no meta.json"):
        TokenStore(tmp_path / "ts")  # not committed yet: nothing at the final path
    with pytest.raises(ValueError, match=r"\[0, 65535\].*\[1, 70000\]"):
        w.extend([[1, 70_000]])
    w.close()
    with pytest.raises(TokenStoreError, match="already exists"):
        TokenStoreWriter(tmp_path / "ts")
    (tmp_path / "ts" / "offsets.bin").write_bytes(b"\0" * 8)
    with pytest.raises(TokenStoreError, match="offsets.bin expected 16 bytes, got 8"):
        TokenStore(tmp_path / "ts")


def test_build_token_store_streams_texts(tmp_path: Path, tokenizer, tokenizer_json, texts):
    store = build_token_store(tmp_path / "ts", iter(texts), tokenizer, batch_texts=64,
                              progress=False)
    assert store.dtype == np.uint16 == np.dtype(dtype_for_vocab(tokenizer.vocab_size))
    assert [store[i].tolist() for i in range(len(store))] == reference(tokenizer_json, texts)
    assert dtype_for_vocab(70_000) == "uint32"
