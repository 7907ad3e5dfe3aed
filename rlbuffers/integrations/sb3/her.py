"""Hindsight Experience Replay with the transitions on disk: :class:`ZarrHerReplayBuffer`.

HER (Andrychowicz et al. 2017, "Hindsight Experience Replay", NeurIPS; section 3.4 for the
algorithm, section 4.5 for the goal selection strategies ``future``, ``final``, ``episode``)
replays a transition with the desired goal replaced by a goal achieved later in its episode,
and the reward recomputed by the environment's ``compute_reward``. This module gives SB3's
``HerReplayBuffer`` semantics (same arguments, same episode bookkeeping, same calls of
``np.random`` in the same order, so the same global RNG state samples the same batches) over
a :class:`~rlbuffers.integrations.sb3.ZarrDictReplayBuffer`: the observations, actions,
rewards and episode starts are on disk; RAM holds two int64 ``[buffer_size, n_envs]`` arrays
(each transition's episode start and, once the episode ended, its length: 16 bytes per
transition), rebuilt by :meth:`ZarrHerReplayBuffer.open` from the stored ``ep_start``,
``terminated`` and ``truncated`` columns.

SAC/TD3/DQN: ``replay_buffer_class=ZarrHerReplayBuffer, replay_buffer_kwargs={"path": ...,
"n_sampled_goal": 4, "goal_selection_strategy": "future"}``; commits and resume as with
``ZarrReplayBuffer`` (``CommitCallback``, ``resume(SAC, path, env=env)``).
"""

from __future__ import annotations

import json
import os
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any, cast

from rlbuffers.integrations import require

require("stable_baselines3", "sb3")

import numpy as np  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.type_aliases import DictReplayBufferSamples  # noqa: E402
from stable_baselines3.common.vec_env import VecEnv, VecNormalize  # noqa: E402
from stable_baselines3.her.goal_selection_strategy import (  # noqa: E402
    KEY_TO_GOAL_STRATEGY,
    GoalSelectionStrategy,
)
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer  # noqa: E402

from rlbuffers.buffer import ReplayBuffer  # noqa: E402
from rlbuffers.errors import FieldError  # noqa: E402
from rlbuffers.integrations.sb3.buffer import (  # noqa: E402
    META_KEY,
    ZarrDictReplayBuffer,
    _ZarrBuffer,
)
from rlbuffers.integrations.sb3.layout import Layout  # noqa: E402
from rlbuffers.spec import FieldSpec  # noqa: E402
from rlbuffers.storage.compression import DEFAULT_CODEC  # noqa: E402

__all__ = ["ZarrHerReplayBuffer", "check_committable"]

#: The committed HER arguments while ``ZarrHerReplayBuffer.open`` runs (``_setup`` reads them).
_OPENING: ContextVar[dict[str, Any] | None] = ContextVar("her_opening", default=None)

def check_committable(buffer: Any) -> None:
    """Refuse, when ``CommitCallback`` starts, SB3's in-RAM ``HerReplayBuffer``.

    Raises:
        TypeError: ``buffer`` is a ``HerReplayBuffer`` that is not a ZarrHerReplayBuffer.
    """
    if isinstance(buffer, HerReplayBuffer) and not isinstance(buffer, _ZarrBuffer):
        raise TypeError("replay_buffer_class: CommitCallback commits a buffer on disk, got SB3's "
                        "HerReplayBuffer (in RAM): use ZarrHerReplayBuffer "
                        "(rlbuffers.integrations.sb3) with the same kwargs plus path")


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"infos: {type(value).__name__} is not JSON (copy_info_dict stores JSON)")


