import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rlbuffers.stream import (
    Packing,
    Padding,
    ShardSource,
    StreamConfig,
    StreamLoader,
    StreamStateError,
    TokenStoreWriter,
    iter_shard,
    resolve_shards,
)

from .test_tokenize import reference

PACK = StreamConfig(max_length=256,
                    batching=Packing(rows_per_batch=3, packing_window_sequences=40),
                    shuffle_buffer_samples=25, tokenize_batch_texts=16, seed=7)
PAD = StreamConfig(max_length=128, batching=Padding(max_tokens=600, bucket_window_sequences=32,
                                                    pad_to_multiple_of=8),
                   shuffle_buffer_samples=25, tokenize_batch_texts=16, overflow="truncate",
                   seed=7)


def fingerprint(batch: dict) -> tuple:
    return tuple(batch[k].tobytes() for k in ("input_ids", "labels", "position_ids",
                                               "cu_seqlens")) + (batch.max_seqlen,)


def sequences_of(batch: dict) -> list[tuple[int, ...]]:
    """The real sequences of a batch: segments cut at position_ids == 0, without the padding
    segments (all [PAD] = 0, an id no text produces)."""
    out = []
    for ids, pos in zip(batch["input_ids"], batch["position_ids"], strict=True):
        starts = np.flatnonzero(pos == 0).tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            if (ids[a:b] != 0).any():
                out.append(tuple(ids[a:b].tolist()))
    return out


def resumed(make, k: int, epochs_before: int = 0) -> list[tuple]:
    """Take k batches (after some full epochs), save, JSON round trip, load into a new
    loader, finish the epoch."""
    loader = make()
    for _ in range(epochs_before):
        list(loader)
    it = iter(loader)
    head = [fingerprint(next(it)) for _ in range(k)]
    state = json.loads(json.dumps(loader.state_dict()))
    again = make()
    again.load_state_dict(state)
    return head + [fingerprint(b) for b in again]


def test_pack_resume_is_exact(shard_dir, tokenizer):
    def make():
        return StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    loader = make()
    epoch0 = [fingerprint(b) for b in loader]
    epoch1 = [fingerprint(b) for b in loader]
    assert len(epoch0) > 10 and epoch0 != epoch1 and loader.epoch == 2
    for k in (0, 1, 2, 9, len(epoch0) - 1, len(epoch0)):
        assert resumed(make, k) == epoch0
    assert resumed(make, 5, epochs_before=1) == epoch1


def test_grouped_shards_give_the_same_batches_and_resume_exactly(shard_dir, grouped_shard_dir,
                                                                 tokenizer):
    def make():
        return StreamLoader.from_shards(grouped_shard_dir, tokenizer, PACK)
    # Fewer shards (grouping drops the per-record tar headers), so another shard order: compare
    # the token multiset with the one-record-per-sample shards, and resume exactly.
    epoch = [fingerprint(b) for b in make()]
    plain = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    seqs = Counter(s for b in make() for s in sequences_of(b))
    assert seqs == Counter(s for b in plain for s in sequences_of(b))
    for k in (0, 3, len(epoch) - 1):
        assert resumed(make, k) == epoch


def test_pack_places_every_token_once_per_epoch(shard_dir, tokenizer, tokenizer_json, texts):
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    for _ in range(2):
        batches = list(loader)
        got = Counter(s for b in batches for s in sequences_of(b))
        assert got == Counter(tuple(r) for r in reference(tokenizer_json, texts))
        for b in batches:
            assert b["input_ids"].shape[1] <= PACK.max_length
            assert b.stats["num_tokens"] == int((b["input_ids"] != 0).sum())


def test_packing_efficiency_beats_padding(shard_dir, tokenizer):
    packed = list(StreamLoader.from_shards(shard_dir, tokenizer, PACK))
    eff = sum(b.stats["num_tokens"] for b in packed) / sum(b["input_ids"].size for b in packed)
    assert eff > 0.9


def test_pad_token_budget_and_resume(shard_dir, tokenizer, tokenizer_json, texts):
    def make():
        return StreamLoader.from_shards(shard_dir, tokenizer, PAD)
    batches = list(make())
    for b in batches:
        B, T = b["input_ids"].shape
        assert T % 8 == 0 and (B * T <= PAD.batching.max_tokens or B == 1)
        assert b["attention_mask"].sum() == b.stats["num_tokens"]
    ref = reference(tokenizer_json, texts)
    assert sum(b.stats["truncated_tokens"] for b in batches) == sum(
        max(0, len(r) - 128) for r in ref)
    full = [fingerprint(b) for b in batches]
    for k in (0, 3, len(full) - 1):
        assert resumed(make, k) == full


