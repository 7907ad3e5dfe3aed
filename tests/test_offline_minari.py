"""Minari both ways, checked with minari itself: datasets recorded here with its DataCollector
(Pendulum-v1, a Dict-observation env with a Tuple action space and array infos, HalfCheetah-v5)
convert with every step equal, and export back into datasets whose episodes
``minari.load_dataset`` returns equal; a ring buffer's partial first episode is dropped and an
unfinished last one written truncated; the CLI does the same; bad input is one clear error."""

from __future__ import annotations

import numpy as np
import pytest

from tests.heavy import require

require("minari", "h5py", "jax", "gymnasium", "mujoco")

import gymnasium as gym
import minari

from rlbuffers import FieldSpec, ReplayBuffer
from rlbuffers.cli import main
from rlbuffers.integrations.minari import from_minari, to_minari
from tests.offline_data import DICT_ENV, assert_episodes_equal, assert_tree_equal, record


@pytest.fixture(autouse=True)
def datasets_root(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def assert_steps_equal(ds: minari.MinariDataset, buf: ReplayBuffer) -> int:
    """Every step of ``ds`` equals the buffer's transition at the same position."""
    pos = 0
    for ep in ds.iterate_episodes():
        n = len(ep)
        rows = buf[pos:pos + n]
        obs = {k[len("obs"):]: v for k, v in rows.items() if k == "obs" or k.startswith("obs.")}
        _check_leaves(ep.observations, "", obs, n, rows)
        _check_actions(ep.actions, "action", rows)
        for name, key in (("reward", "rewards"), ("terminated", "terminations"),
                          ("truncated", "truncations")):
            assert np.array_equal(rows[name], getattr(ep, key))
            assert rows[name].dtype == getattr(ep, key).dtype
        assert (rows["episode"] == ep.id).all()
        pos += n
    assert pos == len(buf)
    return pos


def _check_leaves(value, path, obs, n, rows):
    if isinstance(value, dict):
        for k, v in value.items():
            _check_leaves(v, f"{path}.{k}", obs, n, rows)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            _check_leaves(v, f"{path}.{i}", obs, n, rows)
    else:
        assert np.array_equal(obs[path], value[:-1]) and obs[path].dtype == value.dtype
        assert np.array_equal(rows["next_obs" + path], value[1:])


def _check_actions(value, name, rows):
    if isinstance(value, dict):
        for k, v in value.items():
            _check_actions(v, f"{name}.{k}", rows)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            _check_actions(v, f"{name}.{i}", rows)
    else:
        assert np.array_equal(rows[name], value) and rows[name].dtype == value.dtype


@pytest.mark.parametrize("env_id, steps, limit, infos, fmt, back_fmt", [
    ("Pendulum-v1", 230, 50, False, "hdf5", "parquet"),
    # hdf5 back: Minari 0.5.4's Arrow storage writes per-step scalar infos it cannot read
    (DICT_ENV, 200, None, True, "hdf5", "hdf5"),
    ("HalfCheetah-v5", 250, 100, False, "arrow", "arrow"),  # its reset info has other keys
])
def test_round_trip_with_minari(tmp_path, env_id, steps, limit, infos, fmt, back_fmt):
    src = record(f"rec/{env_id.lower()}-v0", env_id, steps, max_episode_steps=limit,
                 record_infos=infos, data_format=fmt)
    buf = from_minari(src.id, tmp_path / "buf", seed=1)
    assert len(buf) == steps == assert_steps_equal(src, buf)
    assert buf.episodes == src.total_episodes
    meta = buf.metadata["minari"]
    assert meta["algorithm_name"] == "random" and meta["author"] == ["rlbuffers tests"]
    assert env_id in meta["env_spec"] and meta["data_format"] == fmt
    assert buf.metadata["converted_from"]["episode_seeds"] is True
    if infos:  # numeric infos kept, as the observations: the reset's and each step's
        assert any(n.startswith("info.") for n in buf.fields)
        assert meta["dropped_infos"] == []
    buf.close()
    buf = ReplayBuffer.open(tmp_path / "buf", mode="r")  # what was committed
    assert_steps_equal(src, buf)
    report = to_minari(buf, f"back/{env_id.lower()}-v0", data_format=back_fmt)
    assert (report.episodes, report.steps, report.dropped_rows, report.unfinished) == \
        (src.total_episodes, steps, 0, 0)
    back = minari.load_dataset(report.dataset_id)
    assert assert_episodes_equal(src, back) == steps
    seeds = lambda d: [m.get("seed") for m in d.storage.get_episode_metadata(d.episode_indices)]  # noqa: E731
    assert seeds(back) == seeds(src)
    assert back.env_spec == src.env_spec
    assert back.observation_space == src.observation_space
    assert back.action_space == src.action_space
    assert back.storage.metadata["author"] == {"rlbuffers tests"}
    buf.close()


def _plain_buffer(path, capacity):
    return ReplayBuffer.create(path, capacity=capacity, fields={
        "obs": FieldSpec((2,), "float32"), "next_obs": FieldSpec((2,), "float32"),
        "action": FieldSpec((), "int64"), "reward": FieldSpec((), "float32"),
        "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool")})


