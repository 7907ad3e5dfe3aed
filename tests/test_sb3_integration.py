"""ZarrReplayBuffer / ZarrDictReplayBuffer against SB3's own buffers: the same transitions and
the same numpy global RNG state give the same sampled batches, every field, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer

from rlbuffers import FieldError
from rlbuffers import ReplayBuffer as RLReplayBuffer
from rlbuffers.integrations.sb3 import ZarrDictReplayBuffer, ZarrReplayBuffer


class Normalizer:
    """Stands in for a VecNormalize: SB3 calls these two methods when sampling."""

    def normalize_obs(self, obs):
        if isinstance(obs, dict):
            return {k: self.normalize_obs(v) for k, v in obs.items()}
        return obs.astype(np.float32) * 0.5 + 1.0

    def normalize_reward(self, reward):
        return reward * 3.0 - 1.0


OBS = {
    "box": spaces.Box(-1.0, 1.0, (3,), np.float32),
    "image": spaces.Box(0, 255, (2, 3, 3), np.uint8),
    "discrete": spaces.Discrete(5),
}
ACTIONS = {
    "discrete": spaces.Discrete(4),
    "box64": spaces.Box(-1.0, 1.0, (2,), np.float64),   # SB3 stores float32
    "multidiscrete": spaces.MultiDiscrete([3, 2]),
}


def random_value(space: spaces.Space, n_envs: int, rng: np.random.Generator):
    if isinstance(space, spaces.Dict):
        return {k: random_value(s, n_envs, rng) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, space.n, size=n_envs)
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(0, space.nvec, size=(n_envs, *space.shape))
    if space.dtype == np.uint8:
        return rng.integers(0, 256, size=(n_envs, *space.shape), dtype=np.uint8)
    return rng.uniform(-1, 1, size=(n_envs, *space.shape)).astype(space.dtype)


def random_step(obs_space, act_space, n_envs, rng):
    """One VecEnv step's arguments to ``add``: dones with some of them timeouts."""
    done = rng.random(n_envs) < 0.25
    timeout = done & (rng.random(n_envs) < 0.5)
    infos = [{"TimeLimit.truncated": bool(t)} if t else {} for t in timeout]
    return (random_value(obs_space, n_envs, rng), random_value(obs_space, n_envs, rng),
            random_value(act_space, n_envs, rng), rng.standard_normal(n_envs).astype(np.float32),
            done, infos)


def assert_same_samples(ours, theirs) -> None:
    assert type(ours).__name__ == type(theirs).__name__
    for name in theirs._fields:
        a, b = getattr(ours, name), getattr(theirs, name)
        if b is None:   # e.g. ``discounts``, set by n-step buffers only
            assert a is None, name
            continue
        if isinstance(b, dict):
            assert a.keys() == b.keys(), name
            pairs = [(a[k], b[k], f"{name}.{k}") for k in b]
        else:
            pairs = [(a, b, name)]
        for x, y, label in pairs:
            assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, label
            assert th.equal(x, y), label


def run_side_by_side(ours, theirs, obs_space, act_space, n_envs, steps, *, seed=0,
                     reset_at=None) -> int:
    """Add the same random steps to both buffers; after each, sample both from the same numpy
    RNG state (with and without a normalizer) and compare. Returns the batches compared."""
    rng = np.random.default_rng(seed)
    compared = 0
    for step in range(steps):
        if step == reset_at:
            ours.reset()
            theirs.reset()
        args = random_step(obs_space, act_space, n_envs, rng)
        ours.add(*args)
        theirs.add(*args)
        assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size())
        for env in (None, Normalizer()):
            np.random.seed(1000 * step + (env is None))
            expected = theirs.sample(7, env=env)
            state = np.random.get_state()
            np.random.seed(1000 * step + (env is None))
            assert_same_samples(ours.sample(7, env=env), expected)
            # both consumed the same draws
            assert np.random.get_state()[2] == state[2]
            compared += 1
    return compared