def test_fixed_padding_pads_to_max_length(shard_dir, tokenizer):
    cfg = StreamConfig(max_length=128, overflow="truncate",
                       batching=Padding(batch_size=4, fixed_padding=True, sort_by_length=False))
    b = next(iter(StreamLoader.from_shards(shard_dir, tokenizer, cfg)))
    assert b["input_ids"].shape == (4, 128)
    assert b.stats["padding_fraction"] == 1 - b.stats["num_tokens"] / 512


def test_workers_resume_is_exact(shard_dir, tokenizer, tokenizer_json, texts):
    cfg = dataclasses.replace(PACK, uneven_shards="drop")  # 21 shards, 2 workers

    def make():
        return StreamLoader.from_shards(shard_dir, tokenizer, cfg, num_workers=2)
    batches = list(make())
    seen = Counter(s for b in batches for s in sequences_of(b))
    ref = Counter(tuple(r) for r in reference(tokenizer_json, texts))
    assert max(seen.values()) == 1 and set(seen) <= set(ref)
    assert len(seen) >= len(ref) - 20  # one dropped shard of at most 20 samples
    full = [fingerprint(b) for b in batches]
    for k in (3, 8):
        assert resumed(make, k) == full


def test_batches_per_epoch_cycles_and_ranks_match(shard_dir, tokenizer):
    cfg = dataclasses.replace(PACK, batches_per_epoch=50, uneven_shards="drop")
    urls = resolve_shards(shard_dir)
    ranks = [StreamLoader.from_shards(urls, tokenizer, cfg, rank=r, world_size=2)
             for r in range(2)]
    epochs = [[list(loader) for _ in range(2)] for loader in ranks]
    assert all(len(e) == 50 for per_rank in epochs for e in per_rank)  # more than one pass
    sources = [ShardSource(urls, seed=cfg.seed, slot=r, num_slots=2, uneven="drop")
               for r in range(2)]
    for p in range(3):  # every pass: ranks read disjoint shard sets of equal size
        a, b = (set(src.shards_for_pass(p)) for src in sources)
        assert a.isdisjoint(b) and len(a) == len(b) == len(urls) // 2

    def make():
        return StreamLoader.from_shards(urls, tokenizer, cfg, rank=1, world_size=2)
    second_epoch = [fingerprint(b) for b in epochs[1][1]]
    assert resumed(make, 20, epochs_before=1) == second_epoch
    with pytest.raises(ValueError, match="batches_per_epoch"):
        StreamLoader.from_shards(urls, tokenizer, PACK, rank=0, world_size=2)


def test_state_from_another_config_is_rejected(shard_dir, tokenizer):
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    next(iter(loader))
    state = loader.state_dict()
    other = StreamLoader.from_shards(shard_dir, tokenizer, StreamConfig(max_length=512))
    with pytest.raises(StreamStateError, match=r"config.max_length': expected 512.*got 256"):
        other.load_state_dict(state)
    with pytest.raises(StreamStateError, match="kind"):
        other.load_state_dict({"kind": "shards"})


def test_token_store_source_resumes(tmp_path: Path, tokenizer, texts):
    with TokenStoreWriter(tmp_path / "ts", dtype="uint16") as w:
        w.extend(tokenizer.encode_batch(texts))
    from rlbuffers.stream import TokenStore

    store = TokenStore(tmp_path / "ts")

    def make():
        return StreamLoader.from_sequence(store, None, PACK)
    full = [fingerprint(b) for b in make()]
    got = Counter(s for b in make() for s in sequences_of(b))
    assert got == Counter(tuple(store[i].tolist()) for i in range(len(store)))
    assert resumed(make, 7) == full


def test_config_validation():
    with pytest.raises(ValueError, match="max_length"):
        StreamConfig(max_length=0)
    with pytest.raises(ValueError, match="batch_size or max_tokens"):
        StreamConfig(batching=Padding())
    with pytest.raises(ValueError, match="overflow"):
        StreamConfig(overflow="drop")
    with pytest.raises(ValueError, match="read_ahead_tokenize_batches"):
        StreamConfig(read_ahead_tokenize_batches=-1)


SERIAL = {"read_ahead_tokenize_batches": 0, "read_ahead_batch_windows": 0}


