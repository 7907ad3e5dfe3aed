"""``convert_sb3`` on replay buffers written by real Stable-Baselines3 training runs: DQN on
CartPole (one and two envs, ring full or not, ``optimize_memory_usage`` on and off, episodes
truncated by a time limit) and Atari Pong, SAC and TD3 on MuJoCo, ``DictReplayBuffer`` (DQN and
SAC ``MultiInputPolicy``). Every converted transition is compared, oldest first, with SB3's own
arrays and with SB3's own ``_get_samples`` of the same ring row and env.

A trained model's action space carries its ``np.random.Generator``; the restricted unpickler
keeps it (and any other object it does not rebuild) as inert data: it used to fail on every
trained buffer. Files that are not SB3 buffer pickles raise ``ConvertError``."""

from __future__ import annotations

import collections
import gzip
import pickle
from unittest import mock

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "gymnasium", "ale_py", "mujoco")

import gymnasium as gym  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3 import DQN, SAC, TD3  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer as SB3DictReplayBuffer  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.save_util import save_to_pkl  # noqa: E402

from rlbuffers import ReplayBuffer  # noqa: E402
from rlbuffers.cli import main as cli_main  # noqa: E402
from rlbuffers.integrations.sb3.convert import ConvertError, convert_sb3, load_sb3_pickle  # noqa: E402

NET = {"net_arch": [16]}  # copied per model: SB3 adds to the policy_kwargs it gets


def oldest_first(rb) -> np.ndarray:
    """Valid ring rows of an SB3 buffer, oldest first (SB3's own sampling range)."""
    if not rb.full:
        return np.arange(rb.pos)
    first = 1 if rb.optimize_memory_usage else 0  # row pos's next observation is overwritten
    return (rb.pos + np.arange(first, rb.buffer_size)) % rb.buffer_size


def sb3_samples(rb, rows: np.ndarray):
    """SB3's ``_get_samples`` of ring rows ``rows`` for every env, in (row, env) order (its
    random env index is replaced by each env in turn)."""
    batch = np.repeat(rows, rb.n_envs)
    envs = np.tile(np.arange(rb.n_envs), len(rows))
    with mock.patch.object(np.random, "randint", lambda *a, **k: envs):
        return rb._get_samples(batch)


def expected_from_arrays(rb) -> dict[str, np.ndarray]:
    """The transitions straight from SB3's ring arrays: ``[T * n_envs, ...]`` oldest first,
    then by env, as the converter promises."""
    rows = oldest_first(rb)
    flat = lambda a: a[rows].reshape(len(rows) * rb.n_envs, *a.shape[2:])  # noqa: E731
    if isinstance(rb.observations, dict):
        out = {f"obs.{k}": flat(a) for k, a in rb.observations.items()}
        out.update({f"next_obs.{k}": flat(a) for k, a in rb.next_observations.items()})
    else:
        out = {"obs": flat(rb.observations)}
        if rb.optimize_memory_usage:
            nxt = rb.observations[(rows + 1) % rb.buffer_size]
            out["next_obs"] = nxt.reshape(len(rows) * rb.n_envs, *nxt.shape[2:])
        else:
            out["next_obs"] = flat(rb.next_observations)
    timeout = flat(rb.timeouts) != 0
    out.update(action=flat(rb.actions), reward=flat(rb.rewards), truncated=timeout,
               terminated=(flat(rb.dones) != 0) & ~timeout)
    if rb.n_envs > 1:
        out["env"] = np.tile(np.arange(rb.n_envs), len(rows))
    return out


