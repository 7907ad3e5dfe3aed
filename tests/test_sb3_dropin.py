"""Issue 44: what SB3's own code does with a replay buffer (``Model.load``, ``resume`` then
``learn``, ``save_replay_buffer`` / ``load_replay_buffer``, ``deepcopy``, reading its arrays,
writing ``dones`` in place) works on ZarrReplayBuffer as on SB3's buffer, or refuses in one
line before anything changes. One test per finding of the audit (B1-B4, B6)."""

from __future__ import annotations

import copy
import os
import random
import zipfile

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import gymnasium as gym
import torch as th
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer
from stable_baselines3.common.save_util import load_from_zip_file

from rlbuffers import ReplayBuffer
from rlbuffers.cli import main as cli_main
from rlbuffers.errors import NotABufferError
from rlbuffers.integrations.sb3 import (
    CommitCallback,
    ZarrDictReplayBuffer,
    ZarrReplayBuffer,
    resume,
)
from tests.test_sb3_framestack import frame_stacked_env, steps
from tests.test_sb3_integration import ACTIONS, OBS, assert_same_samples, random_step


@pytest.fixture(autouse=True)
def keep_global_rng():
    """resume() sets the global RNG states: give the other tests theirs back."""
    state = np.random.get_state(), random.getstate(), th.get_rng_state()
    yield
    np.random.set_state(state[0])
    random.setstate(state[1])
    th.set_rng_state(state[2])


def dqn(run_dir, **kwargs) -> DQN:
    """A small DQN whose buffer is made the way a re-run script makes it (overwrite=True)."""
    return DQN("MlpPolicy", "CartPole-v1", buffer_size=500, learning_starts=50, seed=0,
               device="cpu", policy_kwargs={"net_arch": [16]},
               replay_buffer_class=ZarrReplayBuffer,
               replay_buffer_kwargs={"path": str(run_dir / "buffer"), "overwrite": True},
               **kwargs)


def stored(path) -> tuple[int, int]:
    with ReplayBuffer.open(path, mode="r") as rb:
        return len(rb), rb.commit


# -- B1: loading a model never destroys its buffer ----------------------------------------------
def test_load_and_resume_keep_a_buffer_made_with_overwrite(tmp_path):
    model = dqn(tmp_path)
    model.learn(300, callback=CommitCallback(100, tmp_path / "ckpt"))
    zip_path = tmp_path / "ckpt" / "model_300.zip"
    assert "overwrite" not in load_from_zip_file(zip_path)[0]["replay_buffer_kwargs"]
    assert model.replay_buffer_kwargs == {"path": str(tmp_path / "buffer")}
    before = stored(tmp_path / "buffer")
    assert before[0] == 300

    # a zip saved by an older version still carries overwrite=True: load ignores it
    model.replay_buffer_kwargs["overwrite"] = True
    model.save(tmp_path / "old_style.zip")
    for zip_file in (zip_path, tmp_path / "old_style.zip"):
        loaded = DQN.load(zip_file, device="cpu")
        assert stored(tmp_path / "buffer") == before
        assert "overwrite" not in loaded.replay_buffer_kwargs

    # resume in the same process: the training model's buffer hands the directory over
    resumed = resume(DQN, tmp_path / "buffer", device="cpu", env=gym.make("CartPole-v1"))
    assert (resumed.replay_buffer.size(), resumed.num_timesteps) == (300, 300)
    with pytest.raises(ValueError, match="resume"):
        model.replay_buffer.sample(4)
    resumed.learn(100, callback=CommitCallback(100, tmp_path / "ckpt"),
                  reset_num_timesteps=False)
    assert stored(tmp_path / "buffer")[0] == 400
    resumed.replay_buffer.close()