@pytest.mark.parametrize("base", [PACK, PAD], ids=["pack", "pad"])
def test_read_ahead_threads_change_nothing_but_speed(shard_dir, tokenizer, base):
    import threading

    serial = dataclasses.replace(base, **SERIAL)
    deep = dataclasses.replace(base, read_ahead_tokenize_batches=1, read_ahead_batch_windows=3)
    assert base.read_ahead_tokenize_batches > 0 and base.read_ahead_batch_windows > 0

    def make(cfg):
        return lambda: StreamLoader.from_shards(shard_dir, tokenizer, cfg)
    ref = [fingerprint(b) for b in make(serial)()]
    assert [fingerprint(b) for b in make(base)()] == ref
    assert [fingerprint(b) for b in make(deep)()] == ref
    for k in (0, 1, 5, len(ref) - 1):
        assert resumed(make(base), k) == ref
    # a state taken with threads loads into a loader without them, and the other way round
    for src, dst in ((base, serial), (serial, deep)):
        loader = make(src)()
        it = iter(loader)
        head = [fingerprint(next(it)) for _ in range(4)]
        state = json.loads(json.dumps(loader.state_dict()))
        again = make(dst)()
        again.load_state_dict(state)
        assert head + [fingerprint(b) for b in again] == ref
    # an abandoned iterator stops and joins its read-ahead threads once it is closed
    before = threading.active_count()
    it = iter(make(base)())
    next(it)
    assert threading.active_count() > before
    it.close()
    assert threading.active_count() == before


def test_read_ahead_thread_forwards_shard_errors(tmp_path: Path, shard_dir, tokenizer):
    import shutil

    from rlbuffers.stream import ShardError

    for i, url in enumerate(resolve_shards(shard_dir)):
        shutil.copy(url, tmp_path / f"s{i}.tar")
    (tmp_path / "s9.tar").write_bytes(b"not a tar" * 300)
    loader = StreamLoader.from_shards(tmp_path, tokenizer, PACK)
    with pytest.raises(ShardError, match="s9.tar"):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_running_out_before_the_quota_raises_in_both_paths(tmp_path: Path, tokenizer,
                                                           num_workers):
    import tarfile

    for i in range(2):  # valid tar files without a sample
        with tarfile.open(tmp_path / f"empty{i}.tar", "w"):
            pass
    cfg = dataclasses.replace(PACK, batches_per_epoch=3)
    loader = StreamLoader.from_shards(tmp_path, tokenizer, cfg, num_workers=num_workers)
    with pytest.raises(StreamStateError, match=r"batches_per_epoch=3.*ran out after 0"):
        list(loader)