CONFIGS = [
    # n_envs, handle_timeout_termination, optimize_memory_usage, obs, action
    (1, True, False, "box", "discrete"),
    (2, True, False, "image", "box64"),
    (1, False, False, "discrete", "multidiscrete"),
    (1, False, True, "box", "discrete"),
    (2, False, True, "image", "box64"),
    (2, False, True, "discrete", "multidiscrete"),
]


@pytest.mark.parametrize("write_batch", [1, 3, None])
@pytest.mark.parametrize("n_envs,timeouts,optimize,obs,action", CONFIGS)
def test_samples_equal_sb3(tmp_path, n_envs, timeouts, optimize, obs, action, write_batch):
    """Past capacity (wrap-around three times), with episode ends and timeouts; steps staged
    in RAM (write_batch) or appended one by one."""
    obs_space, act_space = OBS[obs], ACTIONS[action]
    kwargs = dict(device="cpu", n_envs=n_envs, optimize_memory_usage=optimize,
                  handle_timeout_termination=timeouts)
    theirs = ReplayBuffer(12, obs_space, act_space, **kwargs)
    ours = ZarrReplayBuffer(12, obs_space, act_space, **kwargs, path=tmp_path / "buf",
                            write_batch=write_batch)
    assert ours.buffer_size == theirs.buffer_size == 12 // n_envs
    steps = 3 * ours.buffer_size + 2
    assert run_side_by_side(ours, theirs, obs_space, act_space, n_envs, steps) == 2 * steps
    assert len(ours.storage) == ours.buffer_size * n_envs
    ours.close()


@pytest.mark.parametrize("optimize", [False, True])
def test_reset_then_refill_equals_sb3(tmp_path, optimize):
    obs_space, act_space = OBS["box"], ACTIONS["discrete"]
    kwargs = dict(device="cpu", n_envs=2, optimize_memory_usage=optimize,
                  handle_timeout_termination=not optimize)
    theirs = ReplayBuffer(8, obs_space, act_space, **kwargs)
    ours = ZarrReplayBuffer(8, obs_space, act_space, **kwargs, path=tmp_path / "buf")
    run_side_by_side(ours, theirs, obs_space, act_space, 2, 15, reset_at=6)
    ours.close()


@pytest.mark.parametrize("n_envs,timeouts", [(1, True), (2, False), (2, True)])
def test_dict_samples_equal_sb3(tmp_path, n_envs, timeouts):
    obs_space = spaces.Dict({"image": OBS["image"], "vec": OBS["box"], "id": OBS["discrete"]})
    act_space = ACTIONS["box64"]
    kwargs = dict(device="cpu", n_envs=n_envs, handle_timeout_termination=timeouts)
    theirs = DictReplayBuffer(10, obs_space, act_space, **kwargs)
    ours = ZarrDictReplayBuffer(10, obs_space, act_space, **kwargs, path=tmp_path / "buf")
    steps = 3 * ours.buffer_size + 1
    assert run_side_by_side(ours, theirs, obs_space, act_space, n_envs, steps) == 2 * steps
    assert sorted(ours.storage.fields) == sorted(
        [f"{p}.{k}" for p in ("obs", "next_obs") for k in ("image", "vec", "id")]
        + ["action", "reward", "terminated", "truncated"])
    ours.close()


def test_stored_transitions_use_rlbuffers_fields(tmp_path):
    """What lands on disk: one transition per environment, flags split by timeout."""
    obs_space, act_space = OBS["box"], ACTIONS["discrete"]
    buf = ZarrReplayBuffer(8, obs_space, act_space, "cpu", n_envs=2, path=tmp_path / "buf")
    obs = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    buf.add(obs, obs + 10, np.array([1, 3]), np.array([0.5, -1.0]), np.array([True, True]),
            [{"TimeLimit.truncated": True}, {}])
    rows = buf.storage[:]
    np.testing.assert_array_equal(rows["obs"], obs)
    np.testing.assert_array_equal(rows["next_obs"], obs + 10)
    np.testing.assert_array_equal(rows["action"], [[1], [3]])
    np.testing.assert_array_equal(rows["reward"], np.array([0.5, -1.0], np.float32))
    np.testing.assert_array_equal(rows["terminated"], [False, True])
    np.testing.assert_array_equal(rows["truncated"], [True, False])
    assert buf.storage.episodes == 2
    buf.close()


