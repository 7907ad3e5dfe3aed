"""ZarrHerReplayBuffer: HER on disk with SB3's HerReplayBuffer semantics. The same transitions
and the same np.random state give the same batches as SB3's buffer (all three strategies,
1 and 2 environments, timeouts, wrap-around, info dicts), across commit + open, in whole DQN
runs, and after SIGKILL + resume; and the one-line refusals of HER misuse."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import torch as th
from stable_baselines3 import DQN, HerReplayBuffer
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.vec_env import DummyVecEnv

from rlbuffers.integrations.sb3 import (
    CommitCallback,
    ZarrDictReplayBuffer,
    ZarrHerReplayBuffer,
    resume,
)
from tests import sb3_her_child as child

ROOT = Path(__file__).resolve().parent.parent
N_BITS = 6


class BonusEnv(BitFlippingEnv):
    """BitFlippingEnv whose reward reads the info dict (for copy_info_dict)."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        info["bonus"] = float(self.current_step)
        return obs, reward, terminated, truncated, info

    def compute_reward(self, achieved_goal, desired_goal, info):
        base = super().compute_reward(achieved_goal, desired_goal, info)
        if info is None or len(info) == 0 or isinstance(info, dict):
            return base
        return base + np.array([i.get("bonus", 0.0) for i in info], dtype=np.float32)


def make_env(n_envs=1, cls=BitFlippingEnv):
    return DummyVecEnv([lambda: cls(n_bits=N_BITS, max_steps=N_BITS)] * n_envs)


@pytest.fixture(autouse=True)
def keep_global_rng():
    """Tests seed and resume() sets the global RNG states: give the others theirs back."""
    state = np.random.get_state(), random.getstate(), th.get_rng_state()
    threads = th.get_num_threads()
    th.set_num_threads(1)
    yield
    np.random.set_state(state[0])
    random.setstate(state[1])
    th.set_rng_state(state[2])
    th.set_num_threads(threads)


def pair(tmp_path, env, buffer_size, ours_only=(), **kwargs):
    args = (buffer_size, env.observation_space, env.action_space)
    theirs = HerReplayBuffer(*args, env, "cpu", n_envs=env.num_envs, **kwargs)
    ours = ZarrHerReplayBuffer(*args, env, "cpu", n_envs=env.num_envs, path=tmp_path / "her",
                               **kwargs, **dict(ours_only))
    return ours, theirs


def feed(env, buffers, steps, seed=0):
    """Random steps of ``env`` added to every buffer, as SB3's off-policy loop adds them
    (``next_obs`` is the terminal observation where an episode ended)."""
    rng = np.random.default_rng(seed)
    env.seed(seed)
    obs = env.reset()
    for _ in range(steps):
        action = rng.integers(0, N_BITS, size=env.num_envs)
        new_obs, reward, done, infos = env.step(action)
        next_obs = {k: v.copy() for k, v in new_obs.items()}
        for i, d in enumerate(done):
            if d:
                for k in next_obs:
                    next_obs[k][i] = infos[i]["terminal_observation"][k]
        for buf in buffers:
            buf.add(obs, next_obs, action.reshape(-1, 1), reward, done, infos)
        obs = new_obs


def assert_same_samples(ours, theirs, batch_size=64, seed=1, draws=3):
    for d in range(draws):
        np.random.seed(seed + d)
        expected = theirs.sample(batch_size)
        np.random.seed(seed + d)
        got = ours.sample(batch_size)
        for name in ("observations", "next_observations"):
            for key, value in getattr(expected, name).items():
                assert th.equal(getattr(got, name)[key], value), (name, key)
        for name in ("actions", "dones", "rewards"):
            assert th.equal(getattr(got, name), getattr(expected, name)), name


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("n_envs", [1, 2])
def test_samples_equal_sb3_her(tmp_path, strategy, n_envs):
    """Bit-identical batches, before the ring is full, after it wrapped mid-episode (the
    overwritten episode is dropped whole) and with episodes still running."""
    env = make_env(n_envs)
    ours, theirs = pair(tmp_path, env, 40, n_sampled_goal=4, goal_selection_strategy=strategy)
    feed(env, [ours, theirs], 15)
    assert_same_samples(ours, theirs)
    feed(env, [ours, theirs], 53, seed=1)   # wraps (40 // n_envs steps), episodes mid-way
    np.testing.assert_array_equal(ours.ep_length, theirs.ep_length)
    np.testing.assert_array_equal(ours.ep_start, theirs.ep_start)
    assert_same_samples(ours, theirs, seed=7)
    ours.close()


def test_no_timeout_handling_and_no_relabelling(tmp_path):
    env = make_env()
    ours, theirs = pair(tmp_path, env, 64, n_sampled_goal=1, handle_timeout_termination=False)
    feed(env, [ours, theirs], 50)
    assert_same_samples(ours, theirs, batch_size=32)
    ours.close()
    # n_sampled_goal=0: only real transitions (SB3's call of compute_reward on an empty batch
    # fails in BitFlippingEnv; none is made here)
    plain = ZarrHerReplayBuffer(64, env.observation_space, env.action_space, env, "cpu",
                                n_sampled_goal=0, path=tmp_path / "plain")
    feed(env, [plain], 50)
    batch = plain.sample(32)
    assert (batch.observations["desired_goal"] == 1).all()    # BitFlippingEnv's only goal
    assert set(batch.rewards.flatten().tolist()) <= {0.0, -1.0}
    plain.close()