def assert_same_transitions(rb, path) -> dict[str, np.ndarray]:
    """Every transition of the converted buffer equals SB3's arrays and SB3's sample of the
    same row and env, in time order."""
    want = expected_from_arrays(rb)
    with ReplayBuffer.open(path, mode="r") as buf:
        got = buf[np.arange(len(buf))]
        assert len(buf) == len(oldest_first(rb)) * rb.n_envs
        assert set(buf.fields) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v.reshape(got[k].shape), err_msg=k)
        assert got[k].dtype == v.dtype or k in ("terminated", "truncated", "env"), k
    s = sb3_samples(rb, oldest_first(rb))
    if isinstance(s.observations, dict):
        for k in s.observations:
            np.testing.assert_array_equal(got[f"obs.{k}"], s.observations[k].numpy())
            np.testing.assert_array_equal(got[f"next_obs.{k}"], s.next_observations[k].numpy())
    else:
        np.testing.assert_array_equal(got["obs"], s.observations.numpy())
        np.testing.assert_array_equal(got["next_obs"], s.next_observations.numpy())
    np.testing.assert_array_equal(got["action"], s.actions.numpy().reshape(got["action"].shape))
    np.testing.assert_array_equal(got["reward"], s.rewards.numpy().reshape(-1))
    # SB3's sampled dones are terminations only (timeouts masked out when it handles them)
    np.testing.assert_array_equal(got["terminated"], s.dones.numpy().reshape(-1) != 0)
    return got


def train_and_convert(model, steps, tmp_path, *, full=True, cli=False):
    model.learn(total_timesteps=steps)
    assert model._n_updates > 0  # trained, not only collected
    model.save_replay_buffer(tmp_path / "rb.pkl")
    rb = model.replay_buffer
    assert rb.full == full  # full: the ring wrapped, the harder case
    if cli:
        argv = ["convert", "sb3", str(tmp_path / "rb.pkl"), str(tmp_path / "out"), "--quiet"]
        assert cli_main(argv) == 0
    else:
        convert_sb3(tmp_path / "rb.pkl", tmp_path / "out").close()
    got = assert_same_transitions(rb, tmp_path / "out")
    return rb, got


@pytest.mark.parametrize("optimize", [False, True])
def test_dqn_cartpole(tmp_path, optimize):
    # a 10-step time limit: truncated episodes (SB3 timeouts) as well as terminated ones
    env = gym.make("CartPole-v1", max_episode_steps=10)
    model = DQN("MlpPolicy", env, buffer_size=300, learning_starts=50, batch_size=16,
                optimize_memory_usage=optimize, policy_kwargs=dict(NET), seed=0,
                replay_buffer_kwargs={"handle_timeout_termination": not optimize})
    rb, got = train_and_convert(model, 500, tmp_path)
    assert got["terminated"].any()
    assert got["truncated"].any() != optimize  # without handle_timeout_termination: none
    assert hasattr(rb, "next_observations") != optimize  # optimized: obs[pos + 1] only


@pytest.mark.parametrize("optimize", [False, True])
def test_dqn_cartpole_two_envs_through_the_cli(tmp_path, optimize):
    env = make_vec_env("CartPole-v1", n_envs=2, seed=0, env_kwargs={"max_episode_steps": 10})
    model = DQN("MlpPolicy", env, buffer_size=200, learning_starts=50, batch_size=16,
                optimize_memory_usage=optimize, policy_kwargs=dict(NET), seed=0,
                replay_buffer_kwargs={"handle_timeout_termination": not optimize})
    rb, got = train_and_convert(model, 300, tmp_path, cli=True)  # 150 steps per env, ring 100
    assert rb.n_envs == 2 and rb.buffer_size == 100
    assert got["env"].tolist() == [0, 1] * (len(got["env"]) // 2)


def test_dqn_cartpole_ring_not_full(tmp_path):
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=1000, learning_starts=50,
                batch_size=16, policy_kwargs=dict(NET), seed=0)
    rb, got = train_and_convert(model, 120, tmp_path, full=False)
    assert rb.pos == len(got["reward"]) == 120


@pytest.mark.parametrize("optimize", [False, True])
def test_dqn_atari_pong(tmp_path, optimize):
    import ale_py

    gym.register_envs(ale_py)
    # AtariPreprocessing needs opencv, which the dev extra does not install: frame skip by
    # ALE, grayscale by ALE, and every 4th pixel instead of a resize (a small NatureCNN input:
    # its gradient steps dominate the test's time)
    env = gym.make("ALE/Pong-v5", obs_type="grayscale", frameskip=4)  # uint8 (210, 160)
    small = spaces.Box(0, 255, (53, 40), np.uint8)
    env = gym.wrappers.TransformObservation(env, lambda o: o[::4, ::4], small)
    env = gym.wrappers.FrameStackObservation(env, 4)  # uint8 (4, 53, 40)
    model = DQN("CnnPolicy", env, buffer_size=150, learning_starts=150, batch_size=8,
                train_freq=8, optimize_memory_usage=optimize, seed=0,
                replay_buffer_kwargs={"handle_timeout_termination": not optimize},
                policy_kwargs=dict(NET))
    rb, got = train_and_convert(model, 200, tmp_path)
    assert rb.observations.dtype == np.uint8 and rb.observations.shape[2:] == (4, 53, 40)
    assert got["obs"].dtype == np.uint8 and got["obs"].any()


