"""Fixtures: a seeded synthetic corpus, a BPE tokenizer trained on it in-process (no
download), and shards of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from rlbuffers.stream import TextTokenizer, write_shards

WORDS = [f"tok{i}" for i in range(120)] + ["the", "a", "of", "packing", "shard", "batch"]
EOS_ID = 2


def make_texts(n: int, seed: int = 0, max_words: int = 160) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, max_words))))
            for _ in range(n)]


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return make_texts(300)


@pytest.fixture(scope="session")
def tokenizer_json(texts: list[str]) -> str:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[EOS]"],
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


@pytest.fixture
def tokenizer(tokenizer_json: str) -> TextTokenizer:
    return TextTokenizer(tokenizer_json, cache_max_bytes=1 << 20, eos_token_id=EOS_ID)


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    out = tmp_path_factory.mktemp("shards")
    write_shards(out, records=[{"text": t, "i": i} for i, t in enumerate(texts)],
                 max_shard_bytes=30_000, records_per_sample=1, progress=False)
    return out


@pytest.fixture(scope="session")
def grouped_shard_dir(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> Path:
    """The records of ``shard_dir``, 7 per tar member (``records_per_sample=7``)."""
    out = tmp_path_factory.mktemp("grouped_shards")
    write_shards(out, records=[{"text": t, "i": i} for i, t in enumerate(texts)],
                 max_shard_bytes=30_000, records_per_sample=7, progress=False)
    return out
