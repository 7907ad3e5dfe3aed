"""ZarrReplayBuffer(frame_stack_axis=...) fed by SB3's own VecFrameStack: the same batches as
SB3's ReplayBuffer, bit for bit, while storing one frame per environment per step."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import gymnasium as gym
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack

from rlbuffers import FieldError
from rlbuffers.integrations.sb3 import ZarrReplayBuffer
from tests.test_sb3_integration import Normalizer, assert_same_samples

K = 4


class Frames(gym.Env):
    """Random single-channel frames; an episode terminates with probability ``p_end`` per
    step (TimeLimit adds truncations)."""

    def __init__(self, side: int, channel_last: bool, p_end: float, seed: int) -> None:
        shape = (side, side, 1) if channel_last else (1, side, side)
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.action_space = spaces.Discrete(3)
        self.p_end, self.rng = p_end, np.random.default_rng(seed)

    def frame(self):
        return self.rng.integers(0, 256, self.observation_space.shape, dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        return self.frame(), {}

    def step(self, action):
        return self.frame(), float(self.rng.normal()), bool(self.rng.random() < self.p_end), \
            False, {}


def frame_stacked_env(n_envs: int, channel_last: bool, *, side=5, p_end=0.15, limit=6):
    def make(i):
        return lambda: gym.wrappers.TimeLimit(Frames(side, channel_last, p_end, i), limit)
    venv = VecFrameStack(DummyVecEnv([make(i) for i in range(n_envs)]), K,
                         channels_order="last" if channel_last else "first")
    venv.seed(0)
    return venv


def steps(venv, count: int):
    """``add``'s arguments for ``count`` steps, as SB3's off-policy ``_store_transition``
    builds them: a done environment's ``next_obs`` is its ``terminal_observation``."""
    obs = venv.reset()
    rng = np.random.default_rng(1)
    for _ in range(count):
        action = rng.integers(0, 3, size=venv.num_envs)
        new_obs, reward, done, infos = venv.step(action)
        next_obs = new_obs.copy()
        for i, d in enumerate(done):
            if d:
                next_obs[i] = infos[i]["terminal_observation"]
        yield obs, next_obs, action, reward, done, infos
        obs = new_obs


def side_by_side(ours, theirs, venv, count: int, seed: int = 0) -> int:
    compared = 0
    for step, args in enumerate(steps(venv, count)):
        ours.add(*args)
        theirs.add(*args)
        assert (ours.pos, ours.full) == (theirs.pos, theirs.full)
        for env in (None, Normalizer()):
            np.random.seed(seed + 1000 * step + (env is None))
            expected = theirs.sample(9, env=env)
            np.random.seed(seed + 1000 * step + (env is None))
            assert_same_samples(ours.sample(9, env=env), expected)
            compared += 1
    return compared


CONFIGS = [
    # n_envs, channel_last, handle_timeout_termination, optimize_memory_usage
    (1, False, True, False),
    (2, False, True, False),
    (2, True, True, False),
    (1, True, False, False),
    (2, False, False, True),
    (1, True, False, True),
]


@pytest.mark.parametrize("write_batch", [1, 3])
@pytest.mark.parametrize("n_envs,channel_last,timeouts,optimize", CONFIGS)
def test_samples_equal_sb3(tmp_path, n_envs, channel_last, timeouts, optimize, write_batch):
    """Episode ends (terminations and TimeLimit truncations, zero-padded restarts), timeouts
    handled or not, wrap-around three times, steps staged or appended one by one."""
    venv = frame_stacked_env(n_envs, channel_last)
    axis = -1 if channel_last else 0
    kwargs = dict(device="cpu", n_envs=n_envs, optimize_memory_usage=optimize,
                  handle_timeout_termination=timeouts)
    theirs = ReplayBuffer(10, venv.observation_space, venv.action_space, **kwargs)
    ours = ZarrReplayBuffer(10, venv.observation_space, venv.action_space, **kwargs,
                            path=tmp_path / "buf", write_batch=write_batch,
                            frame_stack_axis=axis)
    count = 3 * ours.buffer_size + 2
    assert side_by_side(ours, theirs, venv, count) == 2 * count
    rb = ours.storage
    assert len(rb) == ours.buffer_size and rb.episodes > 0
    assert rb.fields["obs"].stack_axis == 1 + (2 if channel_last else 0)
    assert rb.fields["obs"].shape == (n_envs, *venv.observation_space.shape)
    ours.close()


