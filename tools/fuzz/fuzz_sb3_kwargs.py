"""Fuzz what the SB3 drop-in saves and reads back (issue 44, item 4): a DQN run committed
with ``CommitCallback`` (CartPole with :class:`ZarrReplayBuffer`, and a Dict-observation
environment with :class:`ZarrDictReplayBuffer`) leaves a model zip (its ``data`` JSON holds
``replay_buffer_kwargs``, ``buffer_size``, ``n_envs``, ``optimize_memory_usage``), a buffer
whose last commit's metadata holds ``"sb3"`` (the buffer's state, ``META_KEY``), ``"rng"``
(the RNG states), ``"model"`` and ``"num_timesteps"``, and the pointer that
``save_replay_buffer`` pickles. Each input is a plan that tampers with one of them:

- ``kwargs`` / ``data``: ``replay_buffer_kwargs`` values (``path`` or ``working_dir`` to
  another directory, a symlink, a dangling symlink, a FIFO, a file, a directory that is no
  buffer, the other buffer; ``overwrite=True``; unknown keys; wrong types and huge numbers)
  or the top-level ``buffer_size`` / ``n_envs`` / ``optimize_memory_usage`` /
  ``num_timesteps``; the zip is rewritten with that ``data``;
- ``zip``: the zip's bytes truncated or bit-flipped;
- ``meta``: the commit metadata (RNG states: wrong types, truncated key lists, missing keys,
  bad base64; the ``"sb3"`` state; the ``"model"`` entry), written into ``manifest.json``;
- ``pointer``: the pointer's fields (``path``, ``commit``, ``version``, ``class``, spaces,
  ``device``, ``working_dir``, ``write_batch``, missing keys) re-pickled as SB3 pickles it;
- ``pickle``: the pointer file's bytes truncated or bit-flipped.

Then it calls ``DQN.load(zip)`` and ``resume(DQN, buffer)`` (kwargs, data, zip, meta) or
``model.load_replay_buffer(pointer)`` (pointer, pickle), each under an alarm. Properties:

- no call runs past ``HANG_SECONDS`` (a FIFO never blocks a load);
- a call that fails leaves no buffer of the sandbox held by this process, and (``resume``,
  ``load_replay_buffer``; SB3's ``load`` reseeds them itself) the global RNG states as they
  were;
- every committed row of both buffers (rows, length, commit number) is unchanged afterwards,
  and so are the files planted where a path may point (a file, a FIFO, a directory holding
  ``precious.txt``) and the model zip;
- an error raised in rlbuffers' code is a documented type (an ``RLBuffersError``,
  ``ValueError``, ``TypeError``, ``KeyError`` or ``OSError``, not caused by ``MemoryError`` /
  ``RecursionError``) whose message names the tampered field (its key, a key of its path in
  the metadata, or the path it was set to). Errors raised inside SB3's own code (its zip
  reader, ``json_to_data``, ``pickle.load`` in ``load_from_pkl``) are counted as ``sb3``,
  not findings: that is SB3's surface. SB3 unpickles ``:serialized:`` entries of ``data``
  with cloudpickle and the pointer file with ``pickle.load``; this fuzzer never plants
  pickled code there (that is SB3's own pickle surface, not rlbuffers').

    python -m tools.fuzz.fuzz_sb3_kwargs --minutes 10

runs ``SEED_PLANS`` (hand-made plans that hold), ``KNOWN`` (the bugs found, which break a
property today) and then random plans in a worker process (a new one after a death or a
hang; the templates are built once, in ``--out``), and prints the inputs tried, the outcome
of each call by kind (``ok``, ``refused <Error>``, ``sb3 <Error>``, ``vague``, ``undocumented``,
``hang``), the data losses and planted files lost, and the findings grouped by kind and
place (each input saved as ``finding-<i>.json``). ``tests/test_fuzz.py::test_fuzz_sb3_kwargs``
runs a sample of ``SEED_PLANS``, every ``FIXED`` plan and every ``KNOWN`` plan.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import random
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from tools.fuzz.common import Finding, mutate_bytes, random_json

#: A call running longer than this (seconds) is a hang.
HANG_SECONDS = 20
#: Environment steps of the template run (committed every COMMIT_EVERY).
STEPS, COMMIT_EVERY = 120, 60
TARGETS = ("kwargs", "kwargs", "kwargs", "data", "zip", "meta", "meta", "meta", "pointer",
           "pointer", "pickle")
KWARG_KEYS = ("path", "path", "path", "working_dir", "overwrite", "chunk_transitions", "codec",
              "write_batch", "frame_stack_axis", "handle_timeout_termination", "bogus",
              "n_sampled_goal", "buffer_size", "n_envs", "optimize_memory_usage", "device")
DATA_KEYS = ("buffer_size", "n_envs", "optimize_memory_usage", "num_timesteps")
POINTER_KEYS = ("path", "path", "commit", "commit", "version", "class", "observation_space",
                "action_space", "device", "working_dir", "write_batch")
#: Places a path can be set to (resolved in the sandbox by :meth:`Fuzz._place`).
PLACES = ("@buffer", "@resume", "@new", "@link_buffer", "@link_new", "@dangling", "@fifo",
          "@file", "@notabuffer", "@ckpt", "@relative", "@link_loop", "@link_fifo", "@zip",
          "@empty", "@parent")
HUGE = [2**31, 2**32, 2**62, 2**63 - 1, 2**64, 10**30, -1, -(2**63), 0]
ODD = [None, True, False, "", "abc", "1", 1.5, -1.0, 1e308, [], {}, [1, 2], {"a": 1}, "\x00"]
DOCUMENTED = (ValueError, TypeError, KeyError, OSError)
#: Words an error about a field may use instead of its name (the capacity is made of
#: ``buffer_size`` and ``n_envs``; a pointer's class or spaces are checked against the fields).
ALIASES = {"class": ("space", "fields", "her"), "observation_space": ("space", "fields"),
           "action_space": ("space", "fields"), "buffer_size": ("capacity",),
           "n_envs": ("capacity",)}
#: Places that hold what is not the fuzzed code's to delete or replace (under ``places/``).
PLANTED = {"@notabuffer": ("notabuffer/precious.txt", "file"), "@file": ("file", "file"),
           "@fifo": ("fifo", "fifo"), "@link_fifo": ("fifo_target", "fifo")}


class Hang(Exception):
    """A call ran past ``HANG_SECONDS``."""


# -- the template run ------------------------------------------------------------------------
def dict_env() -> Any:
    """A small environment with Dict observations (``pos`` float32 [2], ``tick`` uint8 [1])
    and two actions; episodes of 25 steps ending in a truncation."""
    import gymnasium as gym
    import numpy as np
    from gymnasium import spaces

    class DictWalk(gym.Env):
        observation_space = spaces.Dict({
            "pos": spaces.Box(-10.0, 10.0, (2,), np.float32),
            "tick": spaces.Box(0, 255, (1,), np.uint8)})
        action_space = spaces.Discrete(2)

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self.t, self.x = 0, np.zeros(2, np.float32)
            return self._obs(), {}

        def _obs(self) -> dict[str, Any]:
            return {"pos": self.x.copy(), "tick": np.array([self.t], np.uint8)}

        def step(self, action: Any) -> Any:
            self.t += 1
            self.x += np.float32(0.1 if int(action) else -0.1) + self.np_random.normal(
                0, 0.05, 2).astype(np.float32)
            self.x = np.clip(self.x, -10, 10)
            return self._obs(), float(-abs(self.x).sum()), False, self.t >= 25, {}

    return DictWalk()


def build_template(root: Path, case: str) -> None:
    """In ``root``: ``buffer_resume/`` (the buffer after ``CommitCallback``'s last commit: its
    metadata names ``ckpt/model_<STEPS>.zip``), ``buffer/`` (the same buffer after
    ``save_replay_buffer`` committed it once more), ``replay.pkl`` (the pointer to that
    commit), ``ckpt/model_<STEPS>.zip`` (whose ``replay_buffer_kwargs`` name ``buffer/``)."""
    import torch as th
    from stable_baselines3 import DQN

    from rlbuffers.integrations.sb3 import (
        CommitCallback,
        ZarrDictReplayBuffer,
        ZarrReplayBuffer,
    )

    th.set_num_threads(1)
    root.mkdir(parents=True, exist_ok=True)
    cls = ZarrReplayBuffer if case == "box" else ZarrDictReplayBuffer
    env = "CartPole-v1" if case == "box" else dict_env()
    model = DQN("MlpPolicy" if case == "box" else "MultiInputPolicy", env, buffer_size=500,
                learning_starts=50, seed=0, device="cpu", policy_kwargs={"net_arch": [16]},
                replay_buffer_class=cls,
                replay_buffer_kwargs={"path": str(root / "buffer"), "overwrite": True})
    model.learn(STEPS, callback=CommitCallback(COMMIT_EVERY, root / "ckpt"))
    trained: Any = model.replay_buffer
    trained.close()
    shutil.copytree(root / "buffer", root / "buffer_resume")
    buf = cls.open(root / "buffer", model.observation_space, model.action_space, "cpu")
    model.replay_buffer = buf
    model.save_replay_buffer(root / "replay.pkl")
    buf.close()


def digest(path: Path) -> tuple[int, int, str]:
    """(commit, length, sha256 of every committed row) of the buffer at ``path``."""
    import numpy as np

    from rlbuffers import ReplayBuffer

    with ReplayBuffer.open(path, mode="r") as rb:
        h = hashlib.sha256()
        rows = rb[:] if len(rb) else {}
        for name in sorted(rows):
            h.update(name.encode())
            h.update(np.ascontiguousarray(rows[name]).tobytes())
        return int(rb.commit), len(rb), h.hexdigest()


# -- pointer pickles --------------------------------------------------------------------------
class _Pointer:
    """Pickles as SB3's ``save_replay_buffer`` pickles a buffer: ``reopen(ptr)``."""

    def __init__(self, ptr: dict[str, Any]) -> None:
        self.ptr = ptr

    def __reduce__(self) -> tuple[Any, ...]:
        from rlbuffers.integrations.sb3.pointer import reopen

        return reopen, (self.ptr,)


