"""``rlbuffers convert sb3``: real Stable-Baselines3 buffers, pickled as SB3 saves them, come
back as rlbuffers buffers with the same transitions in the same order (oldest first)."""

from __future__ import annotations

import argparse
import gzip
import os
import pickle

from tests.heavy import require

require("gymnasium", "stable_baselines3")

import numpy as np
import pytest
from gymnasium import spaces
from stable_baselines3.common.buffers import (
    DictReplayBuffer,
    NStepReplayBuffer,
    ReplayBuffer,
    RolloutBuffer,
)
from stable_baselines3.common.save_util import save_to_pkl

from rlbuffers import BufferExistsError
from rlbuffers import ReplayBuffer as RLBuffer
from rlbuffers.cli import main as cli_main
from rlbuffers.cli.convert import add_convert_parser
from rlbuffers.integrations.sb3.convert import ConvertError, convert_sb3, load_sb3_pickle

OBS_SPACE = spaces.Box(0, 255, (2, 3), np.uint8)


def _obs(t: int, n_envs: int, nxt: bool = False) -> np.ndarray:
    """Observation of step ``t`` for every env: value ``(10 * t + env + 5 * nxt) % 251``."""
    env = np.arange(n_envs)[:, None, None]
    return ((10 * t + env + 5 * nxt) % 251 + np.zeros((n_envs, 2, 3))).astype(np.uint8)


def _fill(rb: ReplayBuffer, steps: int, n_envs: int, next_obs_of: str = "separate") -> None:
    """Step ``t``: reward 100 t + env, action (t + env) % 4, done every 4th step of env 0,
    timeout (truncation) every 6th step of env 1 (which also sets done, as VecEnvs do)."""
    for t in range(steps):
        env = np.arange(n_envs)
        done = ((t % 4 == 3) & (env == 0)) | ((t % 6 == 5) & (env == 1))
        infos = [{"TimeLimit.truncated": bool(t % 6 == 5 and e == 1)} for e in range(n_envs)]
        nxt = _obs(t + 1, n_envs) if next_obs_of == "following" else _obs(t, n_envs, nxt=True)
        rb.add(_obs(t, n_envs), nxt, (t + env) % 4, (100 * t + env).astype(np.float32), done,
               infos)


def _expected(steps: list[int], n_envs: int) -> dict[str, np.ndarray]:
    t = np.repeat(np.asarray(steps), n_envs)
    env = np.tile(np.arange(n_envs), len(steps))
    timeout = (t % 6 == 5) & (env == 1)
    done = ((t % 4 == 3) & (env == 0)) | timeout
    return {"reward": (100 * t + env).astype(np.float32), "action": (t + env) % 4,
            "terminated": done & ~timeout, "truncated": timeout, "env": env, "t": t}


def _check(buf: RLBuffer, exp: dict[str, np.ndarray], next_offset: tuple[int, int]) -> None:
    got = buf[:]
    assert len(buf) == len(exp["reward"])
    for k in ("reward", "action", "terminated", "truncated"):
        np.testing.assert_array_equal(got[k], exp[k], err_msg=k)
    if "env" in buf.fields:
        np.testing.assert_array_equal(got["env"], exp["env"])
    base = 10 * exp["t"] + exp["env"]
    np.testing.assert_array_equal(got["obs"][:, 0, 0], base % 251)
    dt, dv = next_offset
    np.testing.assert_array_equal(got["next_obs"][:, 1, 2], (base + 10 * dt + dv) % 251)