def test_sac_mujoco_inverted_pendulum(tmp_path):
    env = gym.make("InvertedPendulum-v5", max_episode_steps=30)
    model = SAC("MlpPolicy", env, buffer_size=120, learning_starts=50, batch_size=16,
                policy_kwargs=dict(NET), seed=0)
    rb, got = train_and_convert(model, 160, tmp_path)
    assert got["action"].shape == (120, 1) and got["action"].dtype == np.float32


def test_td3_mujoco_half_cheetah_two_envs(tmp_path):
    env = make_vec_env("HalfCheetah-v5", n_envs=2, seed=0)
    model = TD3("MlpPolicy", env, buffer_size=160, learning_starts=100, batch_size=16,
                train_freq=4, gradient_steps=1, policy_kwargs=dict(NET), seed=0)
    rb, got = train_and_convert(model, 240, tmp_path)  # 120 steps per env, ring 80
    assert got["obs"].shape == (160, 17) and got["action"].shape == (160, 6)


class DictObs(gym.ObservationWrapper):
    """A 4-number observation as a dict: its first and second halves."""

    def __init__(self, env):
        super().__init__(env)
        box = spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.observation_space = spaces.Dict({"pos": box, "vel": box})

    def observation(self, o):
        o = np.asarray(o, np.float32)
        return {"pos": o[:2], "vel": o[2:]}


@pytest.mark.parametrize("algo", ["DQN", "SAC"])
def test_dict_replay_buffer(tmp_path, algo):
    if algo == "DQN":
        model = DQN("MultiInputPolicy", DictObs(gym.make("CartPole-v1")), buffer_size=200,
                    learning_starts=50, batch_size=16, policy_kwargs=dict(NET), seed=0)
    else:
        model = SAC("MultiInputPolicy", DictObs(gym.make("InvertedPendulum-v5")),
                    buffer_size=100, learning_starts=50, batch_size=16, policy_kwargs=dict(NET),
                    seed=0)
    rb, got = train_and_convert(model, 300 if algo == "DQN" else 150, tmp_path)
    assert type(rb).__name__ == "DictReplayBuffer"
    assert {"obs.pos", "obs.vel", "next_obs.pos", "next_obs.vel"} <= set(got)
    assert cli_main(["inspect", str(tmp_path / "out")]) == 0


BIT_GENERATORS = [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox,
                  np.random.SFC64]


@pytest.mark.parametrize("bitgen", BIT_GENERATORS, ids=lambda c: c.__name__)
def test_a_buffer_whose_action_space_was_sampled(tmp_path, bitgen):
    """The smallest reproduction: the pickled action space carries a used Generator (of any
    of numpy's bit generators, seeded through a SeedSequence)."""
    env = gym.make("CartPole-v1")
    env.action_space._np_random = np.random.Generator(bitgen(np.random.SeedSequence(3)))
    env.action_space.sample()
    env.observation_space.sample()
    rb = SB3ReplayBuffer(3, env.observation_space, env.action_space, device="cpu")
    o = np.zeros((1, 4), np.float32)
    for i in range(3):
        rb.add(o + i, o + i + 1, np.array([i % 2]), np.array([float(i)]), np.array([i == 2]),
               [{}])
    save_to_pkl(tmp_path / "rb.pkl", rb)
    assert cli_main(["convert", "sb3", str(tmp_path / "rb.pkl"), str(tmp_path / "out"),
                     "--quiet"]) == 0
    assert_same_transitions(rb, tmp_path / "out")


