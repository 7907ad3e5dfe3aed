"""Tampered or careless resume states and manifests (issue 32 U3): every key is checked
(type, range, consistency with the shard list) before the loader changes, and ``shards.json``
on read; errors name the key, the expected and the actual value."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from rlbuffers.cli.shards import main as shards_main
from rlbuffers.errors import RLBuffersError
from rlbuffers.stream import ShardError, ShardManifestError, StreamLoader, StreamStateError

from .test_loader import PACK, fingerprint


def _source(state: dict) -> dict:
    """The innermost stage state of slot 0 (the shard source's cursor)."""
    s = state["slots"][0]
    while "upstream" in s:
        s = s["upstream"]
    return s


@pytest.fixture
def mid_state(shard_dir, tokenizer) -> tuple[dict, list[tuple]]:
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    it = iter(loader)
    head = [fingerprint(next(it)) for _ in range(3)]
    rest = [fingerprint(b) for b in it]
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    it = iter(loader)
    for _ in range(3):
        next(it)
    return json.loads(json.dumps(loader.state_dict())), head + rest


def _tampered(state: dict, edit) -> dict:
    state = copy.deepcopy(state)
    edit(state)
    return state


@pytest.mark.parametrize("edit, key, words", [
    (lambda s: _source(s).update(shard=999), "shards.shard", "expected an int in [0, "),
    (lambda s: _source(s).update(shard=-1), "shards.shard", "got -1"),
    (lambda s: _source(s).update(offset=10**6), "shards.offset", "got 1000000"),
    (lambda s: _source(s).update(offset="abc"), "shards.offset", "got str 'abc'"),
    (lambda s: _source(s).update({"pass": 3}), "shards.pass", "expected an int in [0, 0]"),
    (lambda s: _source(s).pop("shard"), "shards.shard", "missing"),
    (lambda s: s["slots"][0].update(window=True), "row_batch.window", "got bool True"),
    (lambda s: s["slots"][0].update(upstream=[]), "row_batch.upstream", "expected a dict"),
    (lambda s: s.update(slots={}), "slots", "expected a list of 1 items"),
    (lambda s: s.update(slots=[7]), "slots[0]", "expected a dict, got int 7"),
    (lambda s: s.update(epoch=-2), "epoch", "expected an int >= 0, got -2"),
    (lambda s: s.update(last_slot=5), "last_slot", "expected an int in [-1, 0], got 5"),
    (lambda s: s.update(slot_batches=[9]), "slot_batches", "expected a sum of 3"),
    (lambda s: s.update(version="2"), "version", "got str '2'"),
    (lambda s: s.update(config=None), "config", "expected a dict"),
    (lambda s: s["data"].update(shards=1.5), "data.shards", "got float 1.5"),  # fuzz found
    (lambda s: s["data"]["shards"][0].__setitem__(1, 10**6), "data.shards[0]",
     "expected [name, samples, bytes]"),
    (lambda s: s["counters"]["total"].update(shards_cut=-1), "counters.total.shards_cut",
     "got -1"),
    (lambda s: s["counters"].update(epoch={"bogus": 1}), "counters.epoch", "bogus"),
])
def test_u3_tampered_states_are_refused_naming_the_key(mid_state, shard_dir, tokenizer, edit,
                                                       key, words):
    state, expected = mid_state
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    with pytest.raises(StreamStateError, match=re.escape(f"state '{key}'")) as e:
        loader.load_state_dict(_tampered(state, edit))
    assert words in str(e.value)
    assert isinstance(e.value, RLBuffersError) and isinstance(e.value, ValueError)
    # the failed load changed nothing: the loader still starts at the beginning
    assert [fingerprint(b) for b in loader] == expected


def test_u3_emitted_beyond_the_window_is_refused_when_recomputed(mid_state, shard_dir,
                                                                 tokenizer):
    state, _ = mid_state
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    loader.load_state_dict(_tampered(state, lambda s: s["slots"][0].update(emitted=10**6)))
    with pytest.raises(StreamStateError, match="state 'row_batch.emitted': expected < "):
        list(loader)


def test_u3_untampered_state_still_resumes_exactly(mid_state, shard_dir, tokenizer):
    state, expected = mid_state
    loader = StreamLoader.from_shards(shard_dir, tokenizer, PACK)
    loader.load_state_dict(state)
    assert [fingerprint(b) for b in loader] == expected[3:]


def test_u3_bad_manifest_is_refused_on_read(tmp_path: Path, shard_dir, tokenizer, capsys):
    d = tmp_path / "s"
    shutil.copytree(shard_dir, d)
    manifest = json.loads((d / "shards.json").read_text())
    good = copy.deepcopy(manifest)
    manifest["samples"] = "abc"
    (d / "shards.json").write_text(json.dumps(manifest))
    assert shards_main(["shards", "ls", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'samples': expected 300" in err and "'abc'" in err
    with pytest.raises(ShardManifestError, match="'samples'"):
        StreamLoader.from_shards(d, tokenizer, PACK)
    for edit, words in [
        (lambda m: m["shards"][1].update(samples="12"), "'shards[1].samples': expected an int"),
        (lambda m: m["shards"][0].update(name="../../etc/passwd"), "'shards[0].name'"),
        (lambda m: m.update(shards={}), "'shards': expected a list"),
        (lambda m: m["shards"].append(5), "'shards[%d]': expected an object"),
    ]:
        bad = _tampered(good, edit)
        (d / "shards.json").write_text(json.dumps(bad))
        with pytest.raises(ShardError) as e:
            StreamLoader.from_shards(d, tokenizer, PACK)
        assert words.replace("%d", str(len(good["shards"]))) in str(e.value)
    (d / "shards.json").write_text("{not json")
    assert shards_main(["shards", "ls", str(d)]) == 2
    assert "expected JSON" in capsys.readouterr().err
