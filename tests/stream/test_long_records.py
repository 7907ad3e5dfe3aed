"""A long record is tokenized in pieces cut where the tokenizer gives the same ids (issue 32
C4: one 5 MB record cost ~70x its size in the tokenizer's working memory); the ids are those
of the whole text, for whitespace, byte-level BPE and SentencePiece-style tokenizers."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rlbuffers.stream import TextTokenizer, tokenize

from .conftest import EOS_ID, make_texts


def _byte_level(texts: list[str]) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=500, special_tokens=["<pad>"],
                                                       show_progress=False))
    return tok.to_str()


def _metaspace_unigram(texts: list[str]) -> str:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=300, show_progress=False,
                                                           special_tokens=["<pad>"],
                                                           unk_token="<pad>"))
    return tok.to_str()


def _long_text(seed: int, n_chars: int) -> str:
    rng = np.random.default_rng(seed)
    seps = [" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", " - ", "\t"]
    words = " ".join(make_texts(400, seed)).split()
    out, size = [], 0
    while size < n_chars:
        w = words[int(rng.integers(len(words)))] + seps[int(rng.integers(len(seps)))]
        out.append(w)
        size += len(w)
    return "".join(out)


@pytest.fixture(params=["whitespace", "byte_level", "metaspace_unigram"])
def any_tokenizer(request, tokenizer_json, texts) -> TextTokenizer:
    json_text = {"whitespace": lambda: tokenizer_json, "byte_level": lambda: _byte_level(texts),
                 "metaspace_unigram": lambda: _metaspace_unigram(texts)}[request.param]()
    return TextTokenizer(json_text, eos_token_id=EOS_ID)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_text_in_pieces_gives_the_ids_of_the_whole(any_tokenizer, monkeypatch, seed):
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 600)
    monkeypatch.setattr(tokenize, "CUT_WINDOW", 200)
    text = _long_text(seed, 12_000)
    calls: list[int] = []
    encode_ids = any_tokenizer._encode_ids

    def spy(texts):
        calls.extend(len(t) for t in texts)
        return encode_ids(texts)

    monkeypatch.setattr(any_tokenizer, "_encode_ids", spy)
    (got,) = any_tokenizer.encode_batch([text])
    assert len(tokenize.find_cuts(text, encode_ids, piece=600, window=200)) >= 8
    assert max(calls) <= 2 * 600 + 2 * 200  # the whole text never goes to the tokenizer
    whole = np.append(encode_ids([text])[0], EOS_ID).astype(np.int32)
    np.testing.assert_array_equal(got, whole)
    short = "tok1 tok2 the shard"  # short texts in the same call are unaffected
    got_short, got_long = any_tokenizer.encode_batch([short, text])
    np.testing.assert_array_equal(got_long, whole)
    np.testing.assert_array_equal(got_short, np.append(encode_ids([short])[0], EOS_ID))


def test_no_pieces_when_the_tokenizer_adds_special_tokens(tokenizer_json, monkeypatch):
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 600)
    tok = TextTokenizer(tokenizer_json, add_special_tokens=True)
    assert not tok._can_split()
    text = _long_text(0, 5000)
    (got,) = tok.encode_batch([text])
    np.testing.assert_array_equal(got, tok._encode_ids([text])[0])


def test_a_text_without_verified_cuts_stays_whole():
    # no spaces at all: no candidate cut, one piece
    assert tokenize.find_cuts("x" * 10_000, lambda ts: [np.zeros(1)] * len(ts), piece=600) == []
    # an encoder that never agrees: candidates are tried, none kept
    calls = []

    def disagree(ts):
        calls.append(len(ts))
        return [np.array([len(t)]) for t in ts]

    assert tokenize.find_cuts("ab " * 3000, disagree, piece=600, tries=3) == []
    assert calls and len(calls) <= 3 * (3 * 3000 // 600)