#: module prefixes a pointer pickle may name besides ``reopen``: its buffer class, its spaces
#: and their arrays
_POINTER_MODULES = ("rlbuffers.integrations.sb3.buffer", "rlbuffers.integrations.sb3.her",
                    "gymnasium.spaces", "numpy", "builtins", "collections")


def read_pointer(data: bytes) -> dict[str, Any]:
    """The dict a pointer pickle passes to ``reopen``, without calling it."""
    class Reader(pickle.Unpickler):
        """Resolves only ``reopen`` (to the identity), gymnasium's spaces and numpy's array
        and dtype reconstructors: what a pointer holds; anything else is refused."""

        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("rlbuffers.integrations.sb3.pointer", "reopen"):
                return lambda ptr: ptr
            if module.startswith(_POINTER_MODULES):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"pointer pickle: {module}.{name} is not allowed")

    return Reader(io.BytesIO(data)).load()


# -- plans -----------------------------------------------------------------------------------
def _value(rng: random.Random, key: str) -> Any:
    """A tampered value for ``key``."""
    r = rng.random()
    if key in ("path", "working_dir", "zip") and r < 0.7:
        return rng.choice(PLACES)
    if r < 0.35:
        return rng.choice(HUGE)
    if r < 0.75:
        return rng.choice(ODD)
    v = random_json(rng)
    return None if isinstance(v, float) and v != v else v


