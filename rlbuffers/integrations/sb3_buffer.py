"""Stable-Baselines3 replay buffers stored in an rlbuffers :class:`~rlbuffers.ReplayBuffer`.

:class:`ZarrReplayBuffer` and :class:`ZarrDictReplayBuffer` subclass SB3's ``ReplayBuffer`` and
``DictReplayBuffer`` with the same constructor (plus ``path``) and the same ``add`` / ``sample``
contract, but keep the transitions on disk (``add`` stages a few steps in RAM and appends them
to the working tier, ``commit`` saves incrementally) instead of in numpy arrays of
``buffer_size`` rows in RAM.

Layout (:mod:`rlbuffers.integrations.sb3_layout`): each ``add`` appends ``R`` rows, ``R =
n_envs`` (one transition per environment, environments in order) or, with
``frame_stack_axis``, ``R = 1`` (one row per step holding every environment, the frame stacks
stored one frame per environment per step). The rlbuffers capacity is ``buffer_size // n_envs
* R`` and the rows of the step that is ``a`` steps older than the newest start at position
``len - (a + 1) * R``.

Sampling calls ``np.random.randint`` exactly as SB3 does (same calls, same order), so with the
same numpy global RNG state the sampled batches equal SB3's, bit for bit.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, cast

from rlbuffers.integrations import require

require("stable_baselines3", "sb3")

import numpy as np  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import BaseBuffer, DictReplayBuffer  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402
from stable_baselines3.common.type_aliases import (  # noqa: E402
    DictReplayBufferSamples,
    ReplayBufferSamples,
)
from stable_baselines3.common.vec_env import VecNormalize  # noqa: E402

from rlbuffers.buffer import ReplayBuffer, SaveReport  # noqa: E402
from rlbuffers.compression import DEFAULT_CODEC  # noqa: E402
from rlbuffers.errors import FieldError  # noqa: E402
from rlbuffers.integrations.sb3_layout import (  # noqa: E402
    Layout,
    field_name,
    rows_from_json,
    rows_to_json,
)
from rlbuffers.integrations.sb3_rng import rng_state  # noqa: E402
from rlbuffers.storage.saver import SaveFuture  # noqa: E402

__all__ = ["META_KEY", "ZarrDictReplayBuffer", "ZarrReplayBuffer"]

log = logging.getLogger(__name__)

#: ``add`` stages at most this many steps, and about this many bytes, before appending them
#: to the rlbuffers buffer in one ``extend`` (~80x faster than one ``extend`` per step for
#: small transitions); sampling reads staged steps from RAM, commits append them first.
WRITE_BATCH_STEPS, WRITE_BATCH_BYTES = 64, 4 << 20

#: Key of the commit metadata that holds the SB3 buffer's state (``state_dict()``).
META_KEY = "sb3"


class _ZarrBuffer(SB3ReplayBuffer):
    """What ZarrReplayBuffer and ZarrDictReplayBuffer share (before DictReplayBuffer in the
    latter's MRO, so its methods replace SB3's)."""

    _dict_obs: bool = False

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        path: str | os.PathLike[str],
        overwrite: bool = False,
        chunk_transitions: int | None = None,
        codec: str | Mapping[str, str] = DEFAULT_CODEC,
        working_dir: str | os.PathLike[str] | None = None,
        write_batch: int | None = None,
        frame_stack_axis: int | None = None,
    ) -> None:
        self._setup(buffer_size, observation_space, action_space, device, n_envs,
                    optimize_memory_usage, handle_timeout_termination, write_batch,
                    frame_stack_axis)
        try:
            self._rb: ReplayBuffer | None = ReplayBuffer.create(
                path, capacity=self.buffer_size * self._layout.rows_per_step,
                fields=self._layout.fields(), next_of=self._layout.next_of,
                chunk_transitions=chunk_transitions, codec=codec, seed=0,
                working_dir=working_dir, overwrite=overwrite)
        except FileExistsError:
            # SB3's ``Model.load`` rebuilds the replay buffer with the saved kwargs, so the
            # path of a running or finished run's buffer comes here: leave it untouched.
            self._rb = None
            self._path = path
            log.info("%s already holds data: this buffer stays unused (use "
                     "ZarrReplayBuffer.open or rlbuffers.integrations.sb3.resume)", path)

    def _setup(self, buffer_size: int, observation_space: spaces.Space,
               action_space: spaces.Space, device: th.device | str, n_envs: int,
               optimize_memory_usage: bool, handle_timeout_termination: bool,
               write_batch: int | None = None, frame_stack_axis: int | None = None) -> None:
        # SB3's ReplayBuffer.__init__ allocates buffer_size rows in RAM: call BaseBuffer's only.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space,  # type: ignore[arg-type]
                            device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        if optimize_memory_usage and handle_timeout_termination:
            raise ValueError(
                "ReplayBuffer does not support optimize_memory_usage = True "
                "and handle_timeout_termination = True simultaneously.")
        if optimize_memory_usage and self._dict_obs:
            raise ValueError("DictReplayBuffer does not support optimize_memory_usage")
        if self._dict_obs != isinstance(observation_space, spaces.Dict):
            raise TypeError(f"observation_space: {type(self).__name__} needs "
                            f"{'a' if self._dict_obs else 'a non-'}Dict space, got "
                            f"{type(observation_space).__name__}")
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        self._layout = Layout.of(observation_space, action_space, n_envs, optimize_memory_usage,
                                 frame_stack_axis)
        # optimize_memory_usage: the next observation of the newest step, [n_envs, *obs_shape]
        self._pending: dict[str, np.ndarray] | None = None
        # steps added but not yet appended to the rlbuffers buffer (one extend per batch)
        self._staged: list[dict[str, np.ndarray]] = []
        step_bytes = self.n_envs // self._layout.rows_per_step * sum(
            math.prod(cast(tuple[int, ...], s.shape)) * np.dtype(s.dtype).itemsize
            for s in self._layout.user_fields().values())
        if write_batch is None:
            write_batch = max(1, min(WRITE_BATCH_STEPS, WRITE_BATCH_BYTES // step_bytes))
        if int(write_batch) < 1:
            raise ValueError(f"write_batch: expected >= 1 steps, got {write_batch}")
        self._write_batch = int(write_batch)

    # -- layout ---------------------------------------------------------------------------
    @property
    def storage(self) -> ReplayBuffer:
        """The rlbuffers buffer that holds the transitions (every step added so far: the
        staged ones are appended first).

        Raises:
            FileExistsError: the constructor found a buffer at ``path`` and left it alone.
        """
        return self._flush()

    def _flush(self, keep: int = 0) -> ReplayBuffer:
        """Append the staged steps but the last ``keep`` to the rlbuffers buffer."""
        rb = self._buffer()
        if len(self._staged) > keep:
            cut = len(self._staged) - keep
            staged, self._staged = self._staged[:cut], self._staged[cut:]
            rb.extend({k: np.concatenate([row[k] for row in staged]) for k in staged[0]})
        return rb

    def _buffer(self) -> ReplayBuffer:
        """The rlbuffers buffer, without appending the staged steps."""
        if self._rb is None:
            raise FileExistsError(
                f"{self._path}: already holds a buffer, so this one was not created (SB3's "
                "Model.load builds one this way). Continue from its last commit with "
                "ZarrReplayBuffer.open(path, observation_space, action_space) or "
                "rlbuffers.integrations.sb3.resume(...); start over with overwrite=True")
        return self._rb

    @property
    def dones(self) -> np.ndarray:  # type: ignore[override]
        """Not kept in RAM. SB3 reads it only to mark the last step done in place, when
        ``learn(reset_num_timesteps=True)`` runs again on a filled buffer with
        ``optimize_memory_usage``.

        Raises:
            NotImplementedError: always, saying what to do instead.
        """
        raise NotImplementedError(
            f"{type(self).__name__} keeps no in-RAM dones array, so SB3 cannot mark the last "
            "step done in place (it does so when learn(reset_num_timesteps=True) runs again "
            "with optimize_memory_usage): call learn(..., reset_num_timesteps=False)")

    # -- add --------------------------------------------------------------------------------
    def add(self, obs: Any, next_obs: Any, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Append one step of ``n_envs`` transitions (SB3's ``ReplayBuffer.add``): ``obs``,
        ``next_obs`` ``[n_envs, *obs_shape]`` (Dict: per key), ``action``
        ``[n_envs, action_dim]`` (any shape that reshapes to it), ``reward``, ``done``
        ``[n_envs]``, ``infos`` (read only with ``handle_timeout_termination``).

        Raises:
            FieldError: a ``done`` other than 0/1. FileExistsError: see :attr:`storage`.
        """
        self._buffer()
        n, layout = self.n_envs, self._layout
        done = np.broadcast_to(np.array(done, dtype=np.float32), (n,))
        if not np.isin(done, (0.0, 1.0)).all():
            raise FieldError(f"done: expected 0/1 (or bool) values, got {done.tolist()}")
        timeout = np.zeros(n, dtype=bool)
        if self.handle_timeout_termination:
            timeout = np.array([info.get("TimeLimit.truncated", False) for info in infos],
                               dtype=bool)
        row = layout.obs_rows(obs, "obs")
        next_row = layout.obs_rows(next_obs, "next_obs")
        if self.optimize_memory_usage:
            self._pending = next_row
        else:
            row.update(next_row)
        step = layout.step_rows(row, action, reward, done, timeout)
        if layout.stack_axis is not None:
            layout.check_step(step, self._staged, self._buffer())
        self._staged.append(step)
        if len(self._staged) >= self._write_batch + (layout.stack_axis is not None):
            self._flush(keep=int(layout.stack_axis is not None))
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0

    # -- sample ---------------------------------------------------------------------------------
    def sample(self, batch_size: int, env: VecNormalize | None = None) -> Any:
        """Draw ``batch_size`` (B) transitions uniformly with ``np.random.randint`` (as SB3).

        Returns:
            ``ReplayBufferSamples`` (``DictReplayBufferSamples``) of tensors on ``device``:
            observations ``[B, *obs_shape]``, actions ``[B, action_dim]``, next_observations,
            dones float32 ``[B, 1]`` (0 for handled timeouts), rewards float32 ``[B, 1]``.

        Raises:
            ValueError: the buffer is empty (numpy's ``high <= 0``). FileExistsError: see
            :attr:`storage`.
        """
        self._buffer()
        if not self.optimize_memory_usage:
            upper_bound = self.buffer_size if self.full else self.pos
            batch_inds = np.random.randint(0, upper_bound, size=batch_size)
        elif self.full:
            # the oldest step's observation was overwritten (SB3's single obs array)
            batch_inds = (np.random.randint(1, self.buffer_size, size=batch_size)
                          + self.pos) % self.buffer_size
        else:
            batch_inds = np.random.randint(0, self.pos, size=batch_size)
        return self._get_samples(batch_inds, env=env)

    def _positions(self, batch_inds: np.ndarray, env_indices: np.ndarray) -> np.ndarray:
        """rlbuffers positions of SB3 steps ``batch_inds`` of environments ``env_indices``
        (frame-stacked: of the steps' rows, which hold every environment)."""
        age = (self.pos - 1 - np.asarray(batch_inds, dtype=np.int64)) % self.buffer_size
        rb, per_step = self._buffer(), self._layout.rows_per_step
        size = min(len(rb) + len(self._staged) * per_step, rb.capacity)
        return size - (age + 1) * per_step + (env_indices if per_step > 1 else 0)

    def _gather(self, where: np.ndarray) -> dict[str, np.ndarray]:
        """Rows at positions ``where`` of the buffer followed by the staged steps (the last
        ``capacity`` rows of the two, as they will be once the staged steps are appended)."""
        rb = self._buffer()
        stored = len(rb)
        staged_rows = len(self._staged) * self._layout.rows_per_step
        index = where + max(0, stored + staged_rows - rb.capacity)
        in_rb = index < stored
        if in_rb.all():
            return rb[index]
        staged = {k: np.concatenate([row[k] for row in self._staged]) for k in self._staged[0]}
        rows = rb[index[in_rb]] if in_rb.any() else None
        out = {}
        for name, values in staged.items():
            column = np.empty((len(index), *values.shape[1:]), dtype=values.dtype)
            column[~in_rb] = values[index[~in_rb] - stored]
            if rows is not None:
                column[in_rb] = rows[name]
            out[name] = column
        return out

    def _rows(self, batch_inds: np.ndarray, env_indices: np.ndarray) -> dict[str, np.ndarray]:
        """The stored fields of the sampled transitions, ``next_obs`` included."""
        layout = self._layout
        where = self._positions(batch_inds, env_indices)
        if not self.optimize_memory_usage:
            return layout.select(self._gather(where), env_indices)
        # next_obs of step t is obs of step t + 1, or the pending one for the newest step
        following = (batch_inds + 1) % self.buffer_size
        pending = following == self.pos
        if self._pending is None:
            raise ValueError("optimize_memory_usage: no next observation of the newest step "
                             "is known (sample before any add)")
        envs = np.concatenate([env_indices, env_indices[~pending]])
        rows = layout.select(self._gather(np.concatenate(
            [where, self._positions(following[~pending], env_indices[~pending])])), envs)
        size = len(batch_inds)
        for key in layout.obs:
            name = field_name("obs", key)
            following_obs = rows[name][size:]
            nxt = np.empty((size, *following_obs.shape[1:]), dtype=following_obs.dtype)
            nxt[~pending] = following_obs
            nxt[pending] = self._pending[field_name("next_obs", key)][env_indices[pending]]
            rows[field_name("next_obs", key)] = nxt
            rows[name] = rows[name][:size]
        return {k: v[:size] for k, v in rows.items()}

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        rows = self._rows(batch_inds, env_indices)
        dones = rows["terminated"].astype(np.float32).reshape(-1, 1)
        rewards = self._normalize_reward(rows["reward"].reshape(-1, 1), env)
        if self._dict_obs:
            keys = list(self._layout.obs)
            obs: Any = self._normalize_obs({k: rows[f"obs.{k}"] for k in keys}, env)
            next_obs: Any = self._normalize_obs({k: rows[f"next_obs.{k}"] for k in keys}, env)
            return DictReplayBufferSamples(
                observations={k: self.to_torch(v) for k, v in obs.items()},
                actions=self.to_torch(rows["action"]),
                next_observations={k: self.to_torch(v) for k, v in next_obs.items()},
                dones=self.to_torch(dones).reshape(-1, 1),
                rewards=self.to_torch(rewards))
        next_obs = self._normalize_obs(rows["next_obs"], env)
        data: tuple[Any, ...] = (self._normalize_obs(rows["obs"], env), rows["action"], next_obs,
                                 dones, rewards)
        return ReplayBufferSamples(*(self.to_torch(d) for d in data))

    # -- state, commit, open ---------------------------------------------------------------
    def reset(self) -> None:
        """Empty the buffer as SB3 does (``pos = 0``, ``full = False``): the stored rows stay
        on disk until ``add`` overwrites them, but are no longer sampled."""
        if self._rb is not None:  # frame-stacked: the newest stays staged (see ``add``)
            self._flush(keep=int(self._layout.stack_axis is not None))
        super().reset()
        self._pending = None

    def state_dict(self) -> dict[str, Any]:
        """The SB3-side state, plain data (JSON): what ``commit`` stores in the metadata."""
        pending = None if self._pending is None else rows_to_json(self._pending)
        return {"class": type(self).__name__, "buffer_size": self.buffer_size,
                "n_envs": self.n_envs, "pos": self.pos, "full": self.full,
                "optimize_memory_usage": self.optimize_memory_usage,
                "handle_timeout_termination": self.handle_timeout_termination,
                "frame_stack_axis": self._layout.stack_axis, "pending_next_obs": pending}

    def commit(self, metadata: Mapping[str, Any] | None = None, *, rng: bool = True,
               background: bool = False) -> SaveReport | SaveFuture:
        """Save the transitions changed since the last commit, atomically (``ReplayBuffer.save``),
        with ``metadata`` (a JSON dict) plus ``"sb3"``: :meth:`state_dict` and, with ``rng``,
        the numpy global, Python and torch RNG states (``"rng"``) that SB3 samples with.

        Raises:
            TypeError: metadata is not JSON. OSError: the write failed (the last commit stays).
        """
        meta = dict(metadata or {})
        meta[META_KEY] = self.state_dict()
        if rng:
            meta["rng"] = rng_state()
        return self.storage.save(metadata=meta, background=background)

    save = commit

    def close(self) -> None:
        """Release the buffer's files (changes since the last commit are discarded)."""
        if self._rb is not None:
            self._rb.close()

    @classmethod
    def open(cls, path: str | os.PathLike[str], observation_space: spaces.Space,
             action_space: spaces.Space, device: th.device | str = "auto", *,
             working_dir: str | os.PathLike[str] | None = None,
             write_batch: int | None = None) -> Any:
        """Open the last commit of a buffer that :meth:`commit` wrote, for reading and writing:
        the transitions, ``pos``, ``full`` and the pending next observation come back as
        committed (the RNG states do not change: see ``sb3_rng.restore_rng``).

        Raises:
            NotABufferError: no buffer at ``path``. ValueError: the commit has no ``"sb3"``
            metadata, or its fields do not match the spaces (naming the field).
        """
        rb = ReplayBuffer.open(path, working_dir=working_dir)
        try:
            state = rb.metadata.get(META_KEY)
            if not isinstance(state, dict):
                raise ValueError(f"{path}: the last commit has no {META_KEY!r} metadata "
                                 "(it was not written by ZarrReplayBuffer.commit)")
            self = cls.__new__(cls)
            self._setup(state["buffer_size"] * state["n_envs"], observation_space, action_space,
                        device, state["n_envs"], state["optimize_memory_usage"],
                        state["handle_timeout_termination"], write_batch,
                        state.get("frame_stack_axis"))
            expected = {n: (s.shape, np.dtype(s.dtype), s.stack_axis)
                        for n, s in self._layout.user_fields().items()}
            stored = {n: (s.shape, np.dtype(s.dtype), s.stack_axis) for n, s in rb.fields.items()}
            if expected != stored:
                raise ValueError(f"{path}: fields {stored} do not match the spaces, which "
                                 f"give {expected}")
        except BaseException:
            rb.close()
            raise
        self._rb = rb
        self.pos, self.full = int(state["pos"]), bool(state["full"])
        if state["pending_next_obs"] is not None:
            self._pending = rows_from_json(state["pending_next_obs"])
        return self

    def __getstate__(self) -> None:
        raise TypeError(f"{type(self).__name__} is not pickled: its transitions are on disk. "
                        "Save it with commit(); reopen it with open() or resume()")