# -- B2: model zips are written beside and renamed in, never rewritten -------------------------
def test_learn_without_steps_after_resume_keeps_the_zip(tmp_path):
    model = dqn(tmp_path)
    model.learn(200, callback=CommitCallback(100, tmp_path / "ckpt"))
    model.replay_buffer.close()
    zip_path = tmp_path / "ckpt" / "model_200.zip"
    before = os.stat(zip_path)
    resumed = resume(DQN, tmp_path / "buffer", device="cpu", env=gym.make("CartPole-v1"))
    resumed.learn(0, callback=CommitCallback(100, tmp_path / "ckpt"), reset_num_timesteps=False)
    after = os.stat(zip_path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == \
        (before.st_ino, before.st_mtime_ns, before.st_size)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model_200.zip"]
    with ReplayBuffer.open(tmp_path / "buffer", mode="r") as rb:
        assert rb.metadata["model"]["zip"] == str(zip_path.resolve())
    resumed.replay_buffer.close()


def test_a_failed_model_save_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    model = dqn(tmp_path)
    callback = CommitCallback(100, tmp_path / "ckpt")
    model.learn(100, callback=callback)

    def broken_save(path_or_file, *args, **kwargs):
        if isinstance(path_or_file, (str, os.PathLike)):
            with open(path_or_file, "wb") as f:
                f.write(b"PK partial")
        else:
            path_or_file.write(b"PK partial")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        model.learn(100, callback=callback, reset_num_timesteps=False)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model_100.zip"]
    assert zipfile.is_zipfile(tmp_path / "ckpt" / "model_100.zip")
    with ReplayBuffer.open(tmp_path / "buffer", mode="r") as rb:
        assert rb.metadata["num_timesteps"] == 100
    model.replay_buffer.close()


# -- B3: save_replay_buffer / load_replay_buffer / deepcopy ------------------------------------
@pytest.mark.filterwarnings("error")   # no ResourceWarning (a leaked handle)
def test_save_replay_buffer_writes_a_pointer_that_loads_back(tmp_path):
    model = dqn(tmp_path)
    model.learn(200)
    buf = model.replay_buffer
    arrays = {k: np.array(getattr(buf, k)) for k in ("observations", "next_observations",
                                                     "actions", "rewards", "dones", "timeouts")}
    target = tmp_path / "replay.pkl"
    target.write_bytes(b"an older file")
    model.save_replay_buffer(target)
    assert 0 < target.stat().st_size < 4096   # a pointer, not the transitions
    assert stored(tmp_path / "buffer") == (200, 1)
    np.random.seed(3)
    expected = buf.sample(32)

    model.replay_buffer = None
    model.load_replay_buffer(target)
    loaded = model.replay_buffer
    assert isinstance(loaded, ZarrReplayBuffer) and loaded is not buf
    assert (loaded.pos, loaded.full, loaded.size()) == (200, False, 200)
    for name, values in arrays.items():
        np.testing.assert_array_equal(getattr(loaded, name), values, err_msg=name)
    np.random.seed(3)
    assert_same_samples(loaded.sample(32), expected)
    with pytest.raises(ValueError, match="load_replay_buffer"):
        buf.sample(4)   # the model's previous buffer handed the directory over
    model.replay_buffer.close()


# SB3's load_from_pkl leaves its file open when unpickling raises (its error path)
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_pointer_to_an_older_commit_refuses_before_closing_anything(tmp_path):
    model = dqn(tmp_path)
    model.learn(100)
    model.save_replay_buffer(tmp_path / "replay.pkl")
    loaded = model.replay_buffer
    model.learn(10, reset_num_timesteps=False)
    loaded.commit()
    with pytest.raises(ValueError, match="names commit 1, but the buffer's last commit is 2"):
        model.load_replay_buffer(tmp_path / "replay.pkl")
    assert model.replay_buffer is loaded and loaded.size() == model.num_timesteps > 100
    model.replay_buffer.close()


def test_deepcopy_refuses_in_one_line(tmp_path):
    buf = ZarrReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu", path=tmp_path / "buf")
    buf.add(*random_step(OBS["box"], ACTIONS["discrete"], 1, np.random.default_rng(0)))
    for make_copy, name in ((copy.deepcopy, "deepcopy"), (copy.copy, "copy")):
        with pytest.raises(TypeError, match=rf"^{name}\(ZarrReplayBuffer\): refused") as e:
            make_copy(buf)
        assert "\n" not in str(e.value) and "ReplayBuffer.open(path, mode='r')" in str(e.value)
    assert stored(tmp_path / "buf") == (0, 0)   # nothing committed or changed
    buf.close()


def test_save_replay_buffer_of_a_loaded_model_points_at_the_last_commit(tmp_path):
    """What ``Model.load`` built over an existing buffer holds nothing; saving it writes a
    pointer to that buffer's last commit and changes nothing there."""
    model = dqn(tmp_path)
    model.learn(60, callback=CommitCallback(60, tmp_path / "ckpt"))
    model.replay_buffer.close()
    loaded = DQN.load(tmp_path / "ckpt" / "model_60.zip", device="cpu")
    loaded.save_replay_buffer(tmp_path / "replay.pkl")
    assert stored(tmp_path / "buffer") == (60, 1)
    loaded.load_replay_buffer(tmp_path / "replay.pkl")
    assert (loaded.replay_buffer.size(), loaded.replay_buffer.pos) == (60, 60)
    loaded.replay_buffer.close()


# -- B4: SB3's arrays -----------------------------------------------------------------------------
def test_sampling_a_buffer_marked_full_by_hand_equals_sb3(tmp_path):
    """SB3's test_buffer_dtypes samples an empty buffer with ``full = True``: zeros."""
    ours = ZarrReplayBuffer(4, OBS["image"], ACTIONS["box64"], "cpu", path=tmp_path / "b")
    theirs = SB3ReplayBuffer(4, OBS["image"], ACTIONS["box64"], "cpu")
    ours.full = theirs.full = True
    np.random.seed(0)
    expected = theirs.sample(16)
    np.random.seed(0)
    assert_same_samples(ours.sample(16), expected)
    assert ours.observations.dtype == np.uint8 and ours.actions.dtype == np.float32
    ours.close()


@pytest.mark.parametrize("stacked", [False, True])
def test_dones_written_in_place_sample_as_sb3(tmp_path, stacked):
    """What SB3's learn(reset_num_timesteps=True) does with optimize_memory_usage: mark the
    newest step done in place. The mark is sampled, kept by commit and reopened."""
    kwargs = dict(device="cpu", n_envs=2, optimize_memory_usage=True,
                  handle_timeout_termination=False)
    venv = frame_stacked_env(2, False)
    extra = {"frame_stack_axis": 0} if stacked else {}
    ours = ZarrReplayBuffer(16, venv.observation_space, venv.action_space, **kwargs,
                            path=tmp_path / "b", **extra)
    theirs = SB3ReplayBuffer(16, venv.observation_space, venv.action_space, **kwargs)
    for args in steps(venv, 5):
        ours.add(*args)
        theirs.add(*args)
    newest = (theirs.pos - 1) % theirs.buffer_size
    ours.dones[newest] = True
    theirs.dones[newest] = True
    np.testing.assert_array_equal(ours.dones, theirs.dones)
    np.random.seed(1)
    expected = theirs.sample(64)
    np.random.seed(1)
    assert_same_samples(ours.sample(64), expected)
    ours.commit()
    ours.close()
    again = ZarrReplayBuffer.open(tmp_path / "b", venv.observation_space, venv.action_space)
    np.testing.assert_array_equal(again.dones, theirs.dones)
    np.random.seed(1)
    assert_same_samples(again.sample(64), expected)
    with pytest.raises(ValueError, match="cannot be cleared"):
        again.dones[:] = 0
    again.close()


def test_frame_stacked_arrays(tmp_path):
    """Frame-stacked storage keeps one frame per step: observations refuse, naming sample();
    actions, rewards, dones and timeouts equal SB3's."""
    venv = frame_stacked_env(2, False)
    ours = ZarrReplayBuffer(8, venv.observation_space, venv.action_space, "cpu", n_envs=2,
                            path=tmp_path / "b", frame_stack_axis=0)
    theirs = SB3ReplayBuffer(8, venv.observation_space, venv.action_space, "cpu", n_envs=2)
    for args in steps(venv, 11):
        ours.add(*args)
        theirs.add(*args)
    for name in ("observations", "next_observations"):
        with pytest.raises(AttributeError, match=rf"^{name}: .*sample\(\)"):
            getattr(ours, name)
    for name in ("actions", "rewards", "dones", "timeouts"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name), err_msg=name)
    ours.close()