def _episode(rng, n, end="terminated"):
    obs = rng.normal(size=(n + 1, 2)).astype(np.float32)
    flags = np.zeros(n, bool)
    batch = {"obs": obs[:-1], "next_obs": obs[1:], "action": rng.integers(0, 4, n),
             "reward": rng.normal(size=n).astype(np.float32), "terminated": flags.copy(),
             "truncated": flags.copy()}
    if end:
        batch[end][-1] = True
    return batch


def test_wrapped_ring_drops_the_partial_first_episode_and_truncates_the_unfinished_last(
        tmp_path):
    rng = np.random.default_rng(0)
    buf = _plain_buffer(tmp_path / "ring", 100)
    eps = [_episode(rng, 60), _episode(rng, 60, "truncated"), _episode(rng, 30),
           _episode(rng, 10, end=None)]
    for ep in eps:
        buf.extend(ep)
    buf.save()
    # 160 added, 100 kept (ids 60..159): the oldest kept episode (60..119) may have lost its
    # start (here it did not, but a reader cannot tell): dropped; 120..149 ended; 150..159 not
    report = to_minari(tmp_path / "ring", "ring/test-v0")
    back = minari.load_dataset("ring/test-v0")
    assert (report.dropped_rows, report.episodes, report.steps, report.unfinished) == \
        (60, 2, 40, 1)
    e2, e3 = list(back.iterate_episodes())
    assert np.array_equal(e2.observations, np.concatenate([eps[2]["obs"],
                                                           eps[2]["next_obs"][-1:]]))
    assert e2.terminations[-1] and not e2.truncations[-1]
    assert np.array_equal(e3.actions, eps[3]["action"]) and e3.truncations[-1]
    assert not e3.terminations.any()
    assert back.observation_space == gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    report = to_minari(buf, "ring/all-v0", drop_partial_first=False)
    assert (report.dropped_rows, report.episodes) == (0, 3)
    buf.close()


def test_cli_convert_and_export(tmp_path, datasets_root, capsys):
    src = record("cli/pendulum-v0", "Pendulum-v1", 120, max_episode_steps=40)
    assert main(["convert", "minari", "cli/pendulum-v0", str(tmp_path / "b"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "converted 120 transitions (3 episodes)" in out and "episode_seed" in out
    assert main(["export", "minari", str(tmp_path / "b"), "cli/back-v0", "--quiet",
                 "--author", "someone", "--data-format", "arrow"]) == 0
    assert "exported 120 steps (3 episodes)" in capsys.readouterr().out
    back = minari.load_dataset("cli/back-v0")
    assert_episodes_equal(src, back)
    assert back.storage.metadata["author"] == {"someone"}
    # the dataset directory works as well as the id
    assert main(["convert", "minari", str(datasets_root / "cli" / "back-v0"),
                 str(tmp_path / "c"), "--quiet"]) == 0
    # an existing dataset id is refused in one line, then replaced with --overwrite
    assert main(["export", "minari", str(tmp_path / "b"), "cli/back-v0", "--quiet"]) == 2
    assert "cli/back-v0" in capsys.readouterr().err
    assert main(["export", "minari", str(tmp_path / "b"), "cli/back-v0", "--quiet",
                 "--overwrite"]) == 0


def test_bad_input_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded.*no-such-v0"):
        from_minari("no-such-v0", tmp_path / "x")
    assert main(["convert", "minari", "no-such-v0", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-v0" in err
    buf = ReplayBuffer.create(tmp_path / "b", capacity=4, fields={"x": FieldSpec((), "int32")})
    buf.add(x=1)
    with pytest.raises(ValueError, match="missing obs, action, reward, terminated .or done"):
        to_minari(buf, "tests/y-v0")
    with pytest.raises(ValueError, match="dataset_id: expected .*got 'no version'"):
        to_minari(buf, "no version")
    with pytest.raises(ValueError, match="data_format: expected .*got 'csv'"):
        to_minari(buf, "tests/y-v0", data_format="csv")
    buf.close()
    empty = _plain_buffer(tmp_path / "e", 4)
    with pytest.raises(ValueError, match="holds no transitions"):
        to_minari(empty, "tests/y-v0")
    empty.close()


def test_dict_observations_become_dotted_fields(tmp_path):
    src = record("dict/names-v0", DICT_ENV, 40, record_infos=True)
    buf = from_minari(src, tmp_path / "b")
    assert {"obs.pos", "obs.goal", "obs.grid", "obs.mode", "obs.extra.0", "obs.extra.1",
            "next_obs.grid", "action.0", "action.1", "info.cost", "next_info.vec"} \
        <= set(buf.fields)
    assert buf.fields["obs.grid"] == FieldSpec((4, 4), "uint8")
    first = next(iter(src.iterate_episodes()))
    assert_tree_equal(buf[0]["obs.extra.1"], first.observations["extra"][1][0], "extra.1")
    buf.close()
