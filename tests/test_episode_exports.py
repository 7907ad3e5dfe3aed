"""Episode boundaries through the offline exports and back: episodes ended with
``ReplayBuffer.end_episode()`` and no flag survive ``to_minari`` -> ``from_minari`` and
``to_parquet`` -> ``from_parquet`` (and the ``export`` / ``convert`` commands) exactly, and so
do random mixes of flag ends and ``end_episode()`` ends over random layouts, wrapped rings
included (hypothesis), checked against what was written; and datasets recorded with Minari's
``DataCollector``, converted, go through Parquet and ``datasets.load_dataset`` row for row."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.heavy import require

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
require("minari", "h5py", "jax", "gymnasium", "pyarrow", "datasets")

import datasets
import minari

from rlbuffers import ReplayBuffer
from rlbuffers.cli import main
from rlbuffers.integrations.minari import from_minari, to_minari
from rlbuffers.integrations.parquet import from_parquet, to_parquet
from tests.test_episode_boundaries import FIELDS, expected, fill, layouts

#: episodes that end with ``end_episode()`` only: no end flag anywhere
NO_FLAGS = [(5, "end_episode"), (3, "end_episode"), (1, "end_episode"), (4, "end_episode")]
_ids = itertools.count()


@pytest.fixture(autouse=True, scope="module")
def datasets_root(tmp_path_factory):
    old = os.environ.get("MINARI_DATASETS_PATH")
    root = tmp_path_factory.mktemp("minari")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    yield root
    if old is None:
        del os.environ["MINARI_DATASETS_PATH"]
    else:
        os.environ["MINARI_DATASETS_PATH"] = old


def assert_round_trip(src: ReplayBuffer, back: ReplayBuffer, dropped: int, *,
                      minari_flush: bool = False) -> None:
    """``back`` holds ``src``'s rows from position ``dropped`` on, with the same episodes
    (renumbered from 0) and fields; ``minari_flush``: an unfinished newest episode came back
    truncated (Minari's ``DataCollector`` convention), so ended."""
    ids = src.episode_ids(slice(dropped, None))
    open_last = ids[-1] == src.episodes
    assert len(back) == len(src) - dropped
    assert back.episode_ids(slice(None)).tolist() == (ids - ids[0]).tolist()
    assert back.episodes == src.episodes - ids[0] + (minari_flush and open_last)
    a, b = src[dropped:], back[:]
    for k in FIELDS:
        want = a[k].copy()
        if k == "truncated" and minari_flush and open_last:
            want[-1] = True
        assert np.array_equal(b[k], want) and b[k].dtype == want.dtype, k


def test_end_episode_boundaries_survive_parquet(tmp_path):
    src = ReplayBuffer.create(tmp_path / "b", capacity=100, fields=FIELDS)
    fill(src, NO_FLAGS)
    src.save()
    info = to_parquet(tmp_path / "b", tmp_path / "pq", file_bytes=200)
    assert info["episode_offsets"] == [0, 5, 8, 9, 13] and info["last_episode_ended"] is True
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "pq" / "data"),
                               split="train", cache_dir=str(tmp_path / "hf"))
    assert ds["episode_index"] == [0] * 5 + [1] * 3 + [2] + [3] * 4
    assert ds["frame_index"][:6] == [0, 1, 2, 3, 4, 0]
    back = from_parquet(tmp_path / "pq", tmp_path / "back")
    assert_round_trip(src, back, 0)
    back.close()
    # the commands: the same
    assert main(["export", "parquet", str(tmp_path / "b"), str(tmp_path / "pq2"), "--quiet",
                 "--cache-mb", "1"]) == 0
    assert main(["convert", "parquet", str(tmp_path / "pq2"), str(tmp_path / "c"),
                 "--quiet"]) == 0
    with ReplayBuffer.open(tmp_path / "c", mode="r") as c:
        assert_round_trip(src, c, 0)
    src.close()


def test_end_episode_boundaries_survive_minari(tmp_path):
    src = ReplayBuffer.create(tmp_path / "b", capacity=100, fields=FIELDS)
    fill(src, NO_FLAGS)
    src.save()
    report = to_minari(tmp_path / "b", "ends/noflags-v0", cache_bytes=0)
    assert (report.episodes, report.steps, report.unfinished) == (4, 13, 0)
    ds = minari.load_dataset("ends/noflags-v0")
    eps = list(ds.iterate_episodes())
    assert [len(e) for e in eps] == [5, 3, 1, 4]
    for e, first in zip(eps, (0, 5, 8, 9), strict=True):  # neither flag, as written
        assert not e.terminations.any() and not e.truncations.any()
        t = np.arange(first, first + len(e) + 1)
        assert np.array_equal(e.observations, np.stack([t, -t], 1).astype(np.float32))
    back = from_minari("ends/noflags-v0", tmp_path / "back")
    assert_round_trip(src, back, 0)
    assert back.episode_ids(slice(None)).tolist() == back[:]["episode"].tolist()
    back.close()
    # the commands: export, convert, export again: the same episodes
    assert main(["export", "minari", str(tmp_path / "b"), "ends/cli-v0", "--quiet",
                 "--cache-mb", "0"]) == 0
    assert main(["convert", "minari", "ends/cli-v0", str(tmp_path / "c"), "--quiet"]) == 0
    with ReplayBuffer.open(tmp_path / "c", mode="r") as c:
        assert_round_trip(src, c, 0)
        to_minari(c, "ends/again-v0")
    again = minari.load_dataset("ends/again-v0")
    assert [len(e) for e in again.iterate_episodes()] == [5, 3, 1, 4]
    src.close()