def test_timeouts_from_infos_shaped_as_sb3_extend_passes_them(tmp_path):
    """SB3's test_save_load_replay_buffer extends with ``{"TimeLimit.truncated": array([x])}``."""
    ours = ZarrReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu", path=tmp_path / "b")
    theirs = SB3ReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu")
    rng = np.random.default_rng(0)
    for i in range(6):
        obs, nxt, act, rew, done, _ = random_step(OBS["box"], ACTIONS["discrete"], 1, rng)
        infos = [{"TimeLimit.truncated": np.array([i % 2 == 0])}]
        ours.add(obs, nxt, act, rew, done, infos)
        theirs.add(obs, nxt, act, rew, done, infos)
    np.testing.assert_array_equal(ours.timeouts, theirs.timeouts)
    ours.close()


# -- B6: inspect on an SB3 commit -------------------------------------------------------------
def test_inspect_summarises_long_metadata(tmp_path, capsys):
    model = dqn(tmp_path)
    model.learn(100, callback=CommitCallback(100, tmp_path / "ckpt"))
    model.replay_buffer.close()
    assert cli_main(["inspect", str(tmp_path / "buffer")]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) < 300
    assert '"num_timesteps": 100' in out and '"torch": <string of ' in out
    assert cli_main(["inspect", str(tmp_path / "buffer"), "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    assert len(report["metadata"]["rng"]["numpy"]["keys"]) == 624   # whole values


# -- B7: add copies each observation once, in C order ------------------------------------------
def test_add_stores_transposed_observations_in_c_order(tmp_path):
    """VecTransposeImage hands ``add`` a transposed view; the staged copy must be C-ordered
    (a copy that kept the view's strides made every frame comparison of a frame-stacked
    ``add`` strided: 1.6x SB3's fill time) and equal to SB3's stored stacks."""
    venv = frame_stacked_env(1, True)   # channels last: [1, 5, 5, 4]
    ours = ZarrReplayBuffer(8, venv.observation_space, venv.action_space, "cpu",
                            path=tmp_path / "b", frame_stack_axis=-1)
    for obs, *_ in steps(venv, 3):
        view = np.ascontiguousarray(np.moveaxis(obs, -1, 1))   # [1, 4, 5, 5] in memory
        transposed = np.moveaxis(view, 1, -1)                   # a [1, 5, 5, 4] view of it
        assert not transposed.flags.c_contiguous
        rows = ours._layout.obs_rows(transposed, "obs")
        assert rows["obs"].flags.c_contiguous
        np.testing.assert_array_equal(rows["obs"], obs)
    ours.close()


# -- fuzz_sb3_kwargs findings: arguments and pointers are checked, naming the field ------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"n_envs": 0}, ValueError, r"^n_envs: expected an int >= 1, got 0$"),
    ({"n_envs": "2"}, TypeError, r"^n_envs: expected an int >= 1, got str '2'$"),
    ({"n_envs": 1.5}, TypeError, r"^n_envs: expected an int >= 1, got float 1.5$"),
    ({"buffer_size": "8"}, TypeError, r"^buffer_size: expected an int >= 1, got str '8'$"),
    ({"working_dir": 299}, TypeError,
     r"^working_dir: expected a path \(str or os.PathLike\) or None, got int 299$"),
    ({"write_batch": []}, TypeError, r"^write_batch: expected an int >= 1, got list \[\]$"),
    ({"write_batch": 0}, ValueError, r"^write_batch: expected an int >= 1, got 0$"),
    ({"write_batch": True}, TypeError, r"^write_batch: expected an int >= 1, got bool True$"),
    ({"codec": 7}, TypeError, r"^codec: expected a codec name \(str\) or a dict field -> name, "
                              r"got int 7$"),
], ids=["n_envs-0", "n_envs-str", "n_envs-float", "buffer_size-str", "working_dir-int",
        "write_batch-list", "write_batch-0", "write_batch-bool", "codec-int"])
