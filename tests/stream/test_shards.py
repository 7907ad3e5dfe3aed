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
    paths = write_shards(out, files=[str(jl), txt], records_per_sample=1, progress=False)
    samples = read_all([str(p) for p in paths])
    assert [s["__key__"] for s in samples] == ["000000000000", "000000000001", "000000000002"]
    assert [json.loads(s["json"]) for s in samples[:2]] == [{"text": "one"}, {"text": "two"}]
    assert samples[2]["txt"] == b"a whole document\nwith lines"
    assert read_manifest(out)["samples"] == 3


def test_shards_respect_max_shard_bytes(tmp_path: Path):
    items = [{"text": "x" * (i * 37 % 3000)} for i in range(200)]
    limit = 40_000
    paths = write_shards(tmp_path, records=items, max_shard_bytes=limit, progress=False)
    assert len(paths) > 5
    assert all(p.stat().st_size <= limit for p in paths)
    samples = read_all([str(p) for p in paths])
    assert [json.loads(s["json"]) for s in samples] == items
    manifest = read_manifest(tmp_path)
    assert [s["samples"] for s in manifest["shards"]] == [
        sum(1 for _ in iter_shard(str(p))) for p in paths]


def test_oversized_sample_gets_its_own_shard(tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING):
        paths = write_shards(tmp_path, records=["small", "y" * 50_000, "small again"],
                             max_shard_bytes=20_480, progress=False)
    assert len(paths) == 3 and "larger than max_shard_bytes" in caplog.text
    assert [len(read_all([str(p)])) for p in paths] == [1, 1, 1]


def test_max_shard_samples_and_bad_arguments(tmp_path: Path):
    paths = write_shards(tmp_path, records=[str(i) for i in range(10)], max_shard_samples=3,
                         progress=False)
    assert [len(read_all([str(p)])) for p in paths] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_shards(tmp_path / "x", records=["a"], max_shard_bytes=100)
    with pytest.raises(ValueError, match="max_shard_samples"):
        write_shards(tmp_path / "y", records=["a"], max_shard_samples=0)


def test_grouped_records_read_back_as_one_sample_each(tmp_path: Path):
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": f"doc {i}", "i": i}) + "\n" for i in range(11)))
    items = [str(jl), tmp_path / "b.txt"]
    (tmp_path / "b.txt").write_text("a text file\nwith a newline")
    plain = read_all([str(p) for p in write_shards(tmp_path / "plain", files=items,
                                                   records_per_sample=1, progress=False)])
    paths = write_shards(tmp_path / "g", files=items, records_per_sample=4, progress=False)
    grouped = read_all([str(p) for p in paths])
    # same records, same keys; texts come back as JSON strings (text_of reads both)
    assert [s["__key__"] for s in grouped] == [s["__key__"] for s in plain]
    assert [json.loads(s["json"]) for s in grouped[:11]] == [
        json.loads(s["json"]) for s in plain[:11]]
    assert json.loads(grouped[11]["json"]) == plain[11]["txt"].decode()
    assert text_of(grouped[11], "text") == "a text file\nwith a newline"
    # 12 records in 3 tar members of 4 records each, then the end-of-shard marker
    with tarfile.open(paths[0]) as tar:
        assert [m.name for m in tar.getmembers()] == [
            "000000000000.jsonl", "000000000004.jsonl", "000000000008.jsonl",
            "__rlbuffers_end__"]
    assert read_manifest(tmp_path / "g")["samples"] == 12
    # skipping counts records, also into the middle of a member
    for k in (0, 3, 4, 5, 11, 12):
        assert [s["__key__"] for s in iter_shard(str(paths[0]), skip_samples=k)] == [
            s["__key__"] for s in plain[k:]]