def test_unfinished_last_episode_and_end_episode_at_the_end(tmp_path):
    """An ``end_episode()`` after the newest row ends it (written untruncated, no flag);
    without it the newest episode is unfinished (Minari: truncated; Parquet: left open)."""
    src = ReplayBuffer.create(tmp_path / "b", capacity=100, fields=FIELDS)
    fill(src, [(4, "terminated"), (3, None)])
    report = to_minari(src, "ends/open-v0")
    assert report.unfinished == 1
    info = to_parquet(src, tmp_path / "pq")
    assert info["last_episode_ended"] is False
    back = from_parquet(tmp_path / "pq", tmp_path / "back")
    assert_round_trip(src, back, 0)
    back.close()
    assert src.end_episode()
    report = to_minari(src, "ends/closed-v0")
    assert report.unfinished == 0
    last = list(minari.load_dataset("ends/closed-v0").iterate_episodes())[-1]
    assert not last.truncations.any() and not last.terminations.any()
    info = to_parquet(src, tmp_path / "pq", overwrite=True)
    assert info["last_episode_ended"] is True
    back = from_parquet(tmp_path / "pq", tmp_path / "back", overwrite=True)
    assert_round_trip(src, back, 0)
    back.close()
    src.close()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts(), splits=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       file_rows=st.integers(1, 20), with_minari=st.integers(0, 3))
def test_random_layouts_survive_both_exports(tmp_path_factory, layout, splits, file_rows,
                                             with_minari):
    episodes, capacity = layout
    tmp = tmp_path_factory.mktemp("h")
    src = ReplayBuffer.create(tmp / "b", capacity=capacity, fields=FIELDS,
                              chunk_transitions=4)
    fill(src, episodes, splits)
    src.save()
    _, dropped, kept = expected(episodes, capacity)
    if not kept:  # the only stored episode lost its start: nothing to write
        with pytest.raises(ValueError, match="no rows left"):
            to_parquet(tmp / "b", tmp / "pq")
        with pytest.raises(ValueError, match="no episode left"):
            to_minari(tmp / "b", f"hyp/none{next(_ids)}-v0")
        src.close()
        return
    info = to_parquet(tmp / "b", tmp / "pq", file_bytes=file_rows * 40, cache_bytes=64)
    assert info["source"]["dropped_rows"] == dropped
    assert info["episode_offsets"] == [a - dropped for a, _, _ in kept] + [len(src) - dropped]
    back = from_parquet(tmp / "pq", tmp / "pq_back", batch_bytes=file_rows * 30)
    assert_round_trip(src, back, dropped)
    back.close()
    if with_minari == 0:  # a quarter of the examples also through Minari (slower)
        name = f"hyp/d{next(_ids)}-v0"
        report = to_minari(tmp / "b", name)
        assert (report.dropped_rows, report.episodes) == (dropped, len(kept))
        assert report.unfinished == (not kept[-1][2])
        back = from_minari(name, tmp / "m_back")
        assert_round_trip(src, back, dropped, minari_flush=True)
        back.close()
    src.close()


@pytest.mark.parametrize("env_id, steps, limit, infos", [
    ("Pendulum-v1", 150, 40, False),
    ("RLBuffersTestDict-v0", 120, None, True),
])
def test_recorded_minari_dataset_through_parquet_and_datasets(tmp_path, env_id, steps, limit,
                                                             infos):
    """A dataset recorded with Minari's ``DataCollector``, converted, exported to Parquet:
    ``datasets.load_dataset`` returns every row equal, and ``from_parquet`` the same buffer."""
    from tests.offline_data import record

    src = record(f"pq/{env_id.lower()}-v0", env_id, steps, max_episode_steps=limit,
                 record_infos=infos)
    buf = from_minari(src.id, tmp_path / "buf")
    info = to_parquet(buf, tmp_path / "pq", file_bytes=4000)
    assert info["total_frames"] == steps and info["total_episodes"] == src.total_episodes
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "pq" / "data"),
                               split="train", cache_dir=str(tmp_path / "hf"))
    table, rows = ds[:], buf[:]
    for name, spec in buf.fields.items():  # Python values, in the field's dtype
        got = np.asarray(table[name], dtype=spec.dtype)
        assert np.array_equal(got, rows[name]) and got.shape == rows[name].shape, name
    assert np.array_equal(table["episode_index"], buf.episode_ids(slice(None)))
    back = from_parquet(tmp_path / "pq", tmp_path / "back")
    assert back.fields == buf.fields and back.episodes == buf.episodes == src.total_episodes
    assert back.episode_ids(slice(None)).tolist() == buf.episode_ids(slice(None)).tolist()
    again = back[:]
    for name in buf.fields:
        assert np.array_equal(again[name], rows[name]) and again[name].dtype == rows[name].dtype
    back.close()
    buf.close()
