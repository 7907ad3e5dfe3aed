"""Hostile and careless tar input to the stream reader (issue 32 C1, C4): a pax header that
never advanced, and records larger than the reader is meant to hold."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from rlbuffers.stream import ShardError, StreamConfig, StreamLoader, iter_shard, write_shards
from rlbuffers.stream.tario import RecordTooLargeError, TarFormatError, iter_members
from tests import hostile_inputs as h

ROOT = Path(__file__).resolve().parents[2]


def test_c1_pax_record_of_length_zero_raises_instead_of_looping(tmp_path):
    # in a child with a timeout: the old parser looped for ever on this 2.5 KiB input
    (tmp_path / "c1.tar").write_bytes(h.c1_pax_zero_length())
    code = ("import sys\nfrom rlbuffers.stream import iter_shard, ShardError\n"
            "try:\n    list(iter_shard(sys.argv[1], find_manifest=False))\n"
            "except ShardError as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c1.tar")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("TarFormatError") and "c1.tar" in r.stdout, r.stdout
    assert "pax header record at byte 0" in r.stdout


@pytest.mark.parametrize("record", [b"0 path=x\n", b"3 \n", b"99 path=x\n", b"x path=y\n",
                                    b"12 pathonly\n", b"10 path=x", b" 9 path=x\n"])
def test_c1_malformed_pax_records_raise_tar_format_error(record):
    data = tarfile.TarInfo("./PaxHeaders/a")
    data.size, data.type = len(record), tarfile.XHDTYPE
    blob = data.tobuf(format=tarfile.USTAR_FORMAT) + record + bytes(-len(record) % 512)
    blob += h._header("a.txt", 1, tarfile.REGTYPE) + b"x" + bytes(511) + bytes(1024)
    with pytest.raises(TarFormatError, match="pax header record"):
        list(iter_members(io.BytesIO(blob)))
    assert issubclass(TarFormatError, ShardError)


def test_pax_long_names_still_read():
    info = tarfile.TarInfo("d/" + "n" * 150 + ".json")
    info.size = 2
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b"{}"))
    assert list(iter_members(io.BytesIO(buf.getvalue()))) == [(info.name, b"{}")]


def test_c4_record_over_max_record_bytes_is_refused_before_it_is_read(tmp_path):
    write_shards(tmp_path, records=[{"text": "a" * 3000}, {"text": "b"}], progress=False,
                 records_per_sample=1)
    url = str(tmp_path / "shard-000000.tar")
    with pytest.raises(RecordTooLargeError) as e:
        list(iter_shard(url, max_record_bytes=2000))
    msg = str(e.value)
    assert "shard-000000.tar" in msg and "'000000000000.json'" in msg
    assert "3,012 bytes, more than max_record_bytes=2,000" in msg
    assert len(list(iter_shard(url, max_record_bytes=3012))) == 2


def test_c4_forged_size_allocates_nothing():
    # a header claiming an 8 GiB member, followed by nothing
    blob = h._header("big.txt", 8 * 2**30, tarfile.REGTYPE)
    tracemalloc.start()
    with pytest.raises(RecordTooLargeError, match="8,589,934,592 bytes"):
        list(iter_members(io.BytesIO(blob)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20
    # other member kinds are skipped piecewise, never read whole
    blob = h._header("dir", 2**40, tarfile.DIRTYPE)
    with pytest.raises(TarFormatError, match="truncated"):
        list(iter_members(io.BytesIO(blob)))


def test_c4_loader_limit_comes_from_the_config(tmp_path, tokenizer):
    write_shards(tmp_path, records=[{"text": "tok1 " * 400}], progress=False,
                 records_per_sample=1)
    cfg = StreamConfig(max_length=64, max_record_bytes=1000)
    with pytest.raises(ShardError, match="more than max_record_bytes=1,000"):
        list(StreamLoader.from_shards(tmp_path, tokenizer, cfg))
    assert cfg.fingerprint() == StreamConfig(max_length=64).fingerprint()
    assert list(StreamLoader.from_shards(tmp_path, tokenizer, StreamConfig(max_length=64)))
    with pytest.raises(ValueError, match="max_record_bytes"):
        StreamConfig(max_record_bytes=0)