def test_replay_buffer_wraparound_timeouts_and_envs_in_sb3_order(tmp_path):
    rb = ReplayBuffer(10, OBS_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    _fill(rb, 13, 2)  # 5 rows per env: wraps twice, pos = 3
    assert (rb.pos, rb.full) == (3, True)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    buf = convert_sb3(tmp_path / "rb.pkl", tmp_path / "out", seed=1)
    assert buf.fields["action"].shape == () and buf.fields["obs"].shape == (2, 3)
    _check(buf, _expected(list(range(8, 13)), 2), next_offset=(0, 5))
    assert buf.capacity == 10 and buf.commit == 1
    src = buf.metadata["converted_from"]
    assert (src["pos"], src["full"], src["n_envs"], src["transitions"]) == (3, True, 2, 10)
    assert src["class"] == "stable_baselines3.common.buffers.ReplayBuffer"
    buf.close()
    reopened = RLBuffer.open(tmp_path / "out")  # committed: survives close + open
    _check(reopened, _expected(list(range(8, 13)), 2), next_offset=(0, 5))
    assert reopened.episodes == int(_expected(list(range(8, 13)), 2)["terminated"].sum()
                                    + _expected(list(range(8, 13)), 2)["truncated"].sum())
    reopened.close()


def test_not_full_buffer_keeps_rows_before_pos(tmp_path):
    rb = ReplayBuffer(8, OBS_SPACE, spaces.Discrete(4), device="cpu", n_envs=1)
    _fill(rb, 5, 1)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    with convert_sb3(tmp_path / "rb.pkl", tmp_path / "out", capacity=100) as buf:
        assert "env" not in buf.fields and buf.capacity == 100
        _check(buf, _expected(list(range(5)), 1), next_offset=(0, 5))


def test_optimize_memory_usage_drops_the_overwritten_oldest_row(tmp_path):
    rb = ReplayBuffer(6, OBS_SPACE, spaces.Discrete(4), device="cpu", n_envs=1,
                      optimize_memory_usage=True, handle_timeout_termination=False)
    _fill(rb, 9, 1, next_obs_of="following")  # pos 3; row 3 holds step 9's obs, not step 3's
    save_to_pkl(tmp_path / "rb.pkl", rb)
    with convert_sb3(tmp_path / "rb.pkl", tmp_path / "out") as buf:
        exp = _expected(list(range(4, 9)), 1)
        exp["terminated"], exp["truncated"] = exp["terminated"] | exp["truncated"], 0 * exp["t"]
        _check(buf, {**exp, "truncated": exp["truncated"].astype(bool)}, next_offset=(1, 0))


def test_dict_observations_and_box_actions(tmp_path):
    obs_space = spaces.Dict({"pos": spaces.Box(-1, 1, (3,)), "img": OBS_SPACE})
    act_space = spaces.Box(-1, 1, (2,))
    rb = DictReplayBuffer(4, obs_space, act_space, device="cpu", n_envs=1)
    for t in range(6):
        o = {"pos": np.full((1, 3), t, np.float32), "img": _obs(t, 1)}
        n = {"pos": np.full((1, 3), -t, np.float32), "img": _obs(t, 1, nxt=True)}
        rb.add(o, n, np.array([[t, -t]], np.float32), np.array([t], np.float32),
               np.array([t == 3]), [{}])
    save_to_pkl(tmp_path / "drb.pkl", rb)
    with convert_sb3(tmp_path / "drb.pkl", tmp_path / "out") as buf:
        assert set(buf.fields) == {"obs.pos", "obs.img", "next_obs.pos", "next_obs.img",
                                   "action", "reward", "terminated", "truncated"}
        got = buf[:]
        np.testing.assert_array_equal(got["obs.pos"][:, 0], [2, 3, 4, 5])
        np.testing.assert_array_equal(got["next_obs.pos"][:, 2], [-2, -3, -4, -5])
        np.testing.assert_array_equal(got["obs.img"][:, 0, 0], [20, 30, 40, 50])
        np.testing.assert_array_equal(got["next_obs.img"][:, 0, 0], [25, 35, 45, 55])
        np.testing.assert_array_equal(got["action"], [[2, -2], [3, -3], [4, -4], [5, -5]])
        np.testing.assert_array_equal(got["terminated"], [False, True, False, False])


def test_nstep_buffer_converts_its_one_step_transitions(tmp_path):
    rb = NStepReplayBuffer(4, OBS_SPACE, spaces.Discrete(4), device="cpu", n_steps=3,
                           gamma=0.9)
    _fill(rb, 6, 1)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    with convert_sb3(tmp_path / "rb.pkl", tmp_path / "out") as buf:
        _check(buf, _expected([2, 3, 4, 5], 1), next_offset=(0, 5))
        assert buf.metadata["converted_from"]["n_steps"] == 3.0


def test_large_arrays_are_memory_mapped_not_read(tmp_path):
    space = spaces.Box(0, 255, (4, 84, 84), np.uint8)
    rb = ReplayBuffer(64, space, spaces.Discrete(4), device="cpu")  # 1.8 MB per obs array
    for t in range(70):
        o = np.full((1, 4, 84, 84), t, np.uint8)
        rb.add(o, o + 1, np.array([t % 4]), np.array([t], np.float32), np.array([False]), [{}])
    save_to_pkl(tmp_path / "rb.pkl", rb)
    sb3 = load_sb3_pickle(tmp_path / "rb.pkl")
    assert isinstance(sb3.observations, np.memmap) and not sb3.observations.flags.writeable
    assert sb3.mapped_bytes == rb.observations.nbytes + rb.next_observations.nbytes
    np.testing.assert_array_equal(sb3.observations, rb.observations)
    with convert_sb3(tmp_path / "rb.pkl", tmp_path / "out", chunk_transitions=10) as buf:
        got = buf[:]
        np.testing.assert_array_equal(got["obs"][:, 0, 0, 0], np.arange(6, 70))
        np.testing.assert_array_equal(got["next_obs"][:, 3, 83, 83], np.arange(7, 71))


def test_gzip_and_old_protocol_pickles_convert_without_mapping(tmp_path):
    rb = ReplayBuffer(4, OBS_SPACE, spaces.Discrete(4), device="cpu")
    _fill(rb, 3, 1)
    with gzip.open(tmp_path / "rb.pkl.gz", "wb") as f:
        pickle.dump(rb, f, protocol=5)
    with open(tmp_path / "rb2.pkl", "wb") as f:
        pickle.dump(rb, f, protocol=2)
    for name in ("rb.pkl.gz", "rb2.pkl"):
        assert load_sb3_pickle(tmp_path / name).mapped_bytes == 0
        with convert_sb3(tmp_path / name, tmp_path / f"out-{name}") as buf:
            _check(buf, _expected([0, 1, 2], 1), next_offset=(0, 5))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_pickled_code_never_runs_and_non_replay_buffers_are_refused(tmp_path):
    evil = _Evil()
    evil.flag = tmp_path / "pwned"
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps({"x": evil}))
    with pytest.raises(ConvertError, match="expected an SB3 ReplayBuffer"):
        load_sb3_pickle(tmp_path / "evil.pkl")
    assert not evil.flag.exists()
    rollout = RolloutBuffer(4, OBS_SPACE, spaces.Discrete(4), device="cpu")
    save_to_pkl(tmp_path / "rollout.pkl", rollout)
    with pytest.raises(ConvertError, match="RolloutBuffer"):
        convert_sb3(tmp_path / "rollout.pkl", tmp_path / "out")
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle at all")
    with pytest.raises(ConvertError, match="not a readable pickle"):
        load_sb3_pickle(tmp_path / "junk.pkl")
    assert not (tmp_path / "out").exists()


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlbuffers")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_rlbuffers_command_line_has_convert(tmp_path, capsys):
    rb = ReplayBuffer(4, OBS_SPACE, spaces.Discrete(4), device="cpu")
    _fill(rb, 3, 1)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    argv = ["convert", "sb3", str(tmp_path / "rb.pkl"), str(tmp_path / "out"), "--quiet"]
    assert cli_main(argv) == 0
    assert cli_main(argv) == 2  # exists: refused without --overwrite
    assert "already exists" in capsys.readouterr().err