def test_mode_options_live_in_their_own_config():
    with pytest.raises(TypeError):
        StreamConfig(rows_per_batch=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Packing(batch_size=3)  # type: ignore[call-arg]
    assert PACK.mode == "pack" and PAD.mode == "pad"
    assert PAD.attention_kind == "padding" and PACK.attention_kind == "none"


# -- issue 18 ----------------------------------------------------------------------------
def test_state_from_another_shard_set_is_refused(tmp_path: Path, shard_dir, tokenizer, texts):
    import shutil

    from rlbuffers.stream import write_shards

    def state_after(k: int, source) -> dict:
        loader = StreamLoader.from_shards(source, tokenizer, PACK)
        it = iter(loader)
        for _ in range(k):
            next(it)
        return json.loads(json.dumps(loader.state_dict()))

    state = state_after(3, shard_dir)
    resharded = tmp_path / "resharded"  # the same records, cut into other shards
    write_shards(resharded, records=[{"text": t, "i": i} for i, t in enumerate(texts)],
                 max_shard_bytes=60_000, progress=False)
    with pytest.raises(StreamStateError, match=r"data.count'.*another data set"):
        StreamLoader.from_shards(resharded, tokenizer, PACK).load_state_dict(state)
    swapped = tmp_path / "swapped"  # same names and count, one shard's content replaced
    shutil.copytree(shard_dir, swapped)
    (swapped / "shards.json").unlink()
    shutil.copy(swapped / "shard-000001.tar", swapped / "shard-000000.tar")
    with pytest.raises(StreamStateError, match=r"data.shards\[0\]'.*shard-000000.tar"):
        StreamLoader.from_shards(swapped, tokenizer, PACK).load_state_dict(state)
    reordered = list(reversed(resolve_shards(shard_dir)))
    with pytest.raises(StreamStateError, match=r"data.shards\[0\]"):
        StreamLoader.from_shards(reordered, tokenizer, PACK).load_state_dict(state)
    moved = tmp_path / "moved"  # the same shard set elsewhere: accepted, resumes exactly
    shutil.copytree(shard_dir, moved)
    full = [fingerprint(b) for b in StreamLoader.from_shards(shard_dir, tokenizer, PACK)]
    again = StreamLoader.from_shards(moved, tokenizer, PACK)
    again.load_state_dict(state)
    assert [fingerprint(b) for b in again] == full[3:]


def test_state_from_a_sequence_of_another_length_is_refused(tokenizer, texts):
    loader = StreamLoader.from_sequence(texts, tokenizer, PACK)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(StreamStateError, match=r"data.items': expected 299.*got 300"):
        StreamLoader.from_sequence(texts[:-1], tokenizer, PACK).load_state_dict(state)


def _bad_shard(path: Path) -> None:
    """A shard with two malformed samples among good ones: bad JSON and non-UTF-8 text."""
    from rlbuffers.stream.tario import TarWriter, end_marker

    tar = TarWriter(str(path))
    tar.add("k0.json", json.dumps({"text": "the shard"}).encode())
    tar.add("k1.json", b"{oops")
    tar.add("k2.txt", b"\xff\xfe not utf-8")
    tar.add("k3.txt", b"a batch of packing")
    tar.add(*end_marker(4))
    tar.close()


def test_malformed_records_are_named_or_skipped_and_counted(tmp_path: Path, shard_dir,
                                                           tokenizer, tokenizer_json, texts,
                                                           caplog):
    import logging
    import shutil

    from rlbuffers.stream import ShardError

    for url in resolve_shards(shard_dir):
        shutil.copy(url, tmp_path)
    _bad_shard(tmp_path / "zz-bad.tar")
    with pytest.raises(ShardError, match=r"sample 'k1' of '.*zz-bad.tar'.*JSONDecodeError"):
        list(StreamLoader.from_shards(tmp_path / "zz-bad.tar", tokenizer, PACK))
    cfg = dataclasses.replace(PACK, on_error="warn")
    with caplog.at_level(logging.INFO, logger="rlbuffers.stream"):
        loader = StreamLoader.from_shards(tmp_path, tokenizer, cfg)
        batches = list(loader)
    got = Counter(s for b in batches for s in sequences_of(b))
    good = texts + ["the shard", "a batch of packing"]
    assert got == Counter(tuple(r) for r in reference(tokenizer_json, good))
    assert sum(b.stats["skipped_malformed"] for b in batches) == 2
    assert loader.counters["total"]["skipped_malformed"] == 2
    assert "'k2' of" in caplog.text and "UnicodeDecodeError" in caplog.text
    assert "skipped 2 malformed samples" in caplog.text


def test_counters_are_in_batches_and_state_and_survive_resume(tmp_path: Path, shard_dir,
                                                              tokenizer, tokenizer_json, texts):
    import shutil

    for url in resolve_shards(shard_dir):
        shutil.copy(url, tmp_path)
    _bad_shard(tmp_path / "zz-bad.tar")
    cfg = dataclasses.replace(PACK, max_length=64, on_error="warn")
    ref = reference(tokenizer_json, texts)
    expected = {"skipped_malformed": 2, "documents_split": sum(len(r) > 64 for r in ref),
                "split_extra_pieces": sum(-(-len(r) // 64) - 1 for r in ref)}
    assert expected["documents_split"] > 10

    def make():
        return StreamLoader.from_shards(tmp_path, tokenizer, cfg)
    loader = make()
    batches = list(loader)
    per_batch = {k: sum(b.stats[k] for b in batches) for k in expected}
    assert per_batch == expected
    totals = loader.counters["total"]
    assert {k: totals[k] for k in expected} == expected
    for k in (1, len(batches) // 2, len(batches) - 1):
        first = make()
        it = iter(first)
        head = [next(it).stats for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        assert state["counters"]["epoch"]["documents_split"] == sum(
            s["documents_split"] for s in head)
        again = make()
        again.load_state_dict(state)
        rest = [b.stats for b in again]
        assert {key: sum(s[key] for s in head + rest) for key in expected} == expected
        assert {key: again.counters["total"][key] for key in expected} == expected


def test_truncated_tokens_go_to_the_batches_that_hold_them(shard_dir, tokenizer,
                                                            tokenizer_json, texts):
    batches = list(StreamLoader.from_shards(shard_dir, tokenizer, PAD))
    ref = reference(tokenizer_json, texts)
    assert sum(b.stats["truncated_tokens"] for b in batches) == sum(
        max(0, len(r) - 128) for r in ref)
    for b in batches:  # a batch reports truncation only if it holds a max-length sequence
        longest = int(b["attention_mask"].sum(axis=1).max())
        assert b.stats["truncated_tokens"] == 0 or longest == 128


def test_ranks_never_deliver_the_next_pass_within_an_epoch(shard_dir, tokenizer,
                                                           tokenizer_json):
    # packing windows (100 sequences) longer than the tail of a rank's pass: before the fix a
    # window spanned the pass boundary and its shuffled rows mixed in the next pass's data
    cfg = dataclasses.replace(PACK, uneven_shards="drop", batches_per_epoch=12,
                              batching=Packing(rows_per_batch=3, packing_window_sequences=100))
    urls = resolve_shards(shard_dir)
    delivered = []
    for rank in range(2):
        loader = StreamLoader.from_shards(urls, tokenizer, cfg, rank=rank, world_size=2)
        seqs = [s for b in loader for s in sequences_of(b)]
        own = ShardSource(urls, seed=cfg.seed, slot=rank, num_slots=2, uneven="drop")
        texts = [json.loads(s["json"])["text"] for u in own.shards_for_pass(0)
                 for s in iter_shard(u)]
        pieces = {tuple(r[i:i + 256]) for r in reference(tokenizer_json, texts)
                  for i in range(0, len(r), 256)}
        assert len(seqs) > 100 and set(seqs) <= pieces  # only this rank's pass-0 data
        delivered.append(Counter(seqs))
    assert not set(delivered[0]) & set(delivered[1])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_length": 1}, r"StreamConfig.max_length: expected an int >= 2, got 1"),
    ({"max_length": 1.5}, r"StreamConfig.max_length: expected an int >= 2, got 1.5 \(float\)"),
    ({"max_length": "512"}, r"StreamConfig.max_length: expected an int >= 2, got '512' \(str\)"),
    ({"max_length": True}, r"StreamConfig.max_length: .*got True \(bool\)"),
    ({"shuffle_buffer_samples": 2.0}, r"StreamConfig.shuffle_buffer_samples: .*2.0 \(float\)"),
    ({"batches_per_epoch": 0}, r"StreamConfig.batches_per_epoch: expected None or an int >= 1"),
    ({"batching": Packing(packing_window_sequences=8)} | {"seed": -1}, r"StreamConfig.seed"),
    ({"batching": "pack"}, r"StreamConfig.batching: expected Packing\(...\) or Padding"),
    ({"on_error": "ignore"}, r"StreamConfig.on_error: expected one of \('raise', 'warn'\)"),
    ({"shuffle_shards": 1}, r"StreamConfig.shuffle_shards: expected a bool, got 1"),
])
def test_config_fields_are_typed_and_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamConfig(**kwargs)


def test_sub_config_fields_are_typed_and_named():
    with pytest.raises(ValueError, match=r"Packing.packing_window_sequences: .*2.5 \(float\)"):
        Packing(packing_window_sequences=2.5)
    with pytest.raises(ValueError, match=r"Padding.max_tokens: expected None or an int >= 1"):
        Padding(max_tokens=0)
    with pytest.raises(ValueError, match=r"Padding.batch_size: .*'8' \(str\)"):
        Padding(batch_size="8")


def test_an_epoch_without_batches_is_a_warning(tmp_path: Path, tokenizer, caplog):
    import logging
    import tarfile

    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    with caplog.at_level(logging.WARNING, logger="rlbuffers.stream"):
        assert list(StreamLoader.from_shards(tmp_path, tokenizer, PACK)) == []
    assert "epoch 0 yielded no batches" in caplog.text


def test_counters_cross_from_workers(tmp_path: Path, shard_dir, tokenizer):
    import shutil

    urls = resolve_shards(shard_dir)
    urls = urls[: len(urls) - (len(urls) + 1) % 2]  # with the bad one, an even number:
    for url in urls:                                 # no shard repeated over the 2 workers
        shutil.copy(url, tmp_path)
    _bad_shard(tmp_path / "zz-bad.tar")
    cfg = dataclasses.replace(PACK, on_error="warn")
    loader = StreamLoader.from_shards(tmp_path, tokenizer, cfg, num_workers=2)
    batches = list(loader)
    assert sum(b.stats["skipped_malformed"] for b in batches) <= 2
    assert loader.counters["total"]["skipped_malformed"] == 2  # trailing ones included