@pytest.mark.parametrize("optimize", [False, True])
def test_commit_open_continues(tmp_path, optimize):
    """commit + open keeps the layout (frame_stack_axis in the commit's state); the reopened
    buffer goes on sampling as SB3's."""
    venv = frame_stacked_env(2, False)
    kwargs = dict(device="cpu", n_envs=2, optimize_memory_usage=optimize,
                  handle_timeout_termination=not optimize)
    theirs = ReplayBuffer(10, venv.observation_space, venv.action_space, **kwargs)
    ours = ZarrReplayBuffer(10, venv.observation_space, venv.action_space, **kwargs,
                            path=tmp_path / "buf", frame_stack_axis=0)
    feed = steps(venv, 20)
    for _ in range(7):
        args = next(feed)
        ours.add(*args)
        theirs.add(*args)
    ours.commit()
    ours.close()
    again = ZarrReplayBuffer.open(tmp_path / "buf", venv.observation_space, venv.action_space,
                                  device="cpu")
    assert again.state_dict()["frame_stack_axis"] == 0
    for step, args in enumerate(feed):
        again.add(*args)
        theirs.add(*args)
        np.random.seed(step)
        expected = theirs.sample(8)
        np.random.seed(step)
        assert_same_samples(again.sample(8), expected)
    again.close()


def column_bytes(rb, names: tuple[str, ...]) -> int:
    """Bytes of the working tier's arrays of columns ``names``: a fixed column's
    ``[capacity, *shape]`` array; a ragged column's stored rows plus its per-slot start and
    length indexes (not the superseded rows its values files keep until compaction)."""
    total = 0
    for name in names:
        col = rb._storage.working.columns[name]
        if hasattr(col, "view"):
            total += col.view.nbytes
        else:
            total += int(col.length.sum()) * col.spec.item_bytes
            total += col.start.nbytes + col.length.nbytes
    return total


def test_stores_about_one_frame_in_k(tmp_path):
    """84x84 Atari-like frames, two environments, episodes of 30 steps, a ring filled and
    wrapped: the frame-stacked working tier's observation arrays (frames, heads, final
    frames) hold about 1/k of the interleaved layout's ``obs`` (and 1/2k of ``obs`` plus
    ``next_obs``), measured."""
    venv = frame_stacked_env(2, False, side=84, p_end=0.0, limit=30)
    space, act = venv.observation_space, venv.action_space
    kwargs = dict(device="cpu", n_envs=2)
    stacked = ZarrReplayBuffer(120, space, act, **kwargs, path=tmp_path / "s", frame_stack_axis=0)
    plain = ZarrReplayBuffer(120, space, act, **kwargs, path=tmp_path / "p")
    for args in steps(venv, 80):
        stacked.add(*args)
        plain.add(*args)
    got = column_bytes(stacked.storage, ("obs", "_head_obs", "_final_obs"))
    obs_only = column_bytes(plain.storage, ("obs",))
    both = column_bytes(plain.storage, ("obs", "next_obs"))
    assert obs_only == 120 * K * 84 * 84 and both == 2 * obs_only
    # the frames: exactly 1/k; the heads of each step after an episode end (n_envs * (k - 1)
    # frames per 30 steps here) and the final frames add ~20%, less with longer episodes
    assert column_bytes(stacked.storage, ("obs",)) == obs_only // K
    assert got < 1.25 * obs_only / K, (got, obs_only)
    stacked.close()
    plain.close()


@pytest.mark.parametrize("write_batch", [1, 3])
def test_restart_without_episode_end_equals_sb3(tmp_path, write_batch):
    """The environments reset mid-episode (a second ``learn(reset_num_timesteps=True)``):
    the stacks do not continue, the previous step (kept staged) is marked an episode end for
    the core buffer, and the batches stay SB3's."""
    venv = frame_stacked_env(2, True)
    space, act = venv.observation_space, venv.action_space
    theirs = ReplayBuffer(24, space, act, "cpu", n_envs=2)
    ours = ZarrReplayBuffer(24, space, act, "cpu", n_envs=2, path=tmp_path / "buf",
                            write_batch=write_batch, frame_stack_axis=-1)
    side_by_side(ours, theirs, venv, 4)
    assert side_by_side(ours, theirs, frame_stacked_env(2, True, p_end=0.0), 9, seed=7) == 18
    rows = ours.storage[:]
    marked = rows["done"] & ~rows["env_terminated"].any(1) & ~rows["env_truncated"].any(1)
    assert marked.tolist() == [False, False, True] + [False] * 9   # the step before the restart
    ours.commit()   # the newest step is appended: a restart now ends its episode in storage
    episodes = ours.storage.episodes
    assert side_by_side(ours, theirs, frame_stacked_env(2, True, p_end=0.0), 3, seed=9) == 6
    assert ours.storage.episodes == episodes + 1
    ours.close()


@pytest.mark.parametrize("optimize", [False, True])
def test_reset_then_refill_equals_sb3(tmp_path, optimize):
    """``reset`` then steps of freshly reset environments (stacks that do not continue)."""
    venv = frame_stacked_env(2, False)
    space, act = venv.observation_space, venv.action_space
    kwargs = dict(device="cpu", n_envs=2, optimize_memory_usage=optimize,
                  handle_timeout_termination=not optimize)
    theirs = ReplayBuffer(12, space, act, **kwargs)
    ours = ZarrReplayBuffer(12, space, act, **kwargs, path=tmp_path / "buf", frame_stack_axis=0)
    side_by_side(ours, theirs, venv, 5)
    ours.reset()
    theirs.reset()
    assert side_by_side(ours, theirs, frame_stacked_env(2, False), 8, seed=3) == 16
    ours.close()