def _meta_paths(x: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Key paths into the metadata (list elements of long lists: a few only)."""
    out = [prefix] if prefix else []
    if isinstance(x, dict):
        for k, v in x.items():
            out += _meta_paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i in (range(len(x)) if len(x) <= 4 else (0, len(x) - 1)):
            out += _meta_paths(x[i], (*prefix, i))
    return out


#: How a plan picks the edits of each target: (operations, keys), keys None: metadata paths.
EDITS = {"kwargs": (("set", "set", "set", "del"), KWARG_KEYS), "data": (("set",), DATA_KEYS),
         "meta": (("set", "set", "del", "cut", "add"), None),
         "pointer": (("set", "set", "set", "del"), POINTER_KEYS)}
#: Values for keys that take one of a few names: (key, values, how often).
CHOICES = {"class": (("ZarrReplayBuffer", "ZarrDictReplayBuffer", "ZarrHerReplayBuffer",
                      "ReplayBuffer"), 1.0),
           "observation_space": (("box", "dict", "discrete3"), 1.0),
           "action_space": (("box", "dict", "discrete3"), 1.0),
           "torch": (("!!notbase64", "AAAA", "", "QUJD" * 3), 0.5),
           "commit": ((-1, 0, 1, 2, 4, 2**63), 0.6)}


def make_plan(rng: random.Random, metadata: dict[str, Any]) -> dict[str, Any]:
    """A random plan (JSON): the case, the target and its edits."""
    target = rng.choice(TARGETS)
    plan: dict[str, Any] = {"case": rng.choice(("box", "box", "dict")), "target": target,
                            "seed": rng.randrange(2**32)}
    if target not in EDITS:
        return plan
    ops, keys = EDITS[target]
    paths = [list(p) for p in _meta_paths(metadata)] if keys is None else list(keys)
    plan["edits"] = [[rng.choice(ops), rng.choice(paths), None]
                     for _ in range(rng.choice((1, 1, 1, 2, 3)))]
    if target == "kwargs" and rng.random() < 0.05:
        plan["edits"] = [["replace", "replay_buffer_kwargs", None]]
    for edit in plan["edits"]:
        key = edit[1] if isinstance(edit[1], str) else str(edit[1][-1])
        values, p = CHOICES.get(key, ((), 0.0))
        if edit[0] == "set" and values and (key != "class" or target == "pointer") \
                and rng.random() < p:
            edit[2] = rng.choice(values)
        elif edit[0] in ("set", "add", "replace"):
            edit[2] = _value(rng, key)
    return plan


def _plan(target: str, *edits: tuple[str, Any, Any], case: str = "box",
          seed: int = 0) -> dict[str, Any]:
    return {"case": case, "target": target, "seed": seed, "edits": [list(e) for e in edits]}


#: The bugs this fuzzer found and that are fixed (plan, what it broke): part of SEED_PLANS,
#: every one run by the test suite.
FIXED = [
    (_plan("meta", ("set", ["model", "zip"], "@fifo")),
     "hang: resume opened the zip the commit names, a FIFO, and blocked"),
    (_plan("pointer", ("set", "working_dir", "@buffer")),
     "data loss: load_replay_buffer passed the pointer's working_dir (the buffer) on"),
    (_plan("meta", ("cut", ["rng", "python", "internal"], None)),
     "restore_rng: ValueError naming no field"),
    (_plan("meta", ("set", ["rng", "numpy", "keys", 0], 10**30)),
     "restore_rng: OverflowError"),
    (_plan("meta", ("set", ["rng", "torch"], "QUJD")), "restore_rng: torch's RuntimeError"),
    (_plan("meta", ("set", ["model", "action_space_rng", "state"], True)),
     "resume: TypeError naming no field, after the RNGs were set"),
    (_plan("meta", ("set", ["model"], None)), "resume: AttributeError"),
    (_plan("meta", ("set", ["sb3", "buffer_size"], None)),
     "open: TypeError naming no field"),
    (_plan("meta", ("set", ["sb3", "pos"], None)), "open: TypeError after hold()"),
    (_plan("kwargs", ("set", "codec", 7)), "create: AttributeError"),
    (_plan("data", ("set", "n_envs", 0)), "ZeroDivisionError"),
    (_plan("kwargs", ("set", "working_dir", 299)), "os.fspath's TypeError naming no field"),
    (_plan("kwargs", ("set", "write_batch", [])), "int()'s TypeError naming no field"),
    (_plan("pointer", ("set", "class", "ReplayBuffer")),
     "reopen: ReplayBuffer.open's TypeError naming no field"),
    (_plan("kwargs", ("set", "path", "@new"), ("set", "working_dir", "@parent")),
     "data loss: DQN.load of a zip whose working_dir is the buffer's parent deleted the "
     "committed buffer (rlbuffers/storage/working.py)"),
    (_plan("kwargs", ("set", "path", "@new"), ("set", "working_dir", "@notabuffer")),
     "a working_dir holding other files was emptied (rlbuffers/storage/working.py)"),
]

#: Plans that hold the properties (each tried first by the runner; a sample by the test suite).
SEED_PLANS = [
    *(_plan("kwargs", ("set", "path", place)) for place in PLACES if place != "@parent"),
    _plan("kwargs", ("set", "path", "@fifo"), case="dict"),
    _plan("kwargs", ("set", "overwrite", True)),
    _plan("kwargs", ("set", "path", "@link_buffer"), ("set", "overwrite", True)),
    _plan("kwargs", ("set", "path", "@resume"), ("set", "overwrite", True), case="dict"),
    _plan("kwargs", ("set", "path", "@new"), ("set", "working_dir", "@new")),
    _plan("kwargs", ("set", "path", "@new"), ("set", "working_dir", "@empty")),
    _plan("kwargs", ("set", "bogus", 1)),
    _plan("kwargs", ("set", "n_sampled_goal", 4), case="dict"),
    _plan("kwargs", ("set", "write_batch", 0)),
    _plan("kwargs", ("set", "frame_stack_axis", 7)),
    _plan("kwargs", ("set", "path", None)),
    _plan("kwargs", ("del", "path", None)),
    _plan("kwargs", ("replace", "replay_buffer_kwargs", [1, 2])),
    _plan("data", ("set", "buffer_size", 2**40)),
    _plan("data", ("set", "buffer_size", 2**63)),
    _plan("data", ("set", "n_envs", 2**40)),
    _plan("data", ("set", "optimize_memory_usage", True)),
    _plan("data", ("set", "optimize_memory_usage", True), case="dict"),
    _plan("data", ("set", "num_timesteps", 7)),
    _plan("zip", seed=1),
    _plan("zip", seed=2, case="dict"),
    _plan("meta", ("del", ["rng", "torch"], None)),
    _plan("meta", ("del", ["sb3"], None)),
    _plan("meta", ("set", ["num_timesteps"], 5), case="dict"),
    _plan("meta", ("set", ["model", "zip"], "@dangling")),
    _plan("meta", ("del", ["model", "zip"], None)),
    _plan("pointer", ("set", "path", "@fifo")),
    _plan("pointer", ("set", "path", "@link_buffer")),
    _plan("pointer", ("set", "path", "@resume"), case="dict"),
    _plan("pointer", ("set", "path", "@notabuffer")),
    _plan("pointer", ("set", "commit", 2)),
    _plan("pointer", ("set", "version", 2)),
    _plan("pointer", ("del", "path", None)),
    _plan("pointer", ("set", "working_dir", "@new")),
    _plan("pickle", seed=3),
    *(plan for plan, _ in FIXED),
]

#: Plans that break a property today (the bugs this fuzzer found; the test suite checks that
#: each still does: once fixed, move it to FIXED): plan, what breaks, where. None today.
KNOWN: list[tuple[dict[str, Any], str, str]] = []


# -- the fuzzer ------------------------------------------------------------------------------
def _owner(exn: BaseException) -> str:
    """``"rlbuffers"`` or ``"sb3"``: whose code raised ``exn`` (the innermost frame of
    either in the traceback); ``"other"`` if neither."""
    owner = "other"
    for frame in traceback.extract_tb(exn.__traceback__):
        f = frame.filename.replace(os.sep, "/")
        if "/rlbuffers/" in f:
            owner = "rlbuffers"
        elif "/stable_baselines3/" in f:
            owner = "sb3"
    return owner


def _where(exn: BaseException) -> str:
    tb = traceback.extract_tb(exn.__traceback__)
    for frame in reversed(tb):
        if "/rlbuffers/" in frame.filename.replace(os.sep, "/"):
            return f"{frame.filename.split('/rlbuffers/')[-1]}:{frame.lineno}"
    return f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"


def _rng_states() -> tuple[bytes, ...]:
    """The numpy global, Python and torch CPU RNG states, comparable."""
    import numpy as np
    import torch as th

    return (pickle.dumps(np.random.get_state()), pickle.dumps(random.getstate()),
            th.get_rng_state().numpy().tobytes())


def _fifo_link(link: Path, fifo: Path) -> None:
    os.mkfifo(fifo)
    link.symlink_to(fifo)


def _precious(d: Path) -> None:
    d.mkdir()
    (d / "precious.txt").write_text("keep me")


class Fuzz:
    """``Fuzz(workdir)``: the templates (one per case) built in ``workdir``;
    ``generate(rng) -> bytes`` (a plan as JSON); ``check(data) -> dict`` (the outcome of each
    call), raising :class:`Finding` when a property breaks."""

    def __init__(self, workdir: Path) -> None:
        from stable_baselines3 import DQN

        self.work = Path(workdir).resolve()
        self.live, self.ref = self.work / "live", self.work / "ref"
        self.cwd = self._mkdir(self.work / "cwd")  # check() runs there: relative paths too
        self.meta: dict[str, dict[str, Any]] = {}
        self.digests: dict[str, dict[str, tuple[int, int, str]]] = {}
        self.base: dict[str, Any] = {}
        self.spaces: dict[str, Any] = {}
        for case in ("box", "dict"):
            if not (self.ref / case / "replay.pkl").exists():
                shutil.rmtree(self.live / case, ignore_errors=True)
                build_template(self.live / case, case)
                shutil.rmtree(self.ref / case, ignore_errors=True)
                shutil.copytree(self.live / case, self.ref / case, symlinks=True)
            self.meta[case] = json.loads(
                (self.ref / case / "buffer_resume" / "manifest.json").read_text())["metadata"]
            self.digests[case] = {b: digest(self.ref / case / b) for b in
                                  ("buffer", "buffer_resume")}
            self._restore(case)
            base = DQN.load(self._zip(self.live / case), device="cpu")
            base.replay_buffer = None
            self.base[case] = base
            self.spaces[case] = base.observation_space
        self.spaces["discrete3"] = __import__("gymnasium").spaces.Discrete(3)
        self.counts: Counter[str] = Counter()

    @staticmethod
    def _mkdir(p: Path) -> Path:
        p.mkdir(parents=True, exist_ok=True)
        return p

    @staticmethod
    def _zip(root: Path) -> Path:
        return root / "ckpt" / f"model_{STEPS}.zip"

    def _restore(self, case: str) -> Path:
        root = self.live / case
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(self.ref / case, root, symlinks=True)
        return root

    def _place(self, root: Path, token: Any) -> Any:
        """The path a ``@`` token stands for, made in the sandbox ``root``."""
        if not (isinstance(token, str) and token.startswith("@")):
            return token
        name = token[1:]
        fixed = {"buffer": root / "buffer", "resume": root / "buffer_resume",
                 "ckpt": root / "ckpt", "zip": self._zip(root), "parent": root,
                 "relative": "rel/buf"}
        if name in fixed:
            return str(fixed[name])
        places = root / "places"
        places.mkdir(exist_ok=True)
        p = places / name
        make = {
            "link_buffer": lambda: p.symlink_to(root / "buffer"),
            "link_new": lambda: p.symlink_to(places / "new_target"),
            "dangling": lambda: p.symlink_to(places / "nowhere" / "x"),
            "fifo": lambda: os.mkfifo(p),
            "link_fifo": lambda: _fifo_link(p, places / "fifo_target"),
            "file": lambda: p.write_bytes(b"not a buffer\n"),
            "notabuffer": lambda: _precious(p),
            "empty": p.mkdir,
            "link_loop": lambda: p.symlink_to(p),
        }
        if name in make and not os.path.lexists(p):  # a plan may name a place twice
            make[name]()
        return str(p)

    # -- generate ----------------------------------------------------------------------------
    def generate(self, rng: random.Random) -> bytes:
        return json.dumps(make_plan(rng, self.meta["box"] if rng.random() < 0.7
                                    else self.meta["dict"])).encode()

    # -- check -------------------------------------------------------------------------------
    def check(self, data: bytes) -> dict[str, str]:
        """Apply the plan ``data``, run the calls, check the properties; returns
        ``{call: outcome kind}`` (also added to ``self.counts``)."""
        back = os.getcwd()
        os.chdir(self.cwd)
        try:
            return self._check(json.loads(data))
        finally:
            os.chdir(back)

    def _check(self, plan: dict[str, Any]) -> dict[str, str]:
        case, target = plan["case"], plan["target"]
        root = self._restore(case)
        rng = random.Random(plan["seed"])
        tokens = self._tamper(root, plan, rng)
        tokens += [a for t in tokens for a in ALIASES.get(t, ())]
        planted = self._planted(root)
        outcomes: dict[str, str] = {}
        problems: list[str] = []
        if target in ("kwargs", "data", "zip", "meta"):
            calls = [("resume", lambda: self._resume(root))]
            if target != "meta":
                calls.insert(0, ("DQN.load", lambda: self._load(root)))
        else:
            calls = [("load_replay_buffer", lambda: self._load_replay_buffer(root, case))]
        for name, call in calls:
            outcomes[name] = self._call(root, name, call, tokens, problems)
        self._release(root)
        if self._planted(root) != planted:
            self.counts["planted file lost"] += 1
            problems.append(f"a file the calls do not own was deleted or replaced: "
                            f"{planted} -> {self._planted(root)}")
        for b in ("buffer", "buffer_resume"):
            try:
                now = digest(root / b)
            except Exception as e:  # noqa: BLE001 - any failure to read back is the finding
                now = (-1, -1, f"{type(e).__name__}: {e}")
            if now != self.digests[case][b]:
                self.counts["data loss"] += 1
                problems.append(f"data loss in {b}: {self.digests[case][b][:2]} -> {now}")
        if problems:
            raise Finding(f"{json.dumps(plan)[:600]}: " + "; ".join(problems))
        return outcomes

    def _tamper(self, root: Path, plan: dict[str, Any], rng: random.Random) -> list[str]:
        """Apply ``plan`` in ``root``; the words an error about it may name."""
        target, edits = plan["target"], plan.get("edits", [])
        if target == "zip":
            zp = self._zip(root)
            zp.write_bytes(mutate_bytes(zp.read_bytes(), rng))
            return []
        if target == "pickle":
            pp = root / "replay.pkl"
            pp.write_bytes(mutate_bytes(pp.read_bytes(), rng))
            return ["pointer", *POINTER_KEYS]   # whichever field the flipped bytes hit
        return {"kwargs": self._tamper_zip, "data": self._tamper_zip,
                "meta": self._tamper_meta, "pointer": self._tamper_pointer}[target](
                    root, target, edits, rng)

    def _tamper_zip(self, root: Path, target: str, edits: list[Any],
                    rng: random.Random) -> list[str]:
        """``replay_buffer_kwargs`` (kwargs) or top-level keys (data) of the zip's ``data``."""
        zp = self._zip(root)
        with zipfile.ZipFile(zp) as z:
            entries = {i.filename: z.read(i) for i in z.infolist()}
        d = json.loads(entries["data"])
        tokens: list[str] = []
        for op, key, value in edits:
            value = self._place(root, value)
            tokens += [key, *([value] if isinstance(value, str) and value else [])]
            where = d if target == "data" else d.get("replay_buffer_kwargs")
            if op == "replace":
                d["replay_buffer_kwargs"] = value
            elif isinstance(where, dict) and op == "del":
                where.pop(key, None)
            elif isinstance(where, dict):
                where[key] = value
        entries["data"] = json.dumps(d).encode()
        with zipfile.ZipFile(zp, "w", zipfile.ZIP_DEFLATED) as z:
            for name, content in entries.items():
                z.writestr(name, content)
        return tokens

    def _tamper_meta(self, root: Path, target: str, edits: list[Any],
                     rng: random.Random) -> list[str]:
        """The last commit's metadata of ``buffer_resume`` (in its ``manifest.json``)."""
        mp = root / "buffer_resume" / "manifest.json"
        manifest = json.loads(mp.read_text())
        tokens: list[str] = []
        for op, path, value in edits:
            tokens += [str(k) for k in path if isinstance(k, str)]
            value = self._place(root, value)
            parent = manifest["metadata"]
            try:
                for k in path[:-1]:
                    parent = parent[k]
                old = parent[path[-1]]
            except (KeyError, IndexError, TypeError):
                continue
            if not isinstance(parent, (dict, list)):
                continue
            if op == "del":
                del parent[path[-1]]
            elif op == "cut" and isinstance(old, (list, str)) and old:
                parent[path[-1]] = old[:rng.randrange(len(old))]
            elif op == "add" and isinstance(old, dict):
                old["bogus"] = value
            elif op != "add":
                parent[path[-1]] = value
        mp.write_text(json.dumps(manifest))
        return tokens

    def _tamper_pointer(self, root: Path, target: str, edits: list[Any],
                        rng: random.Random) -> list[str]:
        """The fields of the pointer that ``save_replay_buffer`` pickled, pickled again."""
        pp = root / "replay.pkl"
        ptr = read_pointer(pp.read_bytes())
        tokens = ["pointer"]
        for op, key, value in edits:
            tokens.append(key)
            if op == "del":
                ptr.pop(key, None)
                continue
            if key == "class":
                value = self._class(value)
            elif key in ("observation_space", "action_space"):
                value = self.spaces[value]
            else:
                value = self._place(root, value)
                tokens += [value] if isinstance(value, str) and value else []
            ptr[key] = value
        pp.write_bytes(pickle.dumps(_Pointer(ptr)))
        return tokens

    @staticmethod
    def _planted(root: Path) -> dict[str, str]:
        """Kind and content of the planted files and of the model zip."""
        out = {}
        for rel in [*(f"places/{r}" for r, _ in PLANTED.values()), f"ckpt/model_{STEPS}.zip"]:
            p = root / rel
            if not os.path.lexists(p) and rel.startswith("places/"):
                continue
            try:
                st = os.lstat(p)
                out[rel] = ("fifo" if stat.S_ISFIFO(st.st_mode) else
                            hashlib.sha256(p.read_bytes()).hexdigest()
                            if stat.S_ISREG(st.st_mode) else f"mode {st.st_mode:o}")
            except OSError as e:
                out[rel] = f"{type(e).__name__}"
        return out

    @staticmethod
    def _class(name: str) -> Any:
        from rlbuffers import ReplayBuffer
        from rlbuffers.integrations import sb3

        return ReplayBuffer if name == "ReplayBuffer" else getattr(sb3, name)

    # -- the calls ---------------------------------------------------------------------------
    def _load(self, root: Path) -> None:
        from stable_baselines3 import DQN

        model = DQN.load(self._zip(root), device="cpu")
        buf: Any = model.replay_buffer
        if buf is not None and getattr(buf, "_rb", None) is not None:
            buf.close()  # it made a new buffer (at another path): fine, in the sandbox

    def _resume(self, root: Path) -> None:
        from stable_baselines3 import DQN

        from rlbuffers.integrations.sb3 import resume

        model: Any = resume(DQN, root / "buffer_resume", device="cpu")
        model.replay_buffer.close()

    def _load_replay_buffer(self, root: Path, case: str) -> None:
        base = self.base[case]
        try:
            base.load_replay_buffer(root / "replay.pkl")
        finally:
            buf, base.replay_buffer = base.replay_buffer, None
            if buf is not None and hasattr(buf, "close"):
                buf.close()

    def _call(self, root: Path, name: str, call: Any, tokens: list[str],
              problems: list[str]) -> str:
        """Run one call; its outcome kind (problems appended to ``problems``)."""
        rngs = _rng_states()
        kind, what = self._run(call, tokens)
        self.counts[f"{name}: {kind}"] += 1
        if what:
            problems.append(f"{name}: {what}")
        if kind != "ok" and self._held(root):
            self.counts["held after a failure"] += 1
            problems.append(f"{name}: failed ({kind}) and left {self._held(root)} held")
        # SB3's own load reseeds the RNGs before it builds the buffer: resume's and
        # load_replay_buffer's failures must leave them as they were
        if kind != "ok" and name != "DQN.load" and _rng_states() != rngs:
            self.counts["RNG changed by a failure"] += 1
            problems.append(f"{name}: failed ({kind}) and changed the global RNG states")
        return kind

    @staticmethod
    def _held(root: Path) -> list[str]:
        """Buffers of the sandbox that an instance of this process holds open."""
        from rlbuffers.integrations.sb3 import pointer as sb3_pointer

        return [k for k, v in list(sb3_pointer._HOLDERS.items()) if k.startswith(str(root))
                and not getattr(getattr(v, "_rb", None), "_closed", True)]

    def _release(self, root: Path) -> None:
        """Close what a failed call left holding a buffer of the sandbox."""
        from rlbuffers.integrations.sb3 import pointer as sb3_pointer

        for key in list(sb3_pointer._HOLDERS.keys()):
            if key.startswith(str(root)):
                sb3_pointer.release(key, "the fuzzer restored the sandbox")

    def _run(self, call: Any, tokens: list[str]) -> tuple[str, str | None]:
        """Run ``call`` under the alarm: (outcome kind, what broke a property or None)."""
        def ring(signum: int, frame: Any) -> None:
            raise Hang(f"no result after {HANG_SECONDS} s")

        old = signal.signal(signal.SIGALRM, ring)
        signal.alarm(HANG_SECONDS)
        try:
            call()
            return "ok", None
        except Hang as e:
            return "hang", str(e)
        except Finding:
            raise
        except Exception as exn:  # noqa: BLE001 - the property is about what escapes
            return self._judge(exn, tokens)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)

    @staticmethod
    def _judge(exn: BaseException, tokens: list[str]) -> tuple[str, str | None]:
        owner = _owner(exn)
        name = type(exn).__name__
        if owner != "rlbuffers":
            return f"sb3 {name}", None
        cur: BaseException | None = exn
        while cur is not None:
            if isinstance(cur, (MemoryError, RecursionError)):
                return "undocumented", f"{name} caused by {type(cur).__name__} at {_where(exn)}"
            cur = cur.__cause__ or cur.__context__
        msg = str(exn)
        if not isinstance(exn, DOCUMENTED):
            return "undocumented", f"{name} at {_where(exn)}: {msg[:300]}"
        named = isinstance(exn, KeyError) or any(t.lower() in msg.lower() for t in tokens if t)
        if not named:
            return "vague", f"{name} at {_where(exn)} names none of {tokens[:6]}: {msg[:300]}"
        return f"refused {name}", None


