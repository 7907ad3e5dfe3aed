"""Episode boundaries through the public API: ``ReplayBuffer.episode_ids`` (shapes, dtypes,
errors; ``end_episode()`` and end flags alike; writers and readers; wrapped rings),
``ReplayBuffer.open(cache_bytes=...)``, and ``EpisodeReader`` splitting on them: episodes
ended with ``end_episode()`` and no flag are seen, a wrapped ring's oldest episode is kept
exactly when the reader can prove it whole, and random layouts (hypothesis) read back as
written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbuffers import BufferClosedError, FieldSpec, ReplayBuffer
from rlbuffers.maintenance.episodes import EpisodeReader, scan_cache_bytes

FIELDS = {"obs": FieldSpec((2,), "float32"), "next_obs": FieldSpec((2,), "float32"),
          "action": FieldSpec((), "int64"), "reward": FieldSpec((), "float32"),
          "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool")}
#: how an episode ends: a flag, ``end_episode()`` (no flag), or not yet (the newest only)
ENDS = ("terminated", "truncated", "end_episode")


def rows(first: int, n: int, end: str | None = None) -> dict[str, np.ndarray]:
    """``n`` transitions whose fields encode their transition ids ``first..first + n - 1``;
    the last one's ``end`` flag set when ``end`` names one."""
    t = np.arange(first, first + n)
    out = {"obs": np.stack([t, -t], 1).astype(np.float32),
           "next_obs": np.stack([t + 1, -t - 1], 1).astype(np.float32), "action": t,
           "reward": (t * 0.5).astype(np.float32), "terminated": np.zeros(n, bool),
           "truncated": np.zeros(n, bool)}
    if end in ("terminated", "truncated"):
        out[end][-1] = True
    return out


def fill(buf: ReplayBuffer, episodes: list[tuple[int, str | None]],
         splits: list[int] | None = None) -> None:
    """Append ``episodes`` (length, how it ends) in order; ``splits`` (cycled) says after how
    many rows of an episode to cut its ``extend`` in two (0: one call)."""
    t = 0
    for i, (n, end) in enumerate(episodes):
        cut = (splits[i % len(splits)] % n) if splits else 0
        batch = rows(t, n, end)
        for a, b in ((0, cut), (cut, n)):
            if b > a:
                buf.extend({k: v[a:b] for k, v in batch.items()})
        if end == "end_episode":
            assert buf.end_episode()
        t += n


def expected(episodes: list[tuple[int, str | None]], capacity: int,
             drop_partial_first: bool = True) -> tuple[np.ndarray, int, list[tuple[int, int,
                                                                                   bool]]]:
    """What a reader must see, from the writes alone: the stored rows' episode numbers, the
    rows dropped as the wrapped ring's oldest episode, and the kept episodes as
    ``(first position, length, ended)``."""
    number = np.concatenate([np.full(n, i) for i, (n, _) in enumerate(episodes)])
    ended = [end is not None for _, end in episodes]
    total = len(number)
    first = max(0, total - capacity)  # transition id of the oldest stored row
    stored = number[first:]
    # a wrapped ring's oldest episode is kept only when provably whole: its number equals
    # the oldest row's transition id (every earlier episode was one row long)
    drop = 0
    if drop_partial_first and first > 0 and stored[0] != first:
        drop = int(np.sum(stored == stored[0]))
    out, pos = [], drop
    while pos < len(stored):
        n = int(np.sum(stored == stored[pos]))
        out.append((pos, n, ended[stored[pos]]))
        pos += n
    return stored, drop, out


def read(buf: ReplayBuffer, **kwargs) -> tuple[EpisodeReader, list[tuple[int, int, bool]]]:
    reader = EpisodeReader(buf, **kwargs)
    got = []
    for ep in reader:
        assert np.array_equal(ep.rows["action"], buf[ep.start:ep.start + len(ep)]["action"])
        got.append((ep.start, len(ep), ep.ends))
    return reader, got