def test_errors_as_sb3_and_clear(tmp_path):
    obs_space, act_space = OBS["box"], ACTIONS["discrete"]
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        ZarrReplayBuffer(8, obs_space, act_space, optimize_memory_usage=True,
                         handle_timeout_termination=True, path=tmp_path / "a")
    dict_space = spaces.Dict({"vec": obs_space})
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        ZarrDictReplayBuffer(8, dict_space, act_space, optimize_memory_usage=True,
                             handle_timeout_termination=False, path=tmp_path / "b")
    with pytest.raises(TypeError, match="observation_space"):
        ZarrReplayBuffer(8, dict_space, act_space, path=tmp_path / "c")
    buf = ZarrReplayBuffer(8, obs_space, act_space, "cpu", path=tmp_path / "d")
    obs = np.zeros((1, 3), np.float32)
    with pytest.raises(FieldError, match="done"):
        buf.add(obs, obs, np.array([1]), np.array([0.0]), np.array([2.0]), [{}])
    assert len(buf.storage) == 0 and buf.pos == 0
    with pytest.raises(ValueError):   # numpy's "high <= 0", as SB3's empty buffer
        buf.sample(4)
    buf.close()


def test_existing_path_left_untouched(tmp_path):
    """What SB3's Model.load builds: a buffer at an existing path is neither created nor
    overwritten; using it says how to continue."""
    obs_space, act_space = OBS["box"], ACTIONS["discrete"]
    buf = ZarrReplayBuffer(8, obs_space, act_space, "cpu", path=tmp_path / "buf")
    obs = np.ones((1, 3), np.float32)
    buf.add(obs, obs, np.array([1]), np.array([2.0]), np.array([False]), [{}])
    buf.commit({"step": 1})
    buf.close()
    again = ZarrReplayBuffer(8, obs_space, act_space, "cpu", path=tmp_path / "buf")
    with pytest.raises(FileExistsError, match="ZarrReplayBuffer.open"):
        again.add(obs, obs, np.array([1]), np.array([2.0]), np.array([False]), [{}])
    with RLReplayBuffer.open(tmp_path / "buf", mode="r") as rb:
        assert len(rb) == 1 and rb.metadata["step"] == 1


@pytest.mark.parametrize("optimize", [False, True])
def test_commit_open_continues_like_uninterrupted(tmp_path, optimize):
    """commit + open restores transitions, pos, full and the pending next observation: the
    reopened buffer and one that never closed, given the same adds, sample the same."""
    obs_space, act_space = OBS["image"], ACTIONS["box64"]
    kwargs = dict(device="cpu", n_envs=2, optimize_memory_usage=optimize,
                  handle_timeout_termination=not optimize)
    theirs = ReplayBuffer(10, obs_space, act_space, **kwargs)
    ours = ZarrReplayBuffer(10, obs_space, act_space, **kwargs, path=tmp_path / "buf")
    rng = np.random.default_rng(3)
    for _ in range(7):
        args = random_step(obs_space, act_space, 2, rng)
        ours.add(*args)
        theirs.add(*args)
    ours.commit({"note": "seven steps"})
    for _ in range(2):   # discarded: added after the commit
        ours.add(*random_step(obs_space, act_space, 2, np.random.default_rng(9)))
    ours.close()
    reopened = ZarrReplayBuffer.open(tmp_path / "buf", obs_space, act_space, device="cpu")
    assert reopened.storage.metadata["note"] == "seven steps"
    assert (reopened.pos, reopened.full) == (theirs.pos, theirs.full)
    assert run_side_by_side(reopened, theirs, obs_space, act_space, 2, 6, seed=5) == 12
    reopened.close()
    with pytest.raises(ValueError, match="do not match"):
        ZarrReplayBuffer.open(tmp_path / "buf", OBS["box"], act_space)