def test_copy_info_dict_reaches_compute_reward(tmp_path):
    env = make_env(cls=BonusEnv)
    ours, theirs = pair(tmp_path, env, 48, {"info_bytes": 128}, copy_info_dict=True)
    feed(env, [ours, theirs], 60)
    assert_same_samples(ours, theirs)
    np.random.seed(3)
    batch = ours.sample(40)
    relabelled = batch.rewards[40 - int(ours.her_ratio * 40):]
    assert (relabelled >= 0).all() and relabelled.max() > 1   # the bonus (step >= 1) was read
    ours.close()
    small = ZarrHerReplayBuffer(8, env.observation_space, env.action_space, env, "cpu",
                                copy_info_dict=True, info_bytes=4, path=tmp_path / "small")
    with pytest.raises(Exception, match="info_bytes=4"):
        feed(env, [small], 2)
    small.close()


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_relabelled_goals_semantics(tmp_path, strategy):
    """Checked against the stored episodes, not SB3: rows int(her_ratio * B) from the end
    carry as desired goal (obs and next obs) an achieved goal of their own episode: at or
    after their step (future), at its last step (final), at any step (episode); and the
    reward compute_reward gives for it. (A row is found by its observation and action.)"""
    env = make_env()
    buf = ZarrHerReplayBuffer(200, env.observation_space, env.action_space, env, "cpu",
                              n_sampled_goal=3, goal_selection_strategy=strategy,
                              path=tmp_path / "her")
    feed(env, [buf], 120)
    np.random.seed(0)
    batch = buf.sample(100)
    real = 100 - int(buf.her_ratio * 100)
    assert real == 25
    rows = buf.storage[:]
    ends = np.flatnonzero(rows["terminated"] | rows["truncated"])
    obs = {k: v.numpy() for k, v in batch.observations.items()}
    nxt = {k: v.numpy() for k, v in batch.next_observations.items()}

    def goals(t):   # the achieved goals the strategy may pick for stored transition t
        end = ends[ends >= t][0]
        first = ends[ends < t][-1] + 1 if (ends < t).any() else 0
        lo = {"future": t, "final": end, "episode": first}[strategy]
        return rows["next_obs.achieved_goal"][lo:end + 1]

    for i in range(real, 100):
        match = np.flatnonzero((rows["obs.observation"] == obs["observation"][i]).all(1)
                               & (rows["action"][:, 0] == batch.actions[i, 0].item()))
        assert any((goals(t) == obs["desired_goal"][i]).all(1).any() for t in match)
        assert (nxt["desired_goal"][i] == obs["desired_goal"][i]).all()
    assert (obs["desired_goal"][:real] == 1).all()   # real rows keep BitFlippingEnv's goal
    expected = env.env_method("compute_reward", nxt["achieved_goal"], obs["desired_goal"], None,
                              indices=[0])[0]
    np.testing.assert_array_equal(batch.rewards.numpy()[real:, 0], expected[real:])
    buf.close()


def test_commit_open_round_trip(tmp_path):
    """commit + open: the same episode bookkeeping and the same batches as the buffer that
    went on in memory (staged steps included); adds after open go on as in SB3."""
    env = make_env(2)
    ours, theirs = pair(tmp_path, env, 30, {"write_batch": 5}, goal_selection_strategy="episode")
    feed(env, [ours, theirs], 37)
    ours.commit()
    ours.close()
    again = ZarrHerReplayBuffer.open(tmp_path / "her", env.observation_space,
                                     env.action_space, "cpu", env=env)
    assert (again.pos, again.full, again.n_sampled_goal) == (theirs.pos, theirs.full, 4)
    np.testing.assert_array_equal(again.ep_length, theirs.ep_length)
    np.testing.assert_array_equal(again.ep_start, theirs.ep_start)
    assert_same_samples(again, theirs)
    feed(env, [again, theirs], 11, seed=5)
    assert_same_samples(again, theirs, seed=11)
    again.close()
    plain = ZarrDictReplayBuffer(8, env.observation_space, env.action_space,
                                 path=tmp_path / "plain")
    plain.commit()
    plain.close()
    with pytest.raises(ValueError, match="not written by ZarrHerReplayBuffer"):
        ZarrHerReplayBuffer.open(tmp_path / "plain", env.observation_space, env.action_space)


