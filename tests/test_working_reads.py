"""Row gathers of the working tier: the pread path (tiers larger than memory) and the
memory-map path return the same rows; the choice follows the memory limit; cgroup limits are
read from v1 and v2 hierarchies."""

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.memory.limits import cgroup_limit_bytes
from rlbuffers.storage import working

FIELDS = {"frame": FieldSpec((2, 48, 48), "uint8"), "value": FieldSpec((), "int64"),
          "tokens": FieldSpec((None,), "int32")}


def _batch(first: int, n: int) -> dict:
    ids = np.arange(first, first + n)
    return {"frame": (ids[:, None, None, None] * np.arange(2 * 48 * 48).reshape(2, 48, 48)
                      % 251).astype(np.uint8),
            "value": ids, "tokens": [np.arange(i % 7, dtype=np.int32) + i for i in ids]}


def _filled(path: Path, n: int = 50, capacity: int = 40) -> ReplayBuffer:
    buf = ReplayBuffer.create(path, capacity=capacity, fields=FIELDS, chunk_transitions=8)
    buf.extend(_batch(0, n))
    return buf


@settings(max_examples=30, deadline=None)
@given(slots=st.lists(st.integers(0, 39), min_size=1, max_size=300))
def test_pread_gather_equals_map_gather(tmp_path_factory, slots):
    buf = _filled(tmp_path_factory.mktemp("b") / "b")
    col = buf._storage.working.columns["frame"]
    idx = np.array(slots, dtype=np.int64)
    by_map = col.gather(idx)
    col.random_reads = True
    assert col.random_reads
    by_pread = col.gather(idx)
    np.testing.assert_array_equal(by_pread, by_map)
    assert by_pread.shape == (len(slots), 2, 48, 48) and by_pread.dtype == np.uint8
    buf.close()


def test_small_rows_keep_the_map(tmp_path):
    buf = _filled(tmp_path / "b")
    col = buf._storage.working.columns["value"]
    col.random_reads = True  # 8-byte rows: a syscall each would cost more than the page
    assert not col.random_reads
    buf.close()


def test_tier_larger_than_memory_switches_to_pread(tmp_path, monkeypatch):
    buf = _filled(tmp_path / "b")
    buf.save()
    expected = buf[:]
    buf.close()
    tier_bytes = 40 * (2 * 48 * 48 + 8 + 8)  # frame, value, internal episode id
    monkeypatch.setattr(working, "memory_limit_bytes", lambda: 4 * tier_bytes)
    with ReplayBuffer.open(tmp_path / "b") as b:
        assert not b._storage.working.columns["frame"].random_reads
    monkeypatch.setattr(working, "memory_limit_bytes", lambda: tier_bytes // 4)
    with ReplayBuffer.open(tmp_path / "b") as b:
        assert b._storage.working.columns["frame"].random_reads
        got = b[:]
        for name in ("frame", "value"):
            np.testing.assert_array_equal(got[name], expected[name])
        sample = b.sample(64, rng=np.random.default_rng(0))
        ids = sample["indices"] - (b.total_added - len(b))
        np.testing.assert_array_equal(sample["frame"], expected["frame"][ids])


def test_cgroup_limits_v1_and_v2(tmp_path):
    proc = tmp_path / "cgroup"
    (tmp_path / "memory" / "job").mkdir(parents=True)
    (tmp_path / "memory" / "job" / "memory.limit_in_bytes").write_text("2147483648\n")
    proc.write_text("4:memory:/job\n1:cpu:/\n")
    assert cgroup_limit_bytes(proc, tmp_path) == 2**31
    (tmp_path / "slice").mkdir()
    (tmp_path / "slice" / "memory.max").write_text("max\n")
    proc.write_text("0::/slice\n")
    assert cgroup_limit_bytes(proc, tmp_path) is None
    (tmp_path / "slice" / "memory.max").write_text("1073741824\n")
    assert cgroup_limit_bytes(proc, tmp_path) == 2**30
    assert cgroup_limit_bytes(tmp_path / "missing", tmp_path) is None