def test_constructor_errors_name_the_argument(tmp_path, kwargs, error, match):
    """They used to be ZeroDivisionError (buffer_size // n_envs), os.fspath's or int()'s
    TypeError, or an AttributeError in create, naming no argument."""
    args = {"buffer_size": 8, **kwargs}
    with pytest.raises(error, match=match):
        ZarrReplayBuffer(args.pop("buffer_size"), OBS["box"], ACTIONS["discrete"], "cpu",
                         path=tmp_path / "buf", **args)
    assert not (tmp_path / "buf").exists()


def test_space_and_open_argument_errors_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match=r"^observation_space: ZarrDictReplayBuffer expected a "
                                        r"Dict space, got Box$"):
        ZarrDictReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu", path=tmp_path / "d")
    buf = ZarrReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu", path=tmp_path / "buf")
    buf.commit()
    buf.close()
    for kwargs, error, match in (({"working_dir": 299}, TypeError, r"^working_dir: expected"),
                                 ({"write_batch": "4"}, TypeError, r"^write_batch: expected"),
                                 ({"write_batch": -1}, ValueError, r"^write_batch: expected")):
        with pytest.raises(error, match=match):
            ZarrReplayBuffer.open(tmp_path / "buf", OBS["box"], ACTIONS["discrete"], "cpu",
                                  **kwargs)
    ZarrReplayBuffer.open(tmp_path / "buf", OBS["box"], ACTIONS["discrete"], "cpu").close()