@dataclass(frozen=True)
class HerLayout(Layout):
    """:class:`Layout` plus ``ep_start`` int64 ``()`` (SB3's ``ep_start`` of the transition:
    the buffer step at which its episode started) and, with ``copy_info_dict``, ``info``
    uint8 ``[info_bytes]`` (the info dict as UTF-8 JSON, zero-padded)."""

    info_bytes: int = 0

    def fields(self) -> dict[str, FieldSpec]:
        out = {**super().fields(), "ep_start": FieldSpec((), "int64")}
        if self.info_bytes:
            out["info"] = FieldSpec((self.info_bytes,), "uint8")
        return out

    def info_rows(self, infos: list[dict[str, Any]]) -> np.ndarray:
        """``uint8 [n_envs, info_bytes]`` of one step's info dicts (``terminal_observation``,
        which is the transition's next observation, is left out).

        Raises:
            FieldError: an info dict longer than ``info_bytes`` as JSON, or not JSON.
        """
        rows = np.zeros((self.n_envs, self.info_bytes), dtype=np.uint8)
        for i, info in enumerate(infos):
            kept = {k: v for k, v in info.items() if k != "terminal_observation"}
            try:
                data = json.dumps(kept, default=_plain, separators=(",", ":")).encode()
            except TypeError as e:
                raise FieldError(str(e)) from None
            if len(data) > self.info_bytes:
                raise FieldError(f"infos: expected info dicts of <= info_bytes={self.info_bytes}"
                                 f" bytes as JSON, got {len(data)}: pass a larger info_bytes")
            rows[i, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        return rows


def _strategy(value: Any) -> GoalSelectionStrategy:
    if isinstance(value, GoalSelectionStrategy):
        return value
    if isinstance(value, str) and value.lower() in KEY_TO_GOAL_STRATEGY:
        return KEY_TO_GOAL_STRATEGY[value.lower()]
    raise ValueError(f"goal_selection_strategy: expected one of {list(KEY_TO_GOAL_STRATEGY)} or "
                     f"a GoalSelectionStrategy, got {value!r}")


class ZarrHerReplayBuffer(ZarrDictReplayBuffer, HerReplayBuffer):
    """SB3's ``HerReplayBuffer`` (Andrychowicz et al. 2017, section 3.4) with the transitions
    on disk in an rlbuffers buffer at ``path``.

    ``sample(B)`` draws B transitions uniformly among those of ended episodes still whole in
    the buffer (a running episode, or one partly overwritten, is never drawn), then relabels
    the first ``int(her_ratio * B)`` of them, ``her_ratio = 1 - 1 / (n_sampled_goal + 1)``:
    their ``desired_goal`` (obs and next obs) becomes the ``next_obs["achieved_goal"]`` of a
    transition of the same episode chosen by ``goal_selection_strategy`` (section 4.5):
    ``"future"`` (a step at or after this one: inclusive, as SB3), ``"final"`` (the last),
    ``"episode"`` (any), and their reward ``env.compute_reward(next achieved_goal, new goal,
    infos)`` (``env_method`` of environment 0). Returned: the real transitions, then the
    relabelled ones, as SB3's ``HerReplayBuffer``.

    Args:
        buffer_size, observation_space, action_space, env, device, n_envs,
            handle_timeout_termination, n_sampled_goal, goal_selection_strategy,
            copy_info_dict: as SB3's ``HerReplayBuffer`` (``observation_space`` a Dict with
            ``achieved_goal`` and ``desired_goal``; ``env`` may be None until ``set_env``).
        optimize_memory_usage: must be False (as SB3's ``DictReplayBuffer``).
        path, overwrite, chunk_transitions, codec, working_dir, write_batch: as
            :class:`~rlbuffers.integrations.sb3.ZarrReplayBuffer`.
        info_bytes: with ``copy_info_dict``, the bytes each info dict may take as JSON
            (numpy values are stored as lists and come back as lists; ``terminal_observation``
            is not stored). Without ``copy_info_dict`` no info is stored.

    Raises:
        ValueError: a bad ``goal_selection_strategy``, ``n_sampled_goal`` (an int >= 0),
        ``info_bytes`` (>= 1 with ``copy_info_dict``) or ``optimize_memory_usage``.
        TypeError: ``observation_space`` is not a Dict with ``achieved_goal`` and
        ``desired_goal``.
    """

    _checked_before_open = False  # its _setup needs the HER state (check_openable)

    def __init__(self, buffer_size: int, observation_space: spaces.Dict,
                 action_space: spaces.Space, env: VecEnv | None = None,
                 device: th.device | str = "auto", n_envs: int = 1,
                 optimize_memory_usage: bool = False, handle_timeout_termination: bool = True,
                 n_sampled_goal: int = 4,
                 goal_selection_strategy: GoalSelectionStrategy | str = "future",
                 copy_info_dict: bool = False, *, path: str | os.PathLike[str],
                 overwrite: bool = False, chunk_transitions: int | None = None,
                 codec: Any = DEFAULT_CODEC, working_dir: str | os.PathLike[str] | None = None,
                 write_batch: int | None = None, info_bytes: int = 1024) -> None:
        self._her_setup(env, n_sampled_goal, goal_selection_strategy, copy_info_dict,
                        info_bytes)
        super().__init__(buffer_size, observation_space, action_space, device, n_envs,
                         optimize_memory_usage, handle_timeout_termination, path=path,
                         overwrite=overwrite, chunk_transitions=chunk_transitions, codec=codec,
                         working_dir=working_dir, write_batch=write_batch)

    def _her_setup(self, env: VecEnv | None, n_sampled_goal: int, strategy: Any,
                   copy_info_dict: bool, info_bytes: int) -> None:
        if isinstance(n_sampled_goal, bool) or not isinstance(n_sampled_goal, int | np.integer) \
                or n_sampled_goal < 0:
            raise ValueError(f"n_sampled_goal: expected an int >= 0, got {n_sampled_goal!r}")
        if copy_info_dict and (not isinstance(info_bytes, int | np.integer) or info_bytes < 1):
            raise ValueError(f"info_bytes: expected an int >= 1, got {info_bytes!r}")
        self.env = env
        self.goal_selection_strategy = _strategy(strategy)
        self.n_sampled_goal = int(n_sampled_goal)
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))
        self.copy_info_dict = bool(copy_info_dict)
        self._info_bytes = int(info_bytes) if copy_info_dict else 0

    def _setup(self, buffer_size: int, observation_space: spaces.Space,
               action_space: spaces.Space, device: th.device | str, n_envs: int,
               optimize_memory_usage: bool, handle_timeout_termination: bool,
               write_batch: int | None = None, frame_stack_axis: int | None = None) -> None:
        her = _OPENING.get()
        if her is not None and not hasattr(self, "her_ratio"):  # open(): the committed ones
            self._her_setup(None, her["n_sampled_goal"], her["goal_selection_strategy"],
                            her["copy_info_dict"], her["info_bytes"] or 1)
        keys = set(observation_space.spaces) if isinstance(observation_space, spaces.Dict) else ()
        if not {"achieved_goal", "desired_goal"} <= set(keys):
            raise TypeError("observation_space: expected a Dict with 'achieved_goal' and "
                            f"'desired_goal' (a goal-conditioned env), got {observation_space}")
        super()._setup(buffer_size, observation_space, action_space, device, n_envs,
                       optimize_memory_usage, handle_timeout_termination, write_batch,
                       frame_stack_axis)
        base = self._layout
        self._layout = HerLayout(**{f.name: getattr(base, f.name) for f in fields(base)},
                                 info_bytes=self._info_bytes)
        self.ep_start = np.zeros((self.buffer_size, self.n_envs), dtype=np.int64)
        self.ep_length = np.zeros((self.buffer_size, self.n_envs), dtype=np.int64)
        self._current_ep_start = np.zeros(self.n_envs, dtype=np.int64)
        self._valid: np.ndarray | None = None  # flatnonzero(ep_length > 0), until it changes

    # -- add --------------------------------------------------------------------------------
    def add(self, obs: Any, next_obs: Any, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Append one step of ``n_envs`` transitions (``obs``, ``next_obs``: Dict of
        ``[n_envs, *shape]``; ``action`` ``[n_envs, action_dim]``; ``reward``, ``done``
        ``[n_envs]``; ``infos``: ``n_envs`` dicts), as SB3's ``HerReplayBuffer.add``: an
        episode whose steps this one overwrites is no longer sampled, and an episode that
        ``done`` ends becomes sampleable.

        Raises:
            FieldError: a ``done`` other than 0/1, or (``copy_info_dict``) an info dict that
            is not JSON or longer than ``info_bytes`` (nothing changes).
            FileExistsError: see ``storage``.
        """
        self._buffer()
        n, bs, pos = self.n_envs, self.buffer_size, self.pos
        layout = cast(HerLayout, self._layout)
        done = np.broadcast_to(np.array(done, dtype=np.float32), (n,))
        if not np.isin(done, (0.0, 1.0)).all():
            raise FieldError(f"done: expected 0/1 (or bool) values, got {done.tolist()}")
        timeout = np.zeros(n, dtype=bool)
        if self.handle_timeout_termination:
            timeout = np.array([info.get("TimeLimit.truncated", False) for info in infos],
                               dtype=bool)
        row = layout.obs_rows(obs, "obs")
        row.update(layout.obs_rows(next_obs, "next_obs"))
        step = layout.step_rows(row, action, reward, done, timeout)
        step["ep_start"] = self._current_ep_start.copy()
        if layout.info_bytes:
            step["info"] = layout.info_rows(infos)
        for e in range(n):  # the episode being overwritten is dropped whole (as SB3)
            length = self.ep_length[pos, e]
            if length > 0:
                self.ep_length[np.arange(pos, self.ep_start[pos, e] + length) % bs, e] = 0
        self.ep_start[pos] = self._current_ep_start
        self._staged.append(step)
        if len(self._staged) >= self._write_batch:
            self._flush()
        self.pos = int(pos + 1) % bs
        self.full = self.full or self.pos == 0
        for ended in np.flatnonzero(done):
            self._end_episode(int(ended))
        self._valid = None

    def _end_episode(self, env: int) -> None:
        """The running episode of environment ``env`` ended with the newest step."""
        start, end = int(self._current_ep_start[env]), self.pos
        if end < start:  # the episode crossed the end of the ring
            end += self.buffer_size
        self.ep_length[np.arange(start, end) % self.buffer_size, env] = end - start
        self._current_ep_start[env] = self.pos

    # -- sample -----------------------------------------------------------------------------
    def sample(self, batch_size: int,  # type: ignore[override]
               env: VecNormalize | None = None) -> DictReplayBufferSamples:
        """Draw ``batch_size`` (B) transitions of ended episodes and relabel
        ``int(her_ratio * B)`` of them (see the class).

        Returns:
            ``DictReplayBufferSamples`` of tensors on ``device``: observations and
            next_observations (Dict of ``[B, *shape]``), actions ``[B, action_dim]``, dones
            float32 ``[B, 1]`` (0 for handled timeouts), rewards float32 ``[B, 1]``; rows
            ``B - int(her_ratio * B)`` onwards are the relabelled ones.

        Raises:
            RuntimeError: no episode has ended yet. ValueError: no ``env`` to compute rewards
            with (call ``set_env``). FileExistsError: see ``storage``.
        """
        self._buffer()
        if self._valid is None:
            self._valid = np.flatnonzero(self.ep_length > 0)
        if self._valid.size == 0:
            raise RuntimeError("sample: no episode has ended yet, so none can be sampled; "
                               "choose learning_starts above the episodes' length")
        drawn = np.random.choice(self._valid, size=batch_size, replace=True)
        steps, envs = np.unravel_index(drawn, self.ep_length.shape)
        n_virtual = int(self.her_ratio * batch_size)
        goal_steps = self._goal_steps(steps[:n_virtual], envs[:n_virtual])
        order = np.r_[n_virtual:batch_size, 0:n_virtual]  # real first, then relabelled
        rows = self._gather(self._positions(np.concatenate([steps[order], goal_steps]),
                                            np.concatenate([envs[order], envs[:n_virtual]])))
        real = batch_size - n_virtual
        obs = {k: rows[f"obs.{k}"][:batch_size] for k in self._layout.obs}
        next_obs = {k: rows[f"next_obs.{k}"][:batch_size] for k in self._layout.obs}
        rewards = rows["reward"][:batch_size].copy()
        if n_virtual:
            goals = rows["next_obs.achieved_goal"][batch_size:]
            obs["desired_goal"][real:] = goals
            next_obs["desired_goal"][real:] = goals
            rewards[real:] = self._rewards(next_obs["achieved_goal"][real:], goals,
                                           rows.get("info"), real, batch_size)
        dones = rows["terminated"][:batch_size].astype(np.float32).reshape(-1, 1)
        obs = self._normalize_obs(obs, env)  # type: ignore[assignment]
        next_obs = self._normalize_obs(next_obs, env)  # type: ignore[assignment]
        return DictReplayBufferSamples(
            observations={k: self.to_torch(v) for k, v in obs.items()},
            actions=self.to_torch(rows["action"][:batch_size]),
            next_observations={k: self.to_torch(v) for k, v in next_obs.items()},
            dones=self.to_torch(dones),
            rewards=self.to_torch(self._normalize_reward(rewards.reshape(-1, 1), env)))

    def _goal_steps(self, steps: np.ndarray, envs: np.ndarray) -> np.ndarray:
        """Buffer steps whose ``next_obs["achieved_goal"]`` relabels transitions ``steps`` of
        environments ``envs`` (one ``np.random.randint`` call, as SB3)."""
        start, length = self.ep_start[steps, envs], self.ep_length[steps, envs]
        strategy = self.goal_selection_strategy
        if strategy == GoalSelectionStrategy.FINAL:
            offset = length - 1
        elif strategy == GoalSelectionStrategy.FUTURE:  # inclusive: this step may be chosen
            offset = np.random.randint((steps - start) % self.buffer_size, length)
        else:
            offset = np.random.randint(0, length)
        return (offset + start) % self.buffer_size

    def _rewards(self, achieved: np.ndarray, goals: np.ndarray, info: np.ndarray | None,
                 lo: int, hi: int) -> np.ndarray:
        """``env.compute_reward(achieved, goals, infos)`` as float32 (rows ``lo:hi`` of the
        gathered ``info`` column are the relabelled transitions')."""
        if self.env is None:
            raise ValueError("env: ZarrHerReplayBuffer needs the VecEnv to compute rewards of "
                             "relabelled transitions, got None: call set_env(env)")
        if info is None:
            infos: Any = [{} for _ in range(hi - lo)]
        else:
            infos = np.empty(hi - lo, dtype=object)
            infos[:] = [json.loads(bytes(r).rstrip(b"\0") or b"{}") for r in info[lo:hi]]
        out = self.env.env_method("compute_reward", achieved, goals, infos, indices=[0])
        return np.asarray(out[0], dtype=np.float32).reshape(-1)

    # -- state, commit, open ----------------------------------------------------------------
    def reset(self) -> None:
        """Empty the buffer (see ``ZarrReplayBuffer.reset``) and its episode bookkeeping."""
        super().reset()
        self.ep_start[:] = 0
        self.ep_length[:] = 0
        self._current_ep_start[:] = 0
        self._valid = None

    def truncate_last_trajectory(self) -> None:
        """End the running episodes (what SB3's ``load_replay_buffer`` does for HER): their
        transitions become sampleable, and the next step starts an episode. Stored rows are
        not rewritten: the last step keeps ``terminated`` False (as SB3 samples it with
        ``handle_timeout_termination``; without, SB3 samples done = 1)."""
        running = np.flatnonzero(self._current_ep_start != self.pos)
        if running.size:
            warnings.warn("The last trajectory in the replay buffer will be truncated "
                          "(load_replay_buffer(truncate_last_traj=False) keeps it running)",
                          stacklevel=2)
        for e in running:
            self._end_episode(int(e))
        self._valid = None

    def state_dict(self) -> dict[str, Any]:
        """``ZarrReplayBuffer.state_dict`` plus ``"her"``: the HER arguments and each
        environment's running episode start (JSON)."""
        return {**super().state_dict(), "her": {
            "n_sampled_goal": self.n_sampled_goal,
            "goal_selection_strategy": self.goal_selection_strategy.name.lower(),
            "copy_info_dict": self.copy_info_dict, "info_bytes": self._info_bytes,
            "current_ep_start": self._current_ep_start.tolist()}}

    @classmethod
    def open(cls, path: str | os.PathLike[str], observation_space: spaces.Space,
             action_space: spaces.Space, device: th.device | str = "auto", *,
             env: VecEnv | None = None, working_dir: str | os.PathLike[str] | None = None,
             write_batch: int | None = None) -> Any:
        """Open the last commit that :meth:`commit` wrote, for reading and writing: the
        transitions, ``pos``, ``full``, the HER arguments and the episode bookkeeping come
        back as committed (the episodes from the stored ``ep_start``, ``terminated`` and
        ``truncated`` columns; running episodes go on). ``env``: as the constructor's
        (``resume`` sets the model's).

        Raises:
            NotABufferError: no buffer at ``path``. ValueError: the commit has no HER state
            (not written by ZarrHerReplayBuffer), or its fields do not match the spaces.
        """
        with ReplayBuffer.open(path, mode="r") as peek:   # the HER arguments, for _setup
            state = peek.metadata.get(META_KEY)
        her = state.get("her") if isinstance(state, dict) else None
        if not isinstance(her, dict):
            raise ValueError(f"{path}: the last commit has no {META_KEY!r}.'her' metadata (it "
                             "was not written by ZarrHerReplayBuffer.commit)")
        token = _OPENING.set(her)
        try:
            self = super().open(path, observation_space, action_space, device,
                                working_dir=working_dir, write_batch=write_batch)
        finally:
            _OPENING.reset(token)
        self.env = env
        self._current_ep_start[:] = her["current_ep_start"]
        self._rebuild_episodes()
        return self

    def _rebuild_episodes(self) -> None:
        """``ep_start`` and ``ep_length`` from the stored columns, as ``add`` left them: an
        episode ends at a step that is terminated or truncated or whose successor starts
        another episode, and is sampleable iff its first step is still in the buffer."""
        bs, rb = self.buffer_size, self._flush()
        steps = bs if self.full else self.pos
        order = (self.pos - steps + np.arange(steps)) % bs  # buffer steps, oldest first
        for e in range(self.n_envs):
            slots = rb._ring.slots(self._positions(order, np.full(steps, e)))  # package-internal
            start = np.asarray(rb._gather("ep_start", slots), dtype=np.int64)
            ended = (np.asarray(rb._gather("terminated", slots), dtype=bool)
                     | np.asarray(rb._gather("truncated", slots), dtype=bool))
            # an episode also ends where the next one starts (truncate_last_trajectory)
            ended |= start != np.append(start[1:], self._current_ep_start[e])
            self.ep_start[order, e] = start
            for k in np.flatnonzero(ended):
                s, end = int(start[k]), (int(order[k]) + 1) % bs
                end += bs if end < s else 0
                if 0 < end - s <= k + 1:
                    self.ep_length[np.arange(s, end) % bs, e] = end - s
        self._valid = None
