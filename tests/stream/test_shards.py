import json
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from rlbuffers.stream import (
    ShardError,
    ShardSource,
    iter_shard,
    read_manifest,
    resolve_shards,
    split_shards,
    text_of,
    write_shards,
)


def read_all(urls: list[str]) -> list[dict]:
    return [s for u in urls for s in iter_shard(u)]


def test_round_trip_from_jsonl_and_text_files(tmp_path: Path):
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    txt = tmp_path / "b.txt"
    txt.write_text("a whole document\nwith lines")
    out = tmp_path / "out"
    paths = write_shards([str(jl), txt], out, progress=False)
    samples = read_all([str(p) for p in paths])
    assert [s["__key__"] for s in samples] == ["000000000000", "000000000001", "000000000002"]
    assert [json.loads(s["json"]) for s in samples[:2]] == [{"text": "one"}, {"text": "two"}]
    assert samples[2]["txt"] == b"a whole document\nwith lines"
    assert read_manifest(out)["samples"] == 3


def test_shards_respect_max_shard_bytes(tmp_path: Path):
    items = [{"text": "x" * (i * 37 % 3000)} for i in range(200)]
    limit = 40_000
    paths = write_shards(items, tmp_path, max_shard_bytes=limit, progress=False)
    assert len(paths) > 5
    assert all(p.stat().st_size <= limit for p in paths)
    samples = read_all([str(p) for p in paths])
    assert [json.loads(s["json"]) for s in samples] == items
    manifest = read_manifest(tmp_path)
    assert [s["samples"] for s in manifest["shards"]] == [
        sum(1 for _ in iter_shard(str(p))) for p in paths]


def test_oversized_sample_gets_its_own_shard(tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING):
        paths = write_shards(["small", "y" * 50_000, "small again"], tmp_path,
                             max_shard_bytes=20_480, progress=False)
    assert len(paths) == 3 and "larger than max_shard_bytes" in caplog.text
    assert [len(read_all([str(p)])) for p in paths] == [1, 1, 1]


def test_max_shard_samples_and_bad_arguments(tmp_path: Path):
    paths = write_shards([str(i) for i in range(10)], tmp_path, max_shard_samples=3,
                         progress=False)
    assert [len(read_all([str(p)])) for p in paths] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_shards(["a"], tmp_path / "x", max_shard_bytes=100)
    with pytest.raises(ValueError, match="max_shard_samples"):
        write_shards(["a"], tmp_path / "y", max_shard_samples=0)


def test_grouped_records_read_back_as_one_sample_each(tmp_path: Path):
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": f"doc {i}", "i": i}) + "\n" for i in range(11)))
    items = [str(jl), tmp_path / "b.txt"]
    (tmp_path / "b.txt").write_text("a text file\nwith a newline")
    plain = read_all([str(p) for p in write_shards(items, tmp_path / "plain", progress=False)])
    paths = write_shards(items, tmp_path / "g", records_per_sample=4, progress=False)
    grouped = read_all([str(p) for p in paths])
    # same records, same keys; texts come back as JSON strings (text_of reads both)
    assert [s["__key__"] for s in grouped] == [s["__key__"] for s in plain]
    assert [json.loads(s["json"]) for s in grouped[:11]] == [
        json.loads(s["json"]) for s in plain[:11]]
    assert json.loads(grouped[11]["json"]) == plain[11]["txt"].decode()
    assert text_of(grouped[11], "text") == "a text file\nwith a newline"
    # 12 records in 3 tar members of 4 records each
    with tarfile.open(paths[0]) as tar:
        assert [m.name for m in tar.getmembers()] == [
            "000000000000.jsonl", "000000000004.jsonl", "000000000008.jsonl"]
    assert read_manifest(tmp_path / "g")["samples"] == 12
    # skipping counts records, also into the middle of a member
    for k in (0, 3, 4, 5, 11, 12):
        assert [s["__key__"] for s in iter_shard(str(paths[0]), skip_samples=k)] == [
            s["__key__"] for s in plain[k:]]


def test_grouped_records_respect_shard_limits(tmp_path: Path):
    items = [{"text": "x" * (i * 37 % 3000)} for i in range(200)]
    limit = 40_000
    paths = write_shards(items, tmp_path / "a", max_shard_bytes=limit, records_per_sample=5,
                         progress=False)
    assert len(paths) > 5 and all(p.stat().st_size <= limit for p in paths)
    assert [json.loads(s["json"]) for s in read_all([str(p) for p in paths])] == items
    manifest = read_manifest(tmp_path / "a")
    assert [s["samples"] for s in manifest["shards"]] == [
        sum(1 for _ in iter_shard(str(p))) for p in paths]
    paths = write_shards(items[:10], tmp_path / "b", max_shard_samples=3, records_per_sample=5,
                         progress=False)
    assert [len(read_all([str(p)])) for p in paths] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="records_per_sample"):
        write_shards(["a"], tmp_path / "c", records_per_sample=0)


