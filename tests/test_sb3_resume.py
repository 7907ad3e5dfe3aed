"""Save + SIGKILL + resume of an SB3 run with ZarrReplayBuffer: the resumed model, buffer and
RNG states sample exactly what the uninterrupted run sampled after the same commit."""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import gymnasium as gym
import torch as th
from stable_baselines3 import DQN
from stable_baselines3.common.env_util import make_vec_env

from rlbuffers import ReplayBuffer
from rlbuffers.cli import main as cli_main
from rlbuffers.errors import UnsafePathError
from rlbuffers.integrations.sb3 import CommitCallback, ZarrReplayBuffer, restore_rng, resume
from rlbuffers.integrations.sb3 import pointer as sb3_pointer
from rlbuffers.integrations.sb3.layout import rows_to_json
from tests import sb3_resume_child as child

ROOT = Path(__file__).resolve().parent.parent


def run_child(mode: str, run_dir: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.sb3_resume_child", mode, str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


@pytest.fixture
def keep_global_rng():
    """resume() sets the global RNG states: give the other tests theirs back."""
    state = np.random.get_state(), random.getstate(), th.get_rng_state()
    threads = th.get_num_threads()
    yield
    np.random.set_state(state[0])
    random.setstate(state[1])
    th.set_rng_state(state[2])
    th.set_num_threads(threads)


def test_kill_then_resume_samples_as_uninterrupted(tmp_path, keep_global_rng, capsys):
    (tmp_path / "record").mkdir()
    (tmp_path / "kill").mkdir()
    assert run_child("record", tmp_path / "record") == 0
    assert run_child("kill", tmp_path / "kill") == -signal.SIGKILL
    expected = dict(np.load(tmp_path / "record" / "expected.npz"))
    # the kill came after the commit of step 600; only its zip is kept
    assert sorted(p.name for p in (tmp_path / "kill" / "ckpt").iterdir()) == ["model_600.zip"]

    th.set_num_threads(1)
    model = resume(DQN, tmp_path / "kill" / "buffer", device="cpu")
    buf = model.replay_buffer
    assert isinstance(buf, ZarrReplayBuffer)
    assert model.num_timesteps == child.RECORD_AT == int(expected["num_timesteps"])
    assert (buf.pos, buf.full, buf.size()) == (100, True, 500)  # 600 steps in a ring of 500
    got = child.draw(model)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

    # the buffer is an ordinary rlbuffers buffer: the CLI inspects its commit
    assert cli_main(["inspect", str(tmp_path / "kill" / "buffer"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["size"] == 500 and report["total_added"] == 600
    assert report["metadata"]["num_timesteps"] == 600
    buf.close()


def test_model_load_leaves_the_buffer_alone(tmp_path, keep_global_rng):
    """Plain ``DQN.load`` (e.g. to evaluate) builds a ZarrReplayBuffer at the saved path: it
    must neither fail nor touch the committed buffer."""
    (tmp_path / "kill").mkdir()
    run_child("kill", tmp_path / "kill")
    model = DQN.load(tmp_path / "kill" / "ckpt" / "model_600.zip", device="cpu")
    with pytest.raises(FileExistsError, match="resume"):
        model.replay_buffer.sample(4)
    # what save_replay_buffer pickles: a pointer to the buffer's last commit, nothing written
    pointer = pickle.loads(pickle.dumps(model.replay_buffer))
    assert (pointer.size(), pointer.storage.commit) == (500, 3)
    pointer.close()
    again = resume(DQN, tmp_path / "kill" / "buffer", device="cpu")
    assert len(again.replay_buffer.storage) == 500
    again.replay_buffer.close()


def test_resume_refuses_another_env_count(tmp_path, keep_global_rng):
    (tmp_path / "kill").mkdir()
    run_child("kill", tmp_path / "kill")
    with pytest.raises(ValueError, match="n_envs=1, the model now has n_envs=2"):
        resume(DQN, tmp_path / "kill" / "buffer", device="cpu",
               env=make_vec_env("CartPole-v1", n_envs=2, seed=0))
    env = gym.make("CartPole-v1")
    bare = ZarrReplayBuffer(8, env.observation_space, env.action_space, "cpu",
                            path=tmp_path / "bare")
    bare.commit()   # no CommitCallback: no model zip named
    bare.close()
    with pytest.raises(ValueError, match="names no model zip"):
        resume(DQN, tmp_path / "bare", device="cpu")


# -- fuzz_sb3_kwargs findings: resume checks the commit before it changes anything -------------
def committed_run(run_dir: Path) -> Path:
    """A DQN run committed at step 100 by CommitCallback (model zip named); its buffer."""
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=500, learning_starts=50, seed=0,
                device="cpu", policy_kwargs={"net_arch": [16]},
                replay_buffer_class=ZarrReplayBuffer,
                replay_buffer_kwargs={"path": str(run_dir / "buffer")})
    model.learn(100, callback=CommitCallback(100, run_dir / "ckpt"))
    model.replay_buffer.close()
    return run_dir / "buffer"


def edit_metadata(buffer: Path, edit) -> None:
    manifest = json.loads((buffer / "manifest.json").read_text())
    edit(manifest["metadata"])
    (buffer / "manifest.json").write_text(json.dumps(manifest))


def rng_snapshot() -> tuple[bytes, ...]:
    return (pickle.dumps(np.random.get_state()), pickle.dumps(random.getstate()),
            th.get_rng_state().numpy().tobytes())


def assert_failed_cleanly(buffer: Path, before: tuple[bytes, ...]) -> None:
    """No RNG changed, nothing held: the buffer opens for writing again, rows unchanged."""
    assert rng_snapshot() == before
    with ReplayBuffer.open(buffer) as rb:
        assert (len(rb), rb.commit) == (100, 1)


def test_resume_refuses_a_fifo_model_zip_without_blocking(tmp_path, keep_global_rng):
    buffer = committed_run(tmp_path)
    fifo = tmp_path / "ckpt" / "model_fifo.zip"
    os.mkfifo(fifo)
    edit_metadata(buffer, lambda md: md["model"].__setitem__("zip", str(fifo)))

    def ring(*_):
        raise TimeoutError("resume blocked on the FIFO")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(10)
    before = rng_snapshot()
    try:
        with pytest.raises(UnsafePathError, match="model_fifo.zip: expected a regular file") as e:
            resume(DQN, buffer, device="cpu")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert "\n" not in str(e.value)
    assert_failed_cleanly(buffer, before)
    # a symlink in place of the commit's zip is refused too; an explicit zip_path may be one
    link = tmp_path / "ckpt" / "latest.zip"
    link.symlink_to(tmp_path / "ckpt" / "model_100.zip")
    edit_metadata(buffer, lambda md: md["model"].__setitem__("zip", str(link)))
    with pytest.raises(UnsafePathError, match="latest.zip: expected a regular file"):
        resume(DQN, buffer, device="cpu")
    resume(DQN, buffer, device="cpu", zip_path=link).replay_buffer.close()


@pytest.mark.parametrize("edit, match", [
    (lambda md: md.__setitem__("model", None), r"^model: expected a dict .*got NoneType None$"),
    (lambda md: md.__setitem__("model", [1]), r"^model: expected a dict .*got list \[1\]$"),
    (lambda md: md["model"].__setitem__("zip", 7),
     r"^model\.zip: expected a path \(str\), got int 7"),
    (lambda md: md["model"]["action_space_rng"].__setitem__("state", True),
     r"^model\.action_space_rng: expected a valid PCG64 state"),
    (lambda md: md["model"]["action_space_rng"].__setitem__("bit_generator", "Nope"),
     r"^model\.action_space_rng: expected a numpy bit generator state"),
    (lambda md: md["model"].__setitem__("action_space_rng", 10**30),
     r"^model\.action_space_rng: expected .*got int 1000"),
    (lambda md: md["model"]["action_space_rng"].__setitem__("bit_generator", "MT19937"),
     r"^model\.action_space_rng: expected a valid MT19937 state"),
    (lambda md: md.__setitem__("num_timesteps", "100"), r"num_timesteps: expected an int >= 0"),
], ids=["model-none", "model-list", "zip-int", "state-bool", "unknown-generator", "huge",
        "other-generator", "num_timesteps-str"])
def test_resume_checks_the_model_entry_before_changing_anything(tmp_path, keep_global_rng,
                                                                edit, match):
    """The model entry is checked before the buffer is opened and the RNG states are set
    (it used to be read last: AttributeError, or numpy's TypeError with the RNGs already
    set and the buffer left held)."""
    buffer = committed_run(tmp_path)
    edit_metadata(buffer, edit)
    before = rng_snapshot()
    with pytest.raises(ValueError, match=match) as e:
        resume(DQN, buffer, device="cpu")
    assert "\n" not in str(e.value)
    assert_failed_cleanly(buffer, before)


def _set(*path_and_value):
    *path, key, value = path_and_value

    def edit(md):
        for k in path:
            md = md[k]
        md[key] = value(md[key]) if callable(value) else value
    return edit


RNG_EDITS = {
    "numpy-keys-short": (_set("rng", "numpy", "keys", lambda v: v[:100]),
                         r"^rng\.numpy\.keys: expected a list of 624 ints .*got a list of 100$"),
    "numpy-keys-huge": (_set("rng", "numpy", "keys", lambda v: [10**30, *v[1:]]),
                        r"^rng\.numpy\.keys: expected .*got int 1000+ at index 0$"),
    "numpy-pos": (_set("rng", "numpy", "pos", 9999), r"^rng\.numpy\.pos: expected an int in"),
    "numpy-generator": (_set("rng", "numpy", "bit_generator", 3), r"^rng\.numpy\.bit_generator"),
    "numpy-gauss": (_set("rng", "numpy", "cached_gaussian", "x"),
                    r"^rng\.numpy\.cached_gaussian: expected a float, got str 'x'$"),
    "python-internal": (_set("rng", "python", "internal", []),
                        r"^rng\.python\.internal: expected a list of 625 ints"),
    "python-index": (_set("rng", "python", "internal", lambda v: [*v[:-1], 10**6]),
                     r"^rng\.python\.internal: expected its last item"),
    "python-missing": (lambda md: md["rng"].pop("python"),
                       r"^rng\.python: expected a dict .*got nothing \(missing\)$"),
    "torch-short": (_set("rng", "torch", "AAAA"), r"^rng\.torch: expected 5056 bytes"),
    "torch-notbase64": (_set("rng", "torch", "!!notbase64"), r"^rng\.torch: expected base64"),
    "torch-cut": (_set("rng", "torch", lambda v: v[:-3]), r"^rng\.torch: expected base64"),
    "torch-bool": (_set("rng", "torch", True), r"^rng\.torch: expected base64 .*got bool True$"),
    "rng-list": (lambda md: md.__setitem__("rng", []), r"^rng: expected a dict"),
}


@pytest.mark.parametrize("name", list(RNG_EDITS))
def test_restore_rng_checks_every_part_before_setting_any(tmp_path, keep_global_rng, name):
    """restore_rng used to set numpy's state, then fail on Python's or torch's (IndexError,
    OverflowError, binascii.Error, torch's RuntimeError) naming no field; resume ran it after
    opening the buffer."""
    buffer = committed_run(tmp_path)
    with ReplayBuffer.open(buffer, mode="r") as rb:
        state = copy.deepcopy(rb.metadata)
    edit, match = RNG_EDITS[name]
    edit(state)
    before = rng_snapshot()
    with pytest.raises(ValueError, match=match) as e:
        restore_rng(state["rng"])
    assert "\n" not in str(e.value) and rng_snapshot() == before
    edit_metadata(buffer, edit)
    with pytest.raises(ValueError, match=match):
        resume(DQN, buffer, device="cpu")
    assert_failed_cleanly(buffer, before)


SB3_EDITS = {
    "pos-none": (_set("sb3", "pos", None), r"^sb3\.pos: expected an int in \[0, 500\), got "
                                          r"NoneType None$"),
    "pos-range": (_set("sb3", "pos", 500), r"^sb3\.pos: expected an int in \[0, 500\), got 500$"),
    "buffer_size-none": (_set("sb3", "buffer_size", None), r"^sb3\.buffer_size: expected an int"),
    "buffer_size-capacity": (_set("sb3", "buffer_size", 2**40),
                             r"^sb3\.buffer_size: expected 500 rows \(the buffer's capacity\)"),
    "n_envs-zero": (_set("sb3", "n_envs", 0), r"^sb3\.n_envs: expected an int >= 1, got 0$"),
    "full-str": (_set("sb3", "full", "yes"), r"^sb3\.full: expected a bool, got str 'yes'$"),
    "forced-none": (_set("sb3", "forced_dones", None), r"^sb3\.forced_dones: expected a list"),
    "forced-env": (_set("sb3", "forced_dones", [[3, 5]]), r"^sb3\.forced_dones: expected a list"),
    "pending-int": (_set("sb3", "pending_next_obs", 4294967296),
                    r"^sb3\.pending_next_obs: expected a dict"),
    "pending-dict": (_set("sb3", "pending_next_obs", {"next_obs": {"x": 1}}),
                     r"^sb3\.pending_next_obs\.next_obs: expected base64 \.npy text"),
    "pending-shape": (_set("sb3", "pending_next_obs", {"next_obs": rows_to_json(
        {"x": np.zeros(3, np.float32)})["x"]}), r"^sb3\.pending_next_obs: expected"),
    "omu-missing": (lambda md: md["sb3"].pop("optimize_memory_usage"),
                    r"^sb3\.optimize_memory_usage: expected a bool, got nothing \(missing\)$"),
    "axis-str": (_set("sb3", "frame_stack_axis", "0"), r"^sb3\.frame_stack_axis: expected"),
}


@pytest.mark.parametrize("name", list(SB3_EDITS))
def test_open_checks_the_sb3_state_before_holding(tmp_path, keep_global_rng, name):
    """ZarrReplayBuffer.open read the "sb3" state unchecked (TypeError, AttributeError
    naming no field), some of it after hold(), leaving an open writer behind."""
    buffer = committed_run(tmp_path)
    edit, match = SB3_EDITS[name]
    edit_metadata(buffer, edit)
    env = gym.make("CartPole-v1")
    for call in (lambda: ZarrReplayBuffer.open(buffer, env.observation_space,
                                               env.action_space, "cpu"),
                 lambda: resume(DQN, buffer, device="cpu")):
        before = rng_snapshot()
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
        assert_failed_cleanly(buffer, before)
    assert not [k for k, v in sb3_pointer._HOLDERS.items()
                if k.startswith(str(tmp_path)) and not v._rb._closed]


def test_a_resume_that_fails_after_loading_gives_the_rng_states_back(tmp_path, keep_global_rng):
    """SB3's load reseeds the global RNGs (set_random_seed): a resume refused after it (here
    the zip's num_timesteps is not the commit's) now puts them back and holds nothing."""
    buffer = committed_run(tmp_path)
    edit_metadata(buffer, lambda md: md.__setitem__("num_timesteps", 5))
    np.random.seed(1234)
    before = rng_snapshot()
    with pytest.raises(ValueError, match=r"num_timesteps 100 differs from the buffer commit's 5"):
        resume(DQN, buffer, device="cpu")
    assert_failed_cleanly(buffer, before)