# -- the runner ------------------------------------------------------------------------------
def _worker(start: int, seed: int, workdir: str, address_space: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    fuzz = Fuzz(Path(workdir))
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    i = start
    while True:
        fixed = [*SEED_PLANS, *(plan for plan, _, _ in KNOWN)]
        data = (json.dumps(fixed[i]).encode() if i < len(fixed) else
                fuzz.generate(random.Random(seed * 1_000_003 + i)))
        Path(workdir, "current.json").write_bytes(data)
        before = dict(fuzz.counts)
        try:
            fuzz.check(data)
            what = None
        except Finding as f:
            what = str(f)
        delta = {k: v - before.get(k, 0) for k, v in fuzz.counts.items()
                 if v != before.get(k, 0)}
        out.write(json.dumps({"i": i, "counts": delta, "finding": what,
                              "plan": data.decode() if what else None}) + "\n")
        out.flush()
        i += 1


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.fuzz.fuzz_sb3_kwargs [--minutes M] [--seed S] [--out DIR]``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker(int(argv[1]), int(argv[2]), argv[3], int(argv[4]))
        return 0
    p = argparse.ArgumentParser(prog="python -m tools.fuzz.fuzz_sb3_kwargs",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address-space", type=int, default=8 * 2**30,
                   help="RLIMIT_AS of the worker in bytes (default 8 GiB)")
    p.add_argument("--out", default=None, help="where findings go (default: a temp dir)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="rlbuffers-fuzz-sb3-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "work").mkdir(exist_ok=True)  # the templates are kept across workers
    deadline = time.monotonic() + 60 * args.minutes
    run: dict[str, Any] = {"tried": 0, "next": 0, "counts": Counter(), "findings": []}
    while time.monotonic() < deadline:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.fuzz.fuzz_sb3_kwargs", "--worker", str(run["next"]),
             str(args.seed), str(out / "work"), str(args.address_space)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                 "RAYON_NUM_THREADS": "1"})
        cause = _follow(proc, deadline, out, run)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if cause is not None:
            current = out / "work" / "current.json"
            saved = out / f"finding-{run['next']}.json"
            if current.exists():
                shutil.copy(current, saved)
            run["findings"].append(f"{cause} ({saved})")
            run["tried"] += 1
            run["next"] += 1
    _report(run, args.minutes, out)
    return 1 if run["findings"] else 0


