"""Parquet both ways: ``to_parquet`` files that ``datasets.load_dataset("parquet", ...)``
reads with every row equal (values, shapes, dtypes), split into files by size, with
``meta/info.json`` (fields, episode offsets); ``from_parquet`` back into a buffer equal row for
row and episode for episode (also for random buffers: hypothesis); the CLI; clear errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.heavy import require

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the "parquet" builder is local anyway
os.environ.setdefault("HF_HUB_OFFLINE", "1")
require("pyarrow", "datasets")

import datasets

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.cli import main
from rlbuffers.integrations.parquet import from_parquet, read_info, to_parquet
from rlbuffers.integrations.parquet.columns import arrow_type

FIELDS = {"obs": FieldSpec((3, 4, 4), "uint8"), "next_obs": FieldSpec((3, 4, 4), "uint8"),
          "action": FieldSpec((2,), "float16"), "reward": FieldSpec((), "float64"),
          "seed": FieldSpec((), "uint64"), "flags": FieldSpec((3,), "bool"),
          "tokens": FieldSpec((None,), "int32"), "frame": FieldSpec((64, 64), "uint8"),
          "depth": FieldSpec((8, 8, 16), "float32"), "terminated": FieldSpec((), "bool"),
          "truncated": FieldSpec((), "bool")}


def _rows(rng, n, ends):
    return {"obs": rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8),
            "next_obs": rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8),
            "action": rng.normal(size=(n, 2)).astype(np.float16),
            "reward": rng.normal(size=n), "seed": rng.integers(2**63, 2**64 - 1, n,
                                                              dtype=np.uint64),
            "flags": rng.random((n, 3)) < 0.5,
            "tokens": [rng.integers(0, 1000, k, dtype=np.int32) for k in rng.integers(0, 6, n)],
            "frame": rng.integers(0, 256, (n, 64, 64), dtype=np.uint8),
            "depth": rng.normal(size=(n, 8, 8, 16)).astype(np.float32),
            "terminated": ends, "truncated": np.zeros(n, bool)}


def _buffer(path, n=120, capacity=None, seed=0):
    rng = np.random.default_rng(seed)
    buf = ReplayBuffer.create(path, capacity=capacity or n, fields=FIELDS)
    ends = np.zeros(n, bool)
    ends[[9, 40, 41, 99]] = True
    buf.extend(_rows(rng, n, ends))
    buf.save()
    return buf


def _assert_buffers_equal(a, b):
    assert a.fields == b.fields and len(a) == len(b) and a.episodes == b.episodes
    x, y = a[:], b[:]
    for k, spec in a.fields.items():
        if spec.ragged:
            assert all(np.array_equal(u, v) and u.dtype == v.dtype for u, v in zip(x[k], y[k],
                                                                                 strict=True))
        else:
            assert np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype, k


def test_datasets_reads_every_row_and_from_parquet_gives_the_buffer_back(tmp_path):
    buf = _buffer(tmp_path / "b")
    info = to_parquet(buf, tmp_path / "pq", file_bytes=4000)
    assert len(info["files"]) > 3 and info["total_frames"] == 120
    assert info["episode_offsets"] == [0, 10, 41, 42, 100, 120]
    assert info["total_episodes"] == 5 and info["last_episode_ended"] is False
    assert info["fields"]["obs"] == {"dtype": "uint8", "shape": [3, 4, 4], "encoding": "list"}
    assert json.loads((tmp_path / "pq" / "meta" / "info.json").read_text()) == info
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "pq" / "data"),
                               split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 120
    # datasets' Python values (its numpy formatter would make float64 float32 and uint64
    # int64): compared in the field's dtype, and the stored Arrow type checked
    table = ds[:]
    rows = buf[:]
    for name, spec in FIELDS.items():
        enc = info["fields"][name]["encoding"]
        assert enc == ("binary" if name in ("frame", "depth") else "list")  # rows >= 4 KiB
        assert ds.data.schema.field(name).type == arrow_type(name, spec.shape, spec.dtype, enc)
        if enc == "binary":  # raw bytes, shape and dtype in info.json
            got = np.stack([np.frombuffer(v, spec.dtype).reshape(spec.shape)
                            for v in table[name]])
            assert np.array_equal(got, rows[name]), name
            continue
        if spec.ragged:
            assert all(np.array_equal(np.asarray(u, spec.dtype), v)
                       for u, v in zip(table[name], rows[name], strict=True))
            continue
        got = np.asarray(table[name], dtype=spec.dtype)
        assert np.array_equal(got, rows[name]) and got.shape == rows[name].shape, name
    assert str(ds.features["seed"].dtype) == "uint64"
    table = ds.with_format("numpy")[:]
    assert np.array_equal(table["index"], np.arange(120))
    assert np.array_equal(table["frame_index"][38:44], [28, 29, 30, 0, 0, 1])
    assert np.array_equal(np.bincount(table["episode_index"]), np.diff(info["episode_offsets"]))
    back = from_parquet(tmp_path / "pq", tmp_path / "back")
    _assert_buffers_equal(buf, back)
    assert back.metadata["converted_from"]["format"] == "parquet"
    back.close()
    buf.close()


def test_wrapped_ring_drops_its_partial_first_episode(tmp_path):
    buf = _buffer(tmp_path / "b", n=120, capacity=100)  # ids 20..119 kept
    info = to_parquet(tmp_path / "b", tmp_path / "pq")  # a path: read-only, last commit
    assert info["source"]["dropped_rows"] == 21  # ids 20..40: up to the end at 40
    assert info["total_frames"] == 79 and info["episode_offsets"] == [0, 1, 59, 79]
    back = from_parquet(tmp_path / "pq", tmp_path / "back")
    x, y = buf[21:], back[:]
    assert np.array_equal(x["obs"], y["obs"]) and back.episodes == 2
    back.close()
    buf.close()


def test_cli_export_and_convert(tmp_path, capsys):
    _buffer(tmp_path / "b").close()
    assert main(["export", "parquet", str(tmp_path / "b"), str(tmp_path / "pq"), "--quiet"]) == 0
    assert "exported 120 rows (5 episodes)" in capsys.readouterr().out
    assert main(["export", "parquet", str(tmp_path / "b"), str(tmp_path / "pq")]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert main(["export", "parquet", str(tmp_path / "b"), str(tmp_path / "pq"), "--quiet",
                 "--overwrite", "--file-mb", "1"]) == 0
    assert main(["convert", "parquet", str(tmp_path / "pq"), str(tmp_path / "c"),
                 "--quiet"]) == 0
    assert "converted 120 transitions (4 episodes)" in capsys.readouterr().out
    with ReplayBuffer.open(tmp_path / "b", mode="r") as a, \
            ReplayBuffer.open(tmp_path / "c", mode="r") as c:
        _assert_buffers_equal(a, c)


def test_bad_input_is_one_clear_error(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "c", capacity=4, fields={"z": FieldSpec((),
                                                                                 "complex64")})
    buf.add(z=np.complex64(1j))
    with pytest.raises(ValueError, match="field 'z': complex64 has no Parquet type"):
        to_parquet(buf, tmp_path / "out")
    with pytest.raises(ValueError, match="file_bytes: expected an int >= 1, got 0"):
        to_parquet(buf, tmp_path / "out", file_bytes=0)
    buf.close()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no Parquet export"):
        to_parquet(tmp_path / "c", tmp_path / "other", overwrite=True)
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="expected a Parquet export"):
        read_info(tmp_path / "other")
    (tmp_path / "other" / "meta").mkdir()
    (tmp_path / "other" / "meta" / "info.json").write_text('{"format": "x"}')
    with pytest.raises(ValueError, match="not an rlbuffers Parquet export"):
        from_parquet(tmp_path / "other", tmp_path / "b2")


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
       last_open=st.booleans(), file_bytes=st.sampled_from([300, 5000, 10**8]),
       binary_bytes=st.sampled_from([None, 1, 64, 4096]), seed=st.integers(0, 2**16))
def test_random_buffers_round_trip(tmp_path_factory, lengths, last_open, file_bytes,
                                   binary_bytes, seed):
    tmp = tmp_path_factory.mktemp("h")
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    ends = np.zeros(n, bool)
    ends[np.cumsum(lengths) - 1] = True
    if last_open:
        ends[-1] = False
    buf = ReplayBuffer.create(tmp / "b", capacity=n, fields=FIELDS)
    buf.extend(_rows(rng, n, ends))
    to_parquet(buf, tmp / "pq", file_bytes=file_bytes, binary_bytes=binary_bytes)
    back = from_parquet(tmp / "pq", tmp / "back", batch_bytes=int(rng.integers(100, 4000)))
    _assert_buffers_equal(buf, back)
    back.close()
    buf.close()
