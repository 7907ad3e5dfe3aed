import json
import multiprocessing
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from rlbuffers.stream import ShardError, TextTokenizer, content_key, text_of
from rlbuffers.stream.tokenize import json_texts

from .conftest import EOS_ID


def reference(tokenizer_json: str, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_str(tokenizer_json)
    return [tok.encode(t, add_special_tokens=False).ids + [EOS_ID] for t in texts]


def test_batch_encode_matches_tokenizer_and_counts_cache(tokenizer, tokenizer_json, texts):
    first = tokenizer.encode_batch(texts[:50])
    assert [a.tolist() for a in first] == reference(tokenizer_json, texts[:50])
    assert all(a.dtype == np.int32 for a in first)
    assert tokenizer.cache.stats()["misses"] == 50 and tokenizer.cache.stats()["hits"] == 0
    again = tokenizer.encode_batch(texts[40:60])
    assert [a.tolist() for a in again] == reference(tokenizer_json, texts[40:60])
    assert tokenizer.cache.hits == 10 and tokenizer.cache.misses == 60


def test_cache_byte_budget_evicts(tokenizer_json, texts):
    tt = TextTokenizer(tokenizer_json, cache_max_bytes=4_000)
    tt.encode_batch(texts[:100])
    stats = tt.cache.stats()
    assert stats["current_bytes"] <= 4_000 and stats["evictions"] > 0
    assert stats["entries"] + stats["evictions"] + stats["rejected"] == 100


def test_cache_off_gives_same_ids(tokenizer_json, texts):
    on = TextTokenizer(tokenizer_json, cache_max_bytes=1 << 20)
    off = TextTokenizer(tokenizer_json, cache_max_bytes=0)
    a = [x.tolist() for x in on.encode_batch(texts[:30] * 2)]
    b = [x.tolist() for x in off.encode_batch(texts[:30] * 2)]
    assert a == b and off.cache.stats()["entries"] == 0


def _encode_in_child(tt: TextTokenizer, texts: list[str], queue) -> None:
    queue.put([a.tolist() for a in tt.encode_batch(texts)])


def test_safe_in_forked_process_and_picklable(tokenizer_json, texts):
    tt = TextTokenizer(tokenizer_json)
    expected = [a.tolist() for a in tt.encode_batch(texts[:20])]  # uses Rust threads first
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_encode_in_child, args=(tt, texts[:20], queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and got == expected
    clone = pickle.loads(pickle.dumps(tt))
    assert [a.tolist() for a in clone.encode_batch(texts[:20])] == expected


def test_tokenizer_errors_and_special_tokens(tokenizer_json):
    with pytest.raises(ValueError, match="tokenizer_json"):
        TextTokenizer("{not json")
    tt = TextTokenizer(tokenizer_json)
    assert tt.token_id("[EOS]") == EOS_ID
    assert tt.vocab_size == len(Tokenizer.from_str(tokenizer_json).get_vocab())
    with pytest.raises(KeyError, match="nope"):
        tt.token_id("nope")


def test_text_of_samples():
    assert text_of("plain", "text") == "plain"
    assert text_of({"txt": "é".encode()}, "text") == "é"
    assert text_of({"json": b'{"body": "b"}'}, "body") == "b"
    with pytest.raises(ShardError, match=r"'k1' of 'u.tar'.*'text'.*\['body'\]"):
        text_of({"__key__": "k1", "__url__": "u.tar", "json": b'{"body": "b"}'}, "text")
    with pytest.raises(ShardError, match="'txt' or 'json'"):
        text_of({"__key__": "k", "png": b""}, "text")
    assert content_key("a") != content_key("b") and len(content_key("a")) == 16


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.dictionaries(st.sampled_from(["text", "body"]), st.one_of(st.text(), st.integers()),
                    max_size=2).map(lambda d: json.dumps(d).encode()),
    st.text(max_size=20).map(lambda t: json.dumps(t).encode()),
    st.sampled_from([b"{oops", b"1,2", b"[1", b"2]", b'{"text": "a"},{"text": "b"}', b"",
                     b"\xff"])), min_size=1, max_size=8))
def test_batched_json_decoding_agrees_with_one_by_one(payloads):
    items = [{"json": p, "__key__": str(i), "__url__": "u"} for i, p in enumerate(payloads)]
    batched = json_texts(items, "text")
    one_by_one = []
    for item in items:
        try:
            one_by_one.append(text_of(item, "text"))
        except ShardError:
            one_by_one = None
            break
    if batched is not None:  # when it answers, it answers like the careful path
        assert batched == one_by_one
    if one_by_one is not None:  # and it answers every clean window
        assert batched == one_by_one