def _follow(proc: subprocess.Popen[str], deadline: float, out: Path,
            run: dict[str, Any]) -> str | None:
    """Read one worker's reports into ``run`` until the deadline; None, or why it stopped."""
    assert proc.stdout is not None
    started = False
    while time.monotonic() < deadline:
        wait = 3 * HANG_SECONDS + (0 if started else 240)  # the first: building templates
        ready, _, _ = select.select([proc.stdout], [], [], wait)
        if not ready:
            run["counts"]["hang (worker)"] += 1
            return f"no progress for {wait} s (hang) at input {run['next']}"
        line = proc.stdout.readline()
        if not line:
            run["counts"]["worker died"] += 1
            return f"worker died (status {proc.wait()}) at input {run['next']}"
        if line.strip() == "ready":
            started = True
            continue
        rec = json.loads(line)
        run["tried"] += 1
        run["next"] = rec["i"] + 1
        run["counts"].update(rec["counts"])
        if rec["finding"]:
            run["findings"].append(f"input {rec['i']}: {rec['finding']}")
            (out / f"finding-{rec['i']}.json").write_text(rec["plan"])
    return None


def _report(run: dict[str, Any], minutes: float, out: Path) -> None:
    """Print the inputs tried, the outcomes by kind and the findings grouped by place."""
    counts = run["counts"]
    hangs = sum(v for k, v in counts.items() if "hang" in k)
    print(f"tools.fuzz.fuzz_sb3_kwargs: {run['tried']:,} inputs tried in {minutes:g} min, "
          f"{len(run['findings'])} findings, {hangs} hangs, {counts['data loss']} data "
          f"losses, {counts['planted file lost']} planted files lost")
    print("outcomes by call and kind:")
    for k in sorted(counts):
        print(f"  {k}: {counts[k]:,}")
    groups: dict[str, list[str]] = {}
    for f in run["findings"]:
        for sig in signatures(f):
            groups.setdefault(sig, []).append(f)
    print(f"findings by kind and place ({len(groups)}; each input in {out}/finding-*.json):")
    for sig, fs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(fs):5d} x {sig}\n          e.g. {fs[0][:400]}")


def signatures(finding: str) -> list[str]:
    """What a finding breaks and where: ``"<call>: <kind> <Error> at <file:line>"``, ``"data
    loss in <buffer>"``, ``"planted file lost"``, or a hang."""
    out = []
    for m in re.finditer(r"(DQN\.load|resume|load_replay_buffer): (\w+) at ([\w/.]+:\d+)"
                         r"( names none)?", finding):
        out.append(f"{m[1]}: {'vague' if m[4] else 'undocumented'} {m[2]} at {m[3]}")
    out += [f"data loss in {m[1]}" for m in re.finditer(r"data loss in (\w+)", finding)]
    if "do not own was deleted" in finding:
        out.append("planted file lost")
    if "hang" in finding or "no result after" in finding:
        out.append("hang")
    if "worker died" in finding:
        out.append("worker died")
    return out or [finding[:120]]


if __name__ == "__main__":
    raise SystemExit(main())