def _pointer_edits(tmp_path):
    return {
        "class-core": (lambda p: p.__setitem__("class", ReplayBuffer), TypeError,
                       r"^pointer\.class: expected one of ZarrReplayBuffer, .*got type "),
        "class-str": (lambda p: p.__setitem__("class", "ZarrReplayBuffer"), TypeError,
                      r"^pointer\.class: expected"),
        "path-int": (lambda p: p.__setitem__("path", 7), TypeError,
                     r"^pointer\.path: expected a path \(str\), got int 7$"),
        "path-pathlike": (lambda p: p.__setitem__("path", tmp_path / "buffer"), TypeError,
                          r"^pointer\.path: expected a path \(str\), got PosixPath"),
        "path-empty": (lambda p: p.__setitem__("path", ""), ValueError, r"^pointer\.path: "),
        "path-missing": (lambda p: p.pop("path"), ValueError,
                         r"^pointer\.path: expected a path \(str\), got nothing \(missing\)$"),
        "working_dir-int": (lambda p: p.__setitem__("working_dir", 299), TypeError,
                            r"^pointer\.working_dir: expected a path \(str\) or None, got int"),
        "working_dir-dict": (lambda p: p.__setitem__("working_dir", {"a": 1}), TypeError,
                             r"^pointer\.working_dir: expected"),
        "write_batch-list": (lambda p: p.__setitem__("write_batch", []), TypeError,
                             r"^pointer\.write_batch: expected an int >= 1, got list \[\]$"),
        "commit-str": (lambda p: p.__setitem__("commit", "1"), TypeError,
                       r"^pointer\.commit: expected an int >= 0, got str '1'$"),
        "space-int": (lambda p: p.__setitem__("action_space", 3), TypeError,
                      r"^pointer\.action_space: expected a gymnasium space, got int 3$"),
        "path-nowhere": (lambda p: p.__setitem__("path", str(tmp_path / "nowhere")),
                         NotABufferError, r"^pointer\.path: expected a buffer, got "),
        "version": (lambda p: p.__setitem__("version", 9), ValueError,
                    r"^pointer\.version: expected 1, got 9$"),
        "class-dict": (lambda p: p.__setitem__("class", ZarrDictReplayBuffer), TypeError,
                       r"^observation_space: ZarrDictReplayBuffer expected a Dict space"),
        "space-other": (lambda p: p.__setitem__("observation_space", OBS["box"]), ValueError,
                        r"fields .* do not match the spaces"),
    }


@pytest.mark.parametrize("name", list(_pointer_edits(None)))
def test_a_pointer_is_checked_before_anything_is_closed_or_opened(tmp_path, name):
    """A pickled pointer may come from anyone: its fields are checked before the model's
    buffer is handed over (a ``class`` that is not ours used to close it, then fail in
    ``ReplayBuffer.open`` naming no field; a class or spaces that do not match the buffer
    are found on a read-only view, before the holder is closed)."""
    from rlbuffers.integrations.sb3.pointer import pointer, reopen

    model = dqn(tmp_path)
    model.learn(60)
    ptr = pointer(model.replay_buffer)
    edit, error, match = _pointer_edits(tmp_path)[name]
    edit(ptr)
    with pytest.raises(error, match=match) as e:
        reopen(ptr)
    assert "\n" not in str(e.value)
    assert model.replay_buffer.sample(4) is not None   # still the model's, not handed over
    assert stored(tmp_path / "buffer") == (60, 1)
    model.replay_buffer.close()