def test_episode_ids_shapes_dtypes_and_errors(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=8, fields=FIELDS)
    empty = buf.episode_ids(slice(None))
    assert empty.shape == (0,) and empty.dtype == np.int64
    with pytest.raises(IndexError, match="out of range"):
        buf.episode_ids(0)
    fill(buf, [(3, "terminated"), (2, "end_episode"), (2, None)])
    ids = buf.episode_ids(slice(None))
    assert ids.dtype == np.int64 and ids.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert buf.episodes == 2  # the newest, unfinished episode is number 2
    one = buf.episode_ids(-1)
    assert isinstance(one, np.int64) and one == 2
    assert buf.episode_ids([4, 0, -1]).tolist() == [1, 0, 2]
    assert buf.episode_ids(np.array([3, 2])).tolist() == [1, 0]
    assert buf.episode_ids(slice(1, 6, 2)).tolist() == [0, 1, 2]
    with pytest.raises(IndexError, match="out of range"):
        buf.episode_ids([0, 7])
    with pytest.raises(IndexError, match="1-d"):
        buf.episode_ids(np.zeros((2, 2), np.int64))
    assert buf.end_episode() and buf.episodes == 3
    assert not buf.end_episode()  # ended already: no empty episode
    fill(buf, [(4, "truncated")])  # 11 added, 8 kept: the ids are the buffer's whole life
    assert buf.episode_ids(slice(None)).tolist() == [1, 1, 2, 2, 3, 3, 3, 3]
    assert buf.episodes == 4 and buf.total_added - len(buf) == 3
    buf.save()
    with ReplayBuffer.open(tmp_path / "b", mode="r") as r:  # a reader sees the commit's
        assert r.episode_ids(slice(None)).tolist() == [1, 1, 2, 2, 3, 3, 3, 3]
        assert r.episodes == 4
    buf.close()
    with pytest.raises(BufferClosedError):
        buf.episode_ids(0)


def test_sampled_indices_map_to_episode_ids(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=10, fields=FIELDS, seed=0)
    fill(buf, [(4, "end_episode"), (5, "terminated"), (6, None)])  # 15 added, 10 kept
    batch = buf.sample(32)
    ids = buf.episode_ids(batch["indices"] - (buf.total_added - len(buf)))
    assert ids.shape == (32,)
    # each sampled transition's own action is its transition id: episodes 0..3 of 4, 5, 6
    truth = np.searchsorted([4, 9], batch["action"], side="right")
    assert np.array_equal(ids, truth)
    buf.close()


def test_open_takes_the_readers_cache_size(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=50, fields=FIELDS, chunk_transitions=8)
    fill(buf, [(20, "terminated"), (30, "end_episode")])
    buf.save()
    whole = buf[:]
    with ReplayBuffer.open(tmp_path / "b", mode="r", cache_bytes=0) as r:
        assert r._storage._reader.cache.max_bytes == 0  # the reader got it
        got = r[:]
        assert all(np.array_equal(got[k], whole[k]) for k in FIELDS)
        r.refresh()  # a new commit's reader keeps the size
        assert r._storage._reader.cache.max_bytes == 0
    with ReplayBuffer.open(tmp_path / "b", mode="r", cache_bytes=np.int64(4096)) as r:
        assert r._storage._reader.cache.max_bytes == 4096
    with ReplayBuffer.open(tmp_path / "b", mode="r") as r:
        assert r._storage._reader.cache.max_bytes == 256 * 2**20
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(ValueError, match="cache_bytes: expected an int >= 0"):
            ReplayBuffer.open(tmp_path / "b", mode="r", cache_bytes=bad)
    buf.close()
    with pytest.raises(ValueError, match="cache_bytes: only readers"):
        ReplayBuffer.open(tmp_path / "b", cache_bytes=2**20)
    # one ordered read's need: a block plus two chunks per column, at most the default
    need = scan_cache_bytes(tmp_path / "b", block_bytes=1000)
    assert 1000 < need < 2**20
    assert scan_cache_bytes(tmp_path / "b", block_bytes=2**30) == 256 * 2**20


def test_scan_cache_decodes_every_chunk_once(tmp_path):
    """An ordered read with ``scan_cache_bytes``' cache decodes each stored chunk once (as
    with 256 MiB); a smaller cache decodes the small fields' chunks, which span many blocks,
    again and again (the same rows)."""
    fields = {"img": FieldSpec((32, 32), "uint8"), "reward": FieldSpec((), "float32"),
              "action": FieldSpec((3,), "int64"), "terminated": FieldSpec((), "bool")}
    buf = ReplayBuffer.create(tmp_path / "b", capacity=3000, fields=fields,
                              chunk_transitions=64)
    rng = np.random.default_rng(0)
    for i in range(6):
        ends = np.zeros(500, bool)
        ends[-1] = True
        buf.extend({"img": rng.integers(0, 256, (500, 32, 32), dtype=np.uint8),
                    "reward": rng.normal(size=500).astype(np.float32),
                    "action": rng.integers(0, 9, (500, 3)), "terminated": ends})
        if i % 2:
            buf.end_episode()
    buf.save()
    buf.close()
    block = 100 * 1024  # ~1.5 chunks of img per block
    decodes = {}
    for cache in (256 * 2**20, scan_cache_bytes(tmp_path / "b", block_bytes=block), 40_000):
        with ReplayBuffer.open(tmp_path / "b", mode="r", cache_bytes=cache) as r:
            tier, seen = r._storage._reader.tier, []
            tier.read_chunk = lambda name, c, seen=seen, read=tier.read_chunk: (
                seen.append((name, c)) or read(name, c))
            assert sum(len(p) for p in EpisodeReader(r, block_bytes=block)) == 3000
            decodes[cache] = (len(seen), len(set(seen)))
    (full, need, small) = decodes.values()
    assert full[0] == full[1] and need == full  # each chunk once
    assert small[0] > small[1] == full[1]  # the same chunks, decoded more than once