class OddState:
    """Pickles with a state that is neither a dict nor a (dict, slots) pair."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return (OddState, (0,), self.state)


@pytest.mark.parametrize("state", [("a", 1, 2), ({1: "non-str key"}, None), [1, 2], 7,
                                   {"x": np.arange(3)}, (None, {"slot": 1})])
def test_any_pickled_state_stays_inert(tmp_path, state):
    """Spaces with a Discrete ``start`` of np.int64, Box bounds, a Dict space of spaces, a
    legacy RandomState, a SeedSequence, a torch.device, a defaultdict and an object whose
    ``__setstate__`` gets a tuple, list or int: all read back as inert data."""
    obs_space = spaces.Dict(collections.OrderedDict(
        pos=spaces.Box(np.array([-1, -2], np.float32), np.array([1, 2], np.float32)),
        img=spaces.Box(0, 255, (2, 3), np.uint8)), seed=1)
    act_space = spaces.Discrete(3, start=np.int64(-1), seed=2)
    obs_space.sample()
    act_space.sample()
    rb = SB3DictReplayBuffer(4, obs_space, act_space, device="cpu")
    for t in range(5):
        o = {"pos": np.full((1, 2), t, np.float32), "img": np.full((1, 2, 3), t, np.uint8)}
        rb.add(o, {k: v + 1 for k, v in o.items()}, np.array([t % 3 - 1]), np.array([t]),
               np.array([False]), [{}])
    rb.extras = [OddState(state), np.random.RandomState(0), np.random.SeedSequence(5),
                 collections.defaultdict(list, a=[1]), {"deep": OddState(state)}]
    save_to_pkl(tmp_path / "rb.pkl", rb)
    b = load_sb3_pickle(tmp_path / "rb.pkl")
    assert b.discrete_action and b.pos == 1 and b.full
    convert_sb3(tmp_path / "rb.pkl", tmp_path / "out").close()
    got = assert_same_transitions(rb, tmp_path / "out")
    assert got["action"].tolist() == [0, 1, -1, 0]


def test_files_that_are_not_sb3_buffers_raise_convert_error(tmp_path, capsys):
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=100, learning_starts=50,
                batch_size=16, policy_kwargs=dict(NET), seed=0)
    model.learn(total_timesteps=60)
    model.save(tmp_path / "model.zip")  # the model, not its replay buffer: a zip file
    model.save_replay_buffer(tmp_path / "rb.pkl")
    data = (tmp_path / "rb.pkl").read_bytes()
    (tmp_path / "truncated.pkl").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.pkl").write_bytes(b"")
    (tmp_path / "bad.pkl.gz").write_bytes(gzip.compress(data)[:40] + b"\0" * 40)
    (tmp_path / "policy.pkl").write_bytes(pickle.dumps(model.policy.state_dict()))
    (tmp_path / "space.pkl").write_bytes(pickle.dumps(model.action_space))
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF  # one corrupt byte: fails somewhere, never unhandled
    (tmp_path / "flipped.pkl").write_bytes(bytes(flipped))
    unreadable = "expected an SB3 ReplayBuffer/DictReplayBuffer pickle " \
        "(model.save_replay_buffer), but it is not a readable pickle"
    cases = {"model.zip": f"{unreadable} (a zip archive: model.save() writes one",
             "truncated.pkl": f"{unreadable} (it ends too early: truncated?)",
             "empty.pkl": f"{unreadable} (the file is empty)",
             "bad.pkl.gz": unreadable,
             "policy.pkl": "got a pickled OrderedDict (missing attributes observations",
             "space.pkl": "got a pickled gymnasium.spaces.discrete.Discrete", "flipped.pkl": ""}
    for name, match in cases.items():
        path = tmp_path / name
        try:
            convert_sb3(path, tmp_path / f"out-{name}").close()
        except ConvertError as e:
            assert str(path) in str(e) and match in str(e), (name, str(e))
        else:
            assert name == "flipped.pkl"  # a flipped byte in an array is still a buffer
        if name != "flipped.pkl":
            assert not (tmp_path / f"out-{name}").exists()
            argv = ["convert", "sb3", str(path), str(tmp_path / "cli-out"), "--quiet"]
            assert cli_main(argv) == 2
            assert str(path) in capsys.readouterr().err
