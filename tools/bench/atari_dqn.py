"""The child processes of ``tools/bench/bench_atari.py``: SB3's DQN on real Pong
(``PongNoFrameskip-v4``, SB3's ``AtariWrapper`` + ``VecFrameStack(4)`` + ``VecTransposeImage``,
SB3's DQN Atari recipe) with a :class:`~rlbuffers.integrations.sb3.ZarrReplayBuffer` or SB3's own
``ReplayBuffer``. Each mode reads its arguments as one JSON object and appends JSON lines
(events) to ``--log``, flushed at once, so a parent that ``kill -9``s the child still has
every event written before the kill.

    python -m tools.bench.atari_dqn MODE '{"...": ...}' --log events.jsonl

Modes:

- ``train``: fill ``buffer_size`` with SB3's own random-action loop (``learning_starts`` =
  the fill), then train, committing every ``commit_every`` steps (``CommitCallback``);
  ``draw_at``: draw the next batches after the commit of that step, save them, exit.
- ``resume``: :func:`~rlbuffers.integrations.sb3.resume` the last commit and finish the run
  (``draw``: draw the batches at once instead, save them, exit).
- ``sb3_fill``: DQN with SB3's ``ReplayBuffer`` (``optimize_memory_usage=True``) of
  ``buffer_size``, every row written, then a few gradient steps (what fits a memory cap).
- ``throughput``: both buffers at one capacity filled with the same transitions; DQN
  gradient steps/s with each, interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ENV_ID = "PongNoFrameskip-v4"
BATCHES = 5  # batches drawn for the resume check


class Events:
    """Appends one JSON line per event to a file, flushed and fsync'd (survives kill -9)."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "a")  # noqa: SIM115 (open for the process's life)
        self.t0 = time.perf_counter()

    def __call__(self, event: str, **data: Any) -> None:
        data.update(event=event, t=time.perf_counter() - self.t0)
        self.f.write(json.dumps(data) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def status_kb(key: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` value in kB (``RssAnon``, ``VmHWM`` ...); 0 if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def make_env(seed: int):
    """SB3's Atari DQN environment: ``make_atari_env`` (``AtariWrapper``: no-op reset, frame
    skip 4, 84x84 grayscale, episodic life, reward clipping) + ``VecFrameStack(4)`` +
    ``VecTransposeImage``: observations uint8 ``[1, 4, 84, 84]``."""
    import ale_py
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage

    gym.register_envs(ale_py)
    return VecTransposeImage(VecFrameStack(make_atari_env(ENV_ID, n_envs=1, seed=seed), 4))


def make_model(a: dict, buffer_kwargs: dict | None):
    """DQN with SB3's Atari hyperparameters (rl-zoo ``atari``), ``buffer_size`` and
    ``learning_starts`` from ``a``; ``buffer_kwargs`` None: SB3's ``ReplayBuffer``."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.logger import configure

    from rlbuffers.integrations.sb3 import ZarrReplayBuffer

    rb_kwargs: dict[str, Any] = {"handle_timeout_termination": False}
    extra: dict[str, Any] = {}
    if buffer_kwargs is not None:
        extra["replay_buffer_class"] = ZarrReplayBuffer
        rb_kwargs.update(buffer_kwargs)
    model = DQN("CnnPolicy", make_env(a["seed"]), seed=a["seed"], device="cpu",
               buffer_size=a["buffer_size"], learning_starts=a["learning_starts"],
               batch_size=32, learning_rate=1e-4, train_freq=4, gradient_steps=1,
               target_update_interval=1000, exploration_fraction=0.1,
               exploration_final_eps=0.01, optimize_memory_usage=True,
               replay_buffer_kwargs=rb_kwargs, **extra)
    model.set_logger(configure(None, []))  # model.train outside learn logs somewhere
    return model


def zarr_kwargs(a: dict) -> dict:
    """``replay_buffer_kwargs`` of the ZarrReplayBuffer (``frame_stack``: stacks stored one
    frame per transition, ``frame_stack_axis=0`` for ``VecTransposeImage``'s ``[4, 84, 84]``)."""
    kw: dict[str, Any] = {"path": a["path"]}  # no overwrite: DQN.load rebuilds it
    if a.get("frame_stack"):
        kw["frame_stack_axis"] = 0
    if a.get("chunk_transitions"):
        kw["chunk_transitions"] = a["chunk_transitions"]
    return kw


def instrument(model, log: Events, a: dict):
    """The callbacks: a ``CommitCallback`` whose commits are timed, and one that logs progress
    and times ``model.train`` (the wall time from a rollout's end, after the commit, to the
    next rollout's start; gradient steps from ``model._n_updates``)."""
    from stable_baselines3.common.callbacks import BaseCallback

    from rlbuffers.integrations.sb3 import CommitCallback

    stats = {"grad_steps": 0, "train_s": 0.0}

    class TimedCommit(CommitCallback):
        last = time.perf_counter()

        def _on_training_start(self) -> None:
            TimedCommit.last = time.perf_counter()

        def commit(self) -> None:
            t = time.perf_counter()
            super().commit()
            done = time.perf_counter()
            log("commit", step=int(self.model.num_timesteps), save_s=done - t,
                interval_s=done - TimedCommit.last, rss_anon_kb=status_kb("RssAnon"))
            TimedCommit.last = done

    class Progress(BaseCallback):
        ended: float | None = None
        updates = int(model._n_updates)

        def _on_step(self) -> bool:
            if self.model.num_timesteps % a["progress_every"] == 0:
                log("progress", step=int(self.model.num_timesteps), **stats,
                    rss_anon_kb=status_kb("RssAnon"))
            return True

        def _on_rollout_end(self) -> None:  # after TimedCommit's: the list's order
            self.ended = time.perf_counter()

        def _on_rollout_start(self) -> None:
            done = int(self.model._n_updates) - self.updates
            if self.ended is not None and done:
                stats["train_s"] += time.perf_counter() - self.ended
                stats["grad_steps"] += done
            self.updates = int(self.model._n_updates)

    commit = TimedCommit(a["commit_every"], Path(a["path"]).parent / "ckpt")
    return [commit, Progress()], stats


def draw(model) -> dict[str, np.ndarray]:
    """The next ``BATCHES`` batches of 32 and the policy's parameters (what a resumed run
    must reproduce)."""
    out = {f"param/{k}": v.numpy() for k, v in model.policy.state_dict().items()}
    for i in range(BATCHES):
        batch = model.replay_buffer.sample(32)
        for name in ("observations", "actions", "next_observations", "dones", "rewards"):
            out[f"batch{i}/{name}"] = getattr(batch, name).numpy()
    out["num_timesteps"] = np.array(model.num_timesteps)
    return out


def run_train(a: dict, log: Events) -> None:
    from stable_baselines3.common.callbacks import BaseCallback

    model = make_model(a, zarr_kwargs(a))
    callbacks, stats = instrument(model, log, a)
    draw_at = a.get("draw_at")

    class Draw(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:  # after the commit (the callbacks' order)
            if self.model.num_timesteps == draw_at:
                np.savez(a["draw_out"], **draw(self.model))
                log("drawn", step=draw_at)
                os._exit(0)

    if draw_at is not None:
        callbacks.append(Draw())
    model.learn(a["total"], callback=callbacks)
    log("done", step=int(model.num_timesteps), **stats, rss_anon_kb=status_kb("RssAnon"))


def run_resume(a: dict, log: Events) -> None:
    from stable_baselines3 import DQN

    from rlbuffers.integrations.sb3 import resume

    t = time.perf_counter()
    model = resume(DQN, a["path"], env=make_env(a["seed"] + 1), device="cpu")
    log("resumed", step=int(model.num_timesteps), resume_s=time.perf_counter() - t)
    if a.get("draw_out"):
        np.savez(a["draw_out"], **draw(model))
        log("drawn", step=int(model.num_timesteps))
        return
    callbacks, stats = instrument(model, log, a)
    callbacks[0]._committed_at = model.num_timesteps  # this step is committed already
    model.learn(a["total"] - model.num_timesteps, callback=callbacks, reset_num_timesteps=False)
    log("done", step=int(model.num_timesteps), **stats, rss_anon_kb=status_kb("RssAnon"))


def pong_steps(n: int, seed: int):
    """``n`` steps of random actions: yields (obs, next_obs, action, reward, done, infos) as
    SB3's ``collect_rollouts`` passes them to ``add`` (``next_obs`` of a done step is the
    terminal observation)."""
    env = make_env(seed)
    env.action_space.seed(seed)
    obs = env.reset()
    for _ in range(n):
        action = np.array([env.action_space.sample()])
        new_obs, reward, done, infos = env.step(action)
        nxt = new_obs.copy()
        if done[0] and infos[0].get("terminal_observation") is not None:
            nxt[0] = infos[0]["terminal_observation"]
        yield obs, nxt, action, reward, done, infos
        obs = new_obs
    env.close()


def run_sb3_fill(a: dict, log: Events) -> None:
    """Write every row of SB3's buffer (real Pong steps, the first ``distinct`` repeated),
    logging progress, then do a few gradient steps."""
    model = make_model(a, None)
    buf = model.replay_buffer
    steps = list(pong_steps(min(a["distinct"], a["buffer_size"]), a["seed"]))
    log("allocated", rss_anon_kb=status_kb("RssAnon"))
    for i in range(a["buffer_size"]):
        buf.add(*steps[i % len(steps)])
        if (i + 1) % 5000 == 0:
            log("progress", step=i + 1, rss_anon_kb=status_kb("RssAnon"))
    t = time.perf_counter()
    model.train(gradient_steps=a["grad_steps"], batch_size=32)
    log("done", step=a["buffer_size"], grad_per_s=a["grad_steps"] / (time.perf_counter() - t),
        rss_anon_kb=status_kb("RssAnon"))


def run_throughput(a: dict, log: Events) -> None:
    """SB3's buffer and ours, same capacity, same transitions; ``rounds`` interleaved rounds of
    ``grad_steps`` DQN updates each; medians of gradient steps/s."""
    from rlbuffers.integrations.sb3 import ZarrReplayBuffer

    model = make_model(a, None)
    theirs = model.replay_buffer
    ours = ZarrReplayBuffer(a["buffer_size"], model.observation_space, model.action_space,
                            device="cpu", optimize_memory_usage=True,
                            handle_timeout_termination=False, **zarr_kwargs(a))
    for step in pong_steps(a["buffer_size"], a["seed"]):
        theirs.add(*step)
        ours.add(*step)
    log("filled", step=a["buffer_size"], rss_anon_kb=status_kb("RssAnon"))
    rates: dict[str, list[float]] = {"sb3": [], "ours": []}
    for r in range(a["rounds"]):
        for name, buf in (("sb3", theirs), ("ours", ours))[:: 1 if r % 2 == 0 else -1]:
            model.replay_buffer = buf
            t = time.perf_counter()
            model.train(gradient_steps=a["grad_steps"], batch_size=32)
            rates[name].append(a["grad_steps"] / (time.perf_counter() - t))
    log("done", sb3=statistics.median(rates["sb3"]), ours=statistics.median(rates["ours"]),
        rounds=rates, rss_anon_kb=status_kb("RssAnon"))
    ours.close()


MODES = {"train": run_train, "resume": run_resume, "sb3_fill": run_sb3_fill,
         "throughput": run_throughput}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("args", help="the mode's arguments, one JSON object")
    ap.add_argument("--log", required=True, help="JSON-lines file the events are appended to")
    ns = ap.parse_args()
    import torch as th

    th.set_num_threads(1)
    log = Events(ns.log)
    try:
        MODES[ns.mode](json.loads(ns.args), log)
    except BaseException as e:
        log("error", error=repr(e))
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