@settings(max_examples=30, deadline=None)
@given(buffer_size=st.integers(1, 12), n_envs=st.integers(1, 3),
       mode=st.sampled_from([(True, False), (False, False), (False, True)]),
       channel_last=st.booleans(), count=st.integers(1, 24),
       reset_at=st.none() | st.integers(0, 23), restart_at=st.none() | st.integers(1, 23),
       commit_at=st.none() | st.integers(0, 23), batch_size=st.integers(1, 9),
       write_batch=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_samples_equal_sb3_property(buffer_size, n_envs, mode, channel_last, count, reset_at,
                                    restart_at, commit_at, batch_size, write_batch, seed):
    """Any capacity, environment count, layout, length, reset, mid-episode restart, commit
    point, batch size and write batch: SB3's batches, or the same kind of error where SB3
    cannot sample."""
    timeouts, optimize = mode
    venv = frame_stacked_env(n_envs, channel_last, p_end=seed % 5 / 10, limit=2 + seed % 6)
    space, act = venv.observation_space, venv.action_space
    kwargs = dict(device="cpu", n_envs=n_envs, optimize_memory_usage=optimize,
                  handle_timeout_termination=timeouts)
    theirs = ReplayBuffer(buffer_size, space, act, **kwargs)
    feed = steps(venv, count)
    with tempfile.TemporaryDirectory() as tmp:
        ours = ZarrReplayBuffer(buffer_size, space, act, **kwargs, path=f"{tmp}/buf",
                                write_batch=write_batch, frame_stack_axis=-1 if channel_last
                                else 0)
        for step in range(count):
            if step == restart_at:
                feed = steps(frame_stacked_env(n_envs, channel_last), count)
            if step == reset_at:
                ours.reset()
                theirs.reset()
            if step == commit_at:
                ours.commit()
            args = next(feed)
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
        ours.close()


def test_bad_stacks_and_arguments(tmp_path):
    """A next_obs that is not obs shifted is refused before anything changes; a restart after
    the previous step was committed ends its episode in the rlbuffers buffer."""
    venv = frame_stacked_env(2, False)
    space, act = venv.observation_space, venv.action_space
    buf = ZarrReplayBuffer(10, space, act, "cpu", n_envs=2, path=tmp_path / "a",
                           frame_stack_axis=0)
    obs, next_obs, action, reward, done, infos = next(steps(venv, 1))
    with pytest.raises(FieldError, match="shifted"):
        buf.add(obs, obs, action, reward, done, infos)
    assert buf.pos == 0 and len(buf.storage) == 0
    buf.add(obs, next_obs, action, reward, np.zeros(2, bool), [{}, {}])
    buf.commit()
    assert buf.storage.episodes == 0
    buf.add(obs, next_obs, action, reward, np.zeros(2, bool), [{}, {}])   # a restart
    assert buf.pos == 2 and buf.storage.episodes == 1
    rows = buf.storage[:]
    np.testing.assert_array_equal(rows["obs"], np.stack([obs, obs]))
    np.testing.assert_array_equal(rows["next_obs"], np.stack([next_obs, next_obs]))
    for axis in (3, -4, 1.0, True):
        with pytest.raises(ValueError, match="frame_stack_axis"):
            ZarrReplayBuffer(10, space, act, path=tmp_path / f"b{axis}", frame_stack_axis=axis)
    with pytest.raises(ValueError, match="frame_stack_axis"):
        ZarrReplayBuffer(10, spaces.Discrete(3), act, path=tmp_path / "c", frame_stack_axis=0)
    buf.close()


def test_dqn_training_equals_sb3_buffer(tmp_path):
    """Whole DQN runs (MlpPolicy on 4 stacked 5x5 frames, 2 envs, the ring wrapped, then a
    second ``learn`` that resets the environments mid-episode): the same parameters and
    samples with ZarrReplayBuffer(frame_stack_axis=0) as with SB3's buffer."""
    import torch as th
    from stable_baselines3 import DQN

    def run(**kwargs):
        model = DQN("MlpPolicy", frame_stacked_env(2, False, p_end=0.1, limit=7),
                    buffer_size=60, learning_starts=16, batch_size=8, train_freq=2,
                    policy_kwargs={"net_arch": [16]}, seed=0, device="cpu", **kwargs)
        model.learn(120)
        model.learn(40)
        return model

    theirs = run()
    ours = run(replay_buffer_class=ZarrReplayBuffer,
               replay_buffer_kwargs={"path": tmp_path / "buf", "frame_stack_axis": 0})
    a, b = ours.policy.state_dict(), theirs.policy.state_dict()
    assert ours._n_updates == theirs._n_updates > 0
    for name in b:
        assert th.equal(a[name], b[name]), name
    rb, ref = ours.replay_buffer, theirs.replay_buffer
    assert (rb.pos, rb.full) == (ref.pos, ref.full) and ref.full
    np.random.seed(7)
    expected = ref.sample(32)
    np.random.seed(7)
    assert_same_samples(rb.sample(32), expected)
    rb.close()