def test_reader_splits_on_end_episode_with_no_flag(tmp_path):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=100, fields=FIELDS)
    layout = [(5, "end_episode"), (3, "terminated"), (4, "end_episode"), (2, "end_episode")]
    fill(buf, layout)
    _, got = read(buf, block_bytes=7 * 40)  # pieces of 7 rows: boundaries inside blocks
    assert got == [(0, 5, True), (5, 3, True), (8, 4, True), (12, 2, True)]
    fill(buf, [(3, None)])
    _, got = read(buf)
    assert got[-1] == (14, 3, False)  # the newest episode, unfinished


@pytest.mark.parametrize("layout, capacity, dropped, kept", [
    # every episode one row long (bandit / single-turn data): the oldest row's episode
    # number equals its transition id, so it began there: nothing dropped
    ([(1, "terminated")] * 5 + [(1, "end_episode")] * 4 + [(1, None)], 6, 0, 6),
    # the oldest stored episode began exactly at the oldest row (ids 4..7), but after an
    # episode of 4 rows: its number (1) is not its first id (4), so a reader cannot tell:
    # dropped
    ([(4, "end_episode"), (4, "end_episode"), (3, "terminated")], 7, 4, 3),
    # the oldest stored episode lost its start: dropped
    ([(4, "terminated"), (4, "end_episode"), (3, "end_episode")], 5, 2, 3),
    # short episodes first, then one whose number equals its first id: kept whole
    ([(1, "end_episode"), (1, "terminated"), (5, "end_episode"), (2, None)], 7, 0, 7),
])
def test_wrapped_ring_keeps_the_oldest_episode_only_when_provably_whole(
        tmp_path, layout, capacity, dropped, kept):
    buf = ReplayBuffer.create(tmp_path / "b", capacity=capacity, fields=FIELDS)
    fill(buf, layout)
    reader, got = read(buf)
    stored, drop, want = expected(layout, capacity)
    assert buf.episode_ids(slice(None)).tolist() == stored.tolist()
    assert (reader.dropped_rows, reader.rows, drop) == (dropped, kept, dropped)
    assert got == want
    assert reader.first_whole == (dropped == 0)
    reader, got = read(buf, drop_partial_first=False)
    assert reader.dropped_rows == 0 and got == expected(layout, capacity, False)[2]
    buf.close()


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 12))
    eps = [(draw(st.integers(1, 6)), draw(st.sampled_from(ENDS))) for _ in range(n)]
    if draw(st.booleans()):
        eps[-1] = (eps[-1][0], None)  # the newest episode unfinished
    total = sum(k for k, _ in eps)
    capacity = draw(st.integers(1, total + 3))  # wrapped when below the total
    return eps, capacity


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts(), splits=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       block_rows=st.integers(1, 9), drop=st.booleans(), reopen=st.booleans())
def test_random_layouts_read_back_as_written(tmp_path_factory, layout, splits, block_rows,
                                             drop, reopen):
    episodes, capacity = layout
    path = tmp_path_factory.mktemp("h") / "b"
    buf = ReplayBuffer.create(path, capacity=capacity, fields=FIELDS, chunk_transitions=4)
    fill(buf, episodes, splits)
    if reopen:  # a reader of the commit (chunks decoded, a tiny cache)
        buf.save()
        buf.close()
        buf = ReplayBuffer.open(path, mode="r", cache_bytes=64)
    stored, dropped, want = expected(episodes, capacity, drop)
    assert buf.episode_ids(slice(None)).tolist() == stored.tolist()
    assert buf.episodes == sum(end is not None for _, end in episodes)
    per_row = sum(np.dtype(s.dtype).itemsize * int(np.prod(s.shape)) for s in FIELDS.values())
    reader, got = read(buf, block_bytes=block_rows * per_row, drop_partial_first=drop)
    assert got == want and reader.dropped_rows == dropped
    assert reader.rows + dropped == len(buf)
    buf.close()