def test_cli_converts_and_refuses_to_overwrite(tmp_path, capsys):
    rb = ReplayBuffer(10, OBS_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    _fill(rb, 13, 2)
    save_to_pkl(tmp_path / "rb.pkl", rb)
    out = str(tmp_path / "out")
    assert _cli(["convert", "sb3", str(tmp_path / "rb.pkl"), out, "--chunk-transitions", "4",
                 "--quiet"]) == 0
    assert "converted 10 transitions (ReplayBuffer, n_envs 2, pos 3" in capsys.readouterr().out
    with RLBuffer.open(out) as buf:
        assert buf.chunk_transitions == 4
        _check(buf, _expected(list(range(8, 13)), 2), next_offset=(0, 5))
    with pytest.raises(BufferExistsError):
        _cli(["convert", "sb3", str(tmp_path / "rb.pkl"), out, "--quiet"])
    assert _cli(["convert", "sb3", str(tmp_path / "rb.pkl"), out, "--overwrite", "--quiet"]) == 0
    capsys.readouterr()
    # through the real entry point, errors are one line and exit 2
    assert cli_main(["convert", "sb3", str(tmp_path / "rb.pkl"), out, "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("rlbuffers: error: ")
    assert cli_main(["convert", "sb3", str(tmp_path / "missing.pkl"), out, "--quiet"]) == 2
    assert "missing.pkl" in capsys.readouterr().err