class ZarrReplayBuffer(_ZarrBuffer):
    """SB3's ``ReplayBuffer`` (same arguments, ``add`` and ``sample``) with the transitions on
    disk in an rlbuffers buffer at ``path``.

    Args:
        buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
            handle_timeout_termination: as SB3's ``ReplayBuffer``.
        path: directory of the rlbuffers buffer (created; see ``overwrite``).
        overwrite: replace a buffer at ``path``. Without it an existing ``path`` is left
            untouched and this instance stays unused (``add`` raises FileExistsError): that
            is what ``Model.load`` builds; continue with :meth:`open` or ``resume``.
        chunk_transitions, codec, working_dir: as ``rlbuffers.ReplayBuffer.create``.
        write_batch: steps that ``add`` stages in RAM before appending them in one
            ``extend`` (>= 1; None: up to 64 steps and ~4 MiB). Staged steps are sampled
            like the others and appended by ``commit``; a crash loses them, as it loses every
            step added since the last commit.
        frame_stack_axis: the axis of the observation shape along which an observation is a
            stack of ``k`` single-channel frames, oldest first (SB3's ``VecFrameStack``:
            ``(k, 84, 84)`` -> 0, channel-last ``(84, 84, k)`` -> 2 or -1), or None (default).
            With it each frame is stored once per environment per step (about ``1 / k`` of
            the bytes of ``obs`` alone, ``1 / 2k`` of ``obs`` plus ``next_obs``) and the
            stacks are rebuilt on sampling, bit-identical; ``add`` then refuses (FieldError)
            a stack that does not continue the previous step's of its environment (frames
            a ``next_obs`` that is not ``obs`` shifted by one frame; a step whose stacks do
            not continue the previous step's (environments reset mid-episode) ends the
            previous step's episode in the rlbuffers buffer. Layout and its cost:
            :mod:`rlbuffers.integrations.sb3_layout`.

    Raises:
        ValueError: ``optimize_memory_usage`` with ``handle_timeout_termination`` (as SB3),
        ``write_batch < 1``, or a ``frame_stack_axis`` that is not an axis of a Box
        observation. TypeError: a Dict observation space (use
        :class:`ZarrDictReplayBuffer`).
    """


class ZarrDictReplayBuffer(_ZarrBuffer, DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` with the transitions on disk; arguments as
    :class:`ZarrReplayBuffer` (``optimize_memory_usage`` is refused, as by SB3)."""

    _dict_obs = True