def test_truncate_last_trajectory_as_sb3(tmp_path):
    """What SB3's load_replay_buffer does for HER: the running episodes end and are sampled;
    kept by commit + open (the next step's episode start marks the end)."""
    env = make_env(2)
    ours, theirs = pair(tmp_path, env, 50)
    feed(env, [ours, theirs], 23)   # episodes of 6 steps: both environments mid-episode
    for buf in (ours, theirs):
        with pytest.warns(UserWarning, match="truncated"):
            buf.truncate_last_trajectory()
    np.testing.assert_array_equal(ours.ep_length, theirs.ep_length)
    assert_same_samples(ours, theirs)
    feed(env, [ours, theirs], 4, seed=3)
    ours.commit()
    ours.close()
    again = ZarrHerReplayBuffer.open(tmp_path / "her", env.observation_space,
                                     env.action_space, "cpu", env=env)
    np.testing.assert_array_equal(again.ep_length, theirs.ep_length)
    assert_same_samples(again, theirs, seed=5)
    again.close()


def test_dqn_run_equals_sb3_her(tmp_path):
    """A whole DQN run: the same parameters at the end as with SB3's HerReplayBuffer."""
    def train(cls, **extra):
        model = DQN("MultiInputPolicy", make_env(), seed=0, device="cpu", buffer_size=300,
                    learning_starts=50, batch_size=32, train_freq=4, gradient_steps=1,
                    policy_kwargs={"net_arch": [32]}, replay_buffer_class=cls,
                    replay_buffer_kwargs={"n_sampled_goal": 4,
                                          "goal_selection_strategy": "future", **extra})
        return model.learn(400)

    theirs = train(HerReplayBuffer)
    ours = train(ZarrHerReplayBuffer, path=str(tmp_path / "run"))
    a, b = ours.policy.state_dict(), theirs.policy.state_dict()
    assert all(th.equal(a[k], b[k]) for k in b)
    np.testing.assert_array_equal(ours.replay_buffer.ep_length, theirs.replay_buffer.ep_length)
    ours.replay_buffer.close()


def test_zarr_dict_refuses_her_arguments(tmp_path):
    """ZarrDictReplayBuffer given HER's arguments: one line naming ZarrHerReplayBuffer, at
    construction (``_ZarrBuffer.__init__`` takes ``**unknown`` to refuse them so)."""
    env = make_env()
    with pytest.raises(TypeError, match=r"^\['goal_selection_strategy', 'n_sampled_goal'\]: "
                                        r"ZarrDictReplayBuffer takes no such arguments .*"
                                        r"ZarrHerReplayBuffer\)$"):
        DQN("MultiInputPolicy", env, replay_buffer_class=ZarrDictReplayBuffer,
            replay_buffer_kwargs={"path": str(tmp_path / "b"), "n_sampled_goal": 4,
                                  "goal_selection_strategy": "future"})
    assert not (tmp_path / "b").exists()
    with pytest.raises(TypeError, match="^\\['pth'\\]: ZarrDictReplayBuffer takes no such"):
        ZarrDictReplayBuffer(8, env.observation_space, env.action_space, path=tmp_path / "c",
                             pth=1)


def test_refusals_name_zarr_her(tmp_path):
    env = make_env()
    model = DQN("MultiInputPolicy", env, replay_buffer_class=HerReplayBuffer,
                learning_starts=10)
    with pytest.raises(TypeError, match="HerReplayBuffer.*use ZarrHerReplayBuffer") as err:
        model.learn(50, callback=CommitCallback(10))
    assert "\n" not in str(err.value) and model.num_timesteps == 0
    for bad, match in [({"goal_selection_strategy": "past"}, "goal_selection_strategy: expected"),
                       ({"n_sampled_goal": -1}, "n_sampled_goal: expected an int >= 0")]:
        with pytest.raises(ValueError, match=match):
            ZarrHerReplayBuffer(8, env.observation_space, env.action_space, env,
                                path=tmp_path / "d", **bad)
    with pytest.raises(TypeError, match="observation_space: expected a Dict with"):
        ZarrHerReplayBuffer(8, env.observation_space["observation"], env.action_space, env,
                            path=tmp_path / "e")


def run_child(mode: str, run_dir: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.sb3_her_child", mode, str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


def test_kill_then_resume_samples_as_uninterrupted(tmp_path):
    """DQN + ZarrHerReplayBuffer + CommitCallback, SIGKILLed after a commit with steps added
    since: resume() gives the model, buffer (episodes included) and RNG states of the commit,
    which sample what the uninterrupted run sampled, and training goes on."""
    (tmp_path / "record").mkdir()
    (tmp_path / "kill").mkdir()
    assert run_child("record", tmp_path / "record") == 0
    assert run_child("kill", tmp_path / "kill") == -signal.SIGKILL
    expected = dict(np.load(tmp_path / "record" / "expected.npz"))
    model = resume(DQN, tmp_path / "kill" / "buffer", env=child.make_env(), device="cpu")
    buf = model.replay_buffer
    assert isinstance(buf, ZarrHerReplayBuffer) and buf.env is not None
    assert model.num_timesteps == child.RECORD_AT
    got = child.draw(model)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    model.learn(100, reset_num_timesteps=False, callback=CommitCallback(50))
    assert model.num_timesteps == child.RECORD_AT + 100 and buf.storage.commit >= 3
    buf.close()