def test_malformed_inputs_are_named(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n{oops\n')
    with pytest.raises(ShardError, match=r"bad.jsonl:2"):
        write_shards([str(bad)], tmp_path / "o1", progress=False)
    other = tmp_path / "data.csv"
    other.write_text("a,b")
    with pytest.raises(ShardError, match="suffix '.csv'"):
        write_shards([other], tmp_path / "o2", progress=False)
    with pytest.raises(ShardError, match="expected str, bytes or dict, got int"):
        write_shards([3], tmp_path / "o3", progress=False)


def test_resolve_directory_glob_brace_and_urls(shard_dir: Path):
    urls = resolve_shards(shard_dir)
    assert urls == sorted(str(p) for p in shard_dir.glob("*.tar")) and len(urls) > 4
    assert resolve_shards(str(shard_dir / "shard-00000[0-1].tar")) == urls[:2]
    assert resolve_shards(str(shard_dir / "shard-{000000..000002}.tar")) == urls[:3]
    assert resolve_shards("s3://bucket/s-{0..2}.tar") == [
        "s3://bucket/s-0.tar", "s3://bucket/s-1.tar", "s3://bucket/s-2.tar"]
    with pytest.raises(ShardError, match="nothing-here"):
        resolve_shards(str(shard_dir / "nothing-here-*.tar"))


def test_read_through_pipe_and_fsspec_urls(shard_dir: Path):
    local = resolve_shards(shard_dir)[0]
    expected = [s["json"] for s in iter_shard(local)]
    assert [s["json"] for s in iter_shard(f"pipe:cat {local}")] == expected
    assert [s["json"] for s in iter_shard(f"file://{local}")] == expected
    assert [s["json"] for s in iter_shard(local, skip_samples=2)] == expected[2:]


def test_unreadable_shard_raises_or_is_skipped(tmp_path: Path, shard_dir: Path, caplog):
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"this is not a tar file" * 100)
    with pytest.raises(ShardError, match="broken.tar"):
        list(iter_shard(str(broken)))
    with pytest.raises(ShardError, match="missing.tar"):
        list(iter_shard(str(tmp_path / "missing.tar")))
    good = resolve_shards(shard_dir)[0]
    source = ShardSource([str(broken), good], shuffle_shards=False, on_error="warn")
    with caplog.at_level(logging.WARNING):
        got = list(source)
    assert len(got) == len(list(iter_shard(good))) and "broken.tar" in caplog.text


def test_split_shards_policies(caplog):
    urls = [f"s{i}" for i in range(5)]
    assert [split_shards(urls, s, 2, uneven="drop") for s in range(2)] == [
        ["s0", "s2"], ["s1", "s3"]]
    assert [split_shards(urls, s, 2, uneven="wrap") for s in range(2)] == [
        ["s0", "s2", "s4"], ["s1", "s3", "s0"]]
    with pytest.raises(ShardError, match="cannot feed 8 slots"):
        split_shards(urls, 0, 8, uneven="drop")
    with pytest.raises(ValueError, match="slot"):
        split_shards(urls, 2, 2)
    with caplog.at_level(logging.WARNING):
        ShardSource(urls, slot=0, num_slots=2, uneven="drop")
    assert "policy uneven='drop' drops 1 shard" in caplog.text


def test_shard_source_resumes_mid_shard(shard_dir: Path):
    urls = resolve_shards(shard_dir)
    full = [s["__key__"] for s in ShardSource(urls, seed=3)]
    assert sorted(full) == sorted(s["__key__"] for s in read_all(urls))
    for k in (0, 1, 7, len(full) - 1):
        src = ShardSource(urls, seed=3)
        it = iter(src)
        head = [next(it)["__key__"] for _ in range(k)]
        state = json.loads(json.dumps(src.state_dict()))
        again = ShardSource(urls, seed=3)
        again.load_state_dict(state)
        assert head + [s["__key__"] for s in again] == full


def test_shard_files_are_plain_tar(shard_dir: Path):
    first = resolve_shards(shard_dir)[0]
    with tarfile.open(first) as tf:
        names = tf.getnames()
    assert names[0] == "000000000000.json" and all(n.endswith(".json") for n in names)
    assert os.path.getsize(first) % 10240 == 0


def test_truncated_corrupt_or_empty_shard_raises(tmp_path: Path, shard_dir: Path):
    # tarfile reads a damaged stream as a shorter archive; shards.json tells the truth
    first = Path(resolve_shards(shard_dir)[0])
    good = first.read_bytes()
    second = 512 + -(-len(next(iter_shard(str(first)))["json"]) // 512) * 512
    corrupt = bytearray(good)
    corrupt[second + 10] ^= 0xFF  # a name byte of the second header: its checksum fails
    for damaged in (good[:2000], bytes(corrupt), b""):
        copy = tmp_path / f"copy{len(damaged)}"
        shutil.copytree(shard_dir, copy)
        (copy / first.name).write_bytes(damaged)
        with pytest.raises(ShardError, match=first.name):
            list(iter_shard(str(copy / first.name)))
    assert len(list(iter_shard(str(first)))) == read_manifest(shard_dir)["shards"][0]["samples"]