def test_a_pointers_working_dir_is_not_used_unless_this_process_made_it(tmp_path):
    """A pointer's working_dir used to be passed to open: one naming the buffer itself (or
    a folder of other files) had the working tier wipe it. Now the working tier goes to its
    default place unless the instance of this process holding the buffer uses that one."""
    import pickle

    from rlbuffers.integrations.sb3.pointer import pointer, reopen

    model = dqn(tmp_path)
    model.learn(60)
    ptr = pointer(model.replay_buffer)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.txt").write_text("keep")
    for where in (tmp_path / "buffer", tmp_path / "notes", tmp_path):
        ptr["working_dir"] = str(where)
        loaded = reopen(ptr)
        assert loaded._working_dir is None and loaded.size() == 60
        loaded.close()
        assert stored(tmp_path / "buffer") == (60, 1)
    assert (tmp_path / "notes" / "thesis.txt").read_text() == "keep"
    # this process's own working tier elsewhere: the pickle round trip keeps using it
    fast = tmp_path / "fast"
    buf = ZarrReplayBuffer(8, OBS["box"], ACTIONS["discrete"], "cpu", path=tmp_path / "b2",
                           working_dir=fast)
    buf.add(*random_step(OBS["box"], ACTIONS["discrete"], 1, np.random.default_rng(0)))
    again = pickle.loads(pickle.dumps(buf))
    assert again._working_dir == str(fast) and again.size() == 1
    again.close()


def test_save_replay_buffer_after_commit_callback_keeps_the_model_entry(tmp_path):
    """save_replay_buffer's commit used to drop CommitCallback's ``model`` entry and
    ``num_timesteps``: resume from it then needed zip_path. It carries them over when no step
    was added since, and leaves them out otherwise (the zip is not of these steps)."""
    model = dqn(tmp_path)
    model.learn(100, callback=CommitCallback(100, tmp_path / "ckpt"))
    model.save_replay_buffer(tmp_path / "replay.pkl")
    with ReplayBuffer.open(tmp_path / "buffer", mode="r") as rb:
        assert rb.commit == 2 and rb.metadata["num_timesteps"] == 100
        assert rb.metadata["model"]["zip"] == str((tmp_path / "ckpt" / "model_100.zip")
                                                  .resolve())
    resumed = resume(DQN, tmp_path / "buffer", device="cpu", env=gym.make("CartPole-v1"))
    assert (resumed.num_timesteps, resumed.replay_buffer.size()) == (100, 100)
    resumed.learn(10, reset_num_timesteps=False)
    resumed.save_replay_buffer(tmp_path / "replay.pkl")
    with ReplayBuffer.open(tmp_path / "buffer", mode="r") as rb:
        assert rb.commit == 3 and len(rb) > 100
        assert "model" not in rb.metadata and "num_timesteps" not in rb.metadata
    with pytest.raises(ValueError, match="names no model zip"):
        resume(DQN, tmp_path / "buffer", device="cpu")
    resumed.replay_buffer.close()


def test_commit_callback_replaces_a_model_entry_that_is_not_a_dict(tmp_path):
    """CommitCallback read the last commit's ``model`` entry with ``.get`` (AttributeError
    on a tampered entry); it now treats one that is not a dict as naming no zip."""
    import json

    model = dqn(tmp_path)
    model.learn(60, callback=CommitCallback(60, tmp_path / "ckpt"))
    model.replay_buffer.close()
    manifest = json.loads((tmp_path / "buffer" / "manifest.json").read_text())
    manifest["metadata"]["model"] = 5
    (tmp_path / "buffer" / "manifest.json").write_text(json.dumps(manifest))
    model.replay_buffer = ZarrReplayBuffer.open(tmp_path / "buffer", model.observation_space,
                                                model.action_space, "cpu")
    model.learn(60, callback=CommitCallback(60, tmp_path / "ckpt"), reset_num_timesteps=False)
    with ReplayBuffer.open(tmp_path / "buffer", mode="r") as rb:
        assert rb.metadata["model"]["zip"] == str((tmp_path / "ckpt" / "model_120.zip")
                                                  .resolve())
    model.replay_buffer.close()