def test_arrays_are_read_only_views(tmp_path):
    """SB3's arrays read the working tier in SB3's layout without copying (issue 44, B4)."""
    buf = ZarrReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu", path=tmp_path / "buf",
                           n_envs=2)
    buf.add(*random_step(OBS["box"], ACTIONS["discrete"], 2, np.random.default_rng(0)))
    obs = buf.observations
    assert obs.shape == (4, 2, 3) and obs.dtype == np.float32 and not obs.flags.writeable
    assert np.shares_memory(obs, buf.observations)   # views of one memory map
    with pytest.raises(ValueError, match="read-only"):
        obs[0] = 1.0
    buf.close()


def assert_same_arrays(ours, theirs, timeouts: bool) -> None:
    """SB3's arrays of ``ours`` equal ``theirs``'s over the steps SB3 samples."""
    upper = theirs.buffer_size if theirs.full else theirs.pos
    names = ["observations", "actions", "rewards", "dones"]
    names += [] if theirs.optimize_memory_usage else ["next_observations"]
    names += ["timeouts"] if timeouts else []
    rows = np.arange(upper)
    if theirs.optimize_memory_usage:  # SB3's row pos holds the newest next obs: ours RAM only
        rows = rows[rows != theirs.pos]
    for name in names:
        np.testing.assert_array_equal(getattr(ours, name)[rows],
                                      getattr(theirs, name)[rows], err_msg=name)
        assert getattr(ours, name).dtype == getattr(theirs, name).dtype, name


@settings(max_examples=40, deadline=None)
@given(buffer_size=st.integers(1, 12), n_envs=st.integers(1, 3),
       mode=st.sampled_from([(True, False), (False, False), (False, True)]),
       steps=st.integers(1, 30), reset_at=st.none() | st.integers(0, 29),
       batch_size=st.integers(1, 9), seed=st.integers(0, 2**16),
       write_batch=st.integers(1, 8))
def test_samples_equal_sb3_property(buffer_size, n_envs, mode, steps, reset_at, batch_size,
                                    seed, write_batch):
    """Any capacity, environment count, length, reset point, batch size and write batch
    (steps staged in RAM): the same batches as SB3, or the same kind of error where SB3
    cannot sample (an empty buffer, or a one-step ring with optimize_memory_usage)."""
    timeouts, optimize = mode
    obs_space, act_space = OBS["image"], ACTIONS["discrete"]
    kwargs = dict(device="cpu", n_envs=n_envs, optimize_memory_usage=optimize,
                  handle_timeout_termination=timeouts)
    theirs = ReplayBuffer(buffer_size, obs_space, act_space, **kwargs)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        ours = ZarrReplayBuffer(buffer_size, obs_space, act_space, **kwargs, path=f"{tmp}/buf",
                                write_batch=write_batch)
        for step in range(steps):
            if step == reset_at:
                ours.reset()
                theirs.reset()
            args = random_step(obs_space, act_space, n_envs, rng)
            ours.add(*args)
            theirs.add(*args)
            np.random.seed(step)
            try:
                expected = theirs.sample(batch_size)
            except ValueError:
                np.random.seed(step)
                with pytest.raises(ValueError):
                    ours.sample(batch_size)
                continue
            np.random.seed(step)
            assert_same_samples(ours.sample(batch_size), expected)
            if reset_at is None or step == steps - 1:
                assert_same_arrays(ours, theirs, timeouts)
        ours.close()


def test_missing_sb3_names_the_extra():
    """Without SB3 the drop-in names raise an ImportError naming the extra; rlbuffers itself
    never imports SB3, and the SB3 pickle conversion (which reads SB3's files as data) works
    without it."""
    code = ("import sys; sys.modules['stable_baselines3'] = None\n"
            "import rlbuffers, rlbuffers.buffer, rlbuffers.integrations.sb3\n"
            "import rlbuffers.integrations.sb3.convert\n"
            "assert 'stable_baselines3' not in [m for m in sys.modules if sys.modules[m]]\n"
            "try:\n    from rlbuffers.integrations.sb3 import ZarrReplayBuffer\n"
            "except ImportError as e:\n    print(e)\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'rlbuffers[sb3]'" in out.stdout