def test_grouped_records_respect_shard_limits(tmp_path: Path):
    items = [{"text": "x" * (i * 37 % 3000)} for i in range(200)]
    limit = 40_000
    paths = write_shards(tmp_path / "a", records=items, max_shard_bytes=limit,
                         records_per_sample=5, progress=False)
    assert len(paths) > 5 and all(p.stat().st_size <= limit for p in paths)
    assert [json.loads(s["json"]) for s in read_all([str(p) for p in paths])] == items
    manifest = read_manifest(tmp_path / "a")
    assert [s["samples"] for s in manifest["shards"]] == [
        sum(1 for _ in iter_shard(str(p))) for p in paths]
    paths = write_shards(tmp_path / "b", records=items[:10], max_shard_samples=3,
                         records_per_sample=5, progress=False)
    assert [len(read_all([str(p)])) for p in paths] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="records_per_sample"):
        write_shards(tmp_path / "c", records=["a"], records_per_sample=0)


def test_malformed_inputs_are_named(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n{oops\n')
    with pytest.raises(ShardError, match=r"bad.jsonl:2"):
        write_shards(tmp_path / "o1", files=[str(bad)], progress=False)
    other = tmp_path / "data.csv"
    other.write_text("a,b")
    with pytest.raises(ShardError, match="suffix '.csv'"):
        write_shards(tmp_path / "o2", files=[other], progress=False)
    with pytest.raises(ShardError, match="expected str, bytes or dict, got int"):
        write_shards(tmp_path / "o3", records=[3], progress=False)


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
    assert names[0] == "000000000000.json" and all(n.endswith(".json") for n in names[:-1])
    assert names[-1] == "__rlbuffers_end__"  # webdataset readers skip __*__ members
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


# -- issue 18 --------------------------------------------------------------------------
def test_inputs_are_explicit_paths_or_records(tmp_path: Path):
    real = tmp_path / "a.jsonl"
    real.write_text('{"text": "one"}\n')
    with pytest.raises(ShardError, match=r"missing\.jsonl.*no such path"):
        write_shards(tmp_path / "o1", files=[real, tmp_path / "missing.jsonl"], progress=False)
    assert not (tmp_path / "o1").exists()  # refused before anything is written
    with pytest.raises(ShardError, match="expected paths"):
        write_shards(tmp_path / "o2", files=[{"text": "x"}], progress=False)
    with pytest.raises(ValueError, match="out_dir: expected a directory path, got list"):
        write_shards([str(real)])  # inputs where the directory goes
    # a string among records is a text, whether or not a file of that name exists
    paths = write_shards(tmp_path / "o4", records=[str(real)], records_per_sample=1,
                         progress=False)
    assert [s["txt"] for s in read_all([str(p) for p in paths])] == [str(real).encode()]


def _cut_at_member_boundary(path: Path, keep_samples: int) -> None:
    """Keep the first ``keep_samples`` members (whole headers + payloads), nothing after."""
    with tarfile.open(path) as tar:
        end = tar.getmembers()[keep_samples].offset
    path.write_bytes(path.read_bytes()[:end])


def test_truncation_is_detected_without_manifest_and_through_urls(tmp_path: Path,
                                                                  shard_dir: Path):
    first = Path(resolve_shards(shard_dir)[0])
    copy = tmp_path / "with_manifest"
    shutil.copytree(shard_dir, copy)
    _cut_at_member_boundary(copy / first.name, 3)
    with pytest.raises(ShardError, match=first.name):  # file:// URL, shards.json beside it
        list(iter_shard(f"file://{copy / first.name}"))
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(first, alone / first.name)
    _cut_at_member_boundary(alone / first.name, 3)
    for url in (str(alone / first.name), f"file://{alone / first.name}"):
        with pytest.raises(ShardError, match="end-of-archive"):
            list(iter_shard(url))


def test_end_marker_detects_lost_samples_in_a_rewritten_tar(tmp_path: Path, shard_dir: Path):
    # members dropped from the middle, archive closed properly: only the marker can tell
    first = Path(resolve_shards(shard_dir)[0])
    with tarfile.open(first) as src, tarfile.open(tmp_path / "s.tar", "w") as dst:
        members = src.getmembers()
        for m in members[2:]:
            dst.addfile(m, src.extractfile(m))
    with pytest.raises(ShardError, match=r"end-of-shard marker says \d+ samples"):
        list(iter_shard(str(tmp_path / "s.tar")))


def test_foreign_tar_without_marker_reads_and_plain_webdataset_reads_ours(tmp_path: Path,
                                                                          shard_dir: Path):
    import io

    from webdataset.tariterators import group_by_keys, tar_file_iterator

    with tarfile.open(tmp_path / "f.tar", "w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"k{i}.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    assert [s["__key__"] for s in iter_shard(str(tmp_path / "f.tar"))] == ["k0", "k1", "k2"]
    first = resolve_shards(shard_dir)[0]
    ours = [(s["__key__"], s["json"]) for s in iter_shard(first)]
    with open(first, "rb") as f:
        members = ({**m, "__url__": first} for m in tar_file_iterator(f))
        theirs = [(s["__key__"], s["json"]) for s in group_by_keys(members)]
    assert ours == theirs


def test_brace_pattern_naming_missing_shards_is_an_error(shard_dir: Path):
    n = len(resolve_shards(shard_dir))
    with pytest.raises(ShardError, match=f"shard-{n:06d}.tar"):
        resolve_shards(str(shard_dir / f"shard-{{000000..{n + 1:06d}}}.tar"))


def test_import_does_not_pull_in_torch_or_webdataset():
    import subprocess
    import sys

    code = ("import sys, rlbuffers.stream, rlbuffers.cli.shards; "
            "print(sorted(m for m in ('torch', 'webdataset') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_no_oversize_warning_for_a_sample_that_exactly_fits(tmp_path: Path, caplog):
    from rlbuffers.stream.shards import closed_shard_bytes, tar_sample_bytes

    limit = 20_480
    # the largest payload whose shard (sample + end marker + closing blocks) is exactly 20,480
    size = max(n for n in range(0, limit, 512)
               if closed_shard_bytes(tar_sample_bytes({"txt": b"x" * n})) <= limit)
    with caplog.at_level(logging.WARNING):
        paths = write_shards(tmp_path / "a", records=["x" * size] * 2, max_shard_bytes=limit,
                             progress=False)
    assert [p.stat().st_size for p in paths] == [limit, limit]
    assert "larger than max_shard_bytes" not in caplog.text
    with caplog.at_level(logging.WARNING):
        write_shards(tmp_path / "b", records=["x" * (size + 512)], max_shard_bytes=limit,
                     progress=False)
    assert "larger than max_shard_bytes" in caplog.text


def test_unreachable_url_names_its_cause():
    with pytest.raises(ShardError, match=r"127.0.0.1:9.*cannot open.*(Connect|refused)"):
        list(iter_shard("http://127.0.0.1:9/x.tar"))


def test_auto_grouping_keeps_records_and_keys_and_leaves_long_ones_alone(tmp_path: Path):
    items = [{"text": "x" * (20_000 if i % 50 == 7 else i % 300)} for i in range(400)]
    plain = read_all([str(p) for p in write_shards(tmp_path / "p", records=items,
                                                   records_per_sample=1, progress=False)])
    paths = write_shards(tmp_path / "a", records=items, max_shard_bytes=200_000, progress=False)
    auto = read_all([str(p) for p in paths])
    assert [(s["__key__"], json.loads(s["json"])) for s in auto] == [
        (s["__key__"], json.loads(s["json"])) for s in plain]
    members = []
    for p in paths:
        with tarfile.open(p) as tar:
            members += tar.getnames()
    long_ones = [f"{i:012d}.json" for i in range(400) if i % 50 == 7]
    assert set(long_ones) <= set(members)  # 20 KB records keep a member of their own
    grouped = [m for m in members if m.endswith(".jsonl")]
    assert len(grouped) < 40 and len(members) < 60  # 392 short records in a few members
    assert read_manifest(tmp_path / "a")["records_per_sample"] == "auto"
    with pytest.raises(ValueError, match="records_per_sample: expected 'auto' or an int"):
        write_shards(tmp_path / "b", records=["a"], records_per_sample="some")
