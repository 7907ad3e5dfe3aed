"""Sampling of a :class:`~rlbuffers.integrations.sb3.buffer.ZarrReplayBuffer` as SB3 samples.

``sample`` calls ``np.random.randint`` exactly as SB3 does (same calls, same order), so with the
same numpy global RNG state the sampled batches equal SB3's, bit for bit. SB3 step ``t`` of
environment ``e`` is found from its age (steps before the newest) among the rows stored and the
rows staged in RAM; a step that was never written (SB3 sampling with ``full`` set by hand on an
empty ring) reads as zeros, as SB3's ``np.zeros`` arrays do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from rlbuffers.integrations.sb3.layout import Layout, field_name

if TYPE_CHECKING:
    from stable_baselines3.common.buffers import ReplayBuffer as _Base

    from rlbuffers.buffer import ReplayBuffer
else:
    _Base = object

__all__ = ["Sampling"]


class Sampling(_Base):
    """The sampling methods of ``_ZarrBuffer`` (a mixin over its ``_layout``, ``_staged``,
    ``_buffer()``, ``_pending``, ``pos``, ``full``, ``buffer_size``, ``n_envs``)."""

    if TYPE_CHECKING:
        _layout: Layout
        _staged: list[dict[str, np.ndarray]]
        _pending: dict[str, np.ndarray] | None
        _forced: set[tuple[int, int]]
        _dict_obs: bool

        def _buffer(self) -> ReplayBuffer: ...

        def forced_done(self, batch_inds: np.ndarray, env_indices: np.ndarray) -> np.ndarray: ...

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
        in_rb, written = index < stored, index >= 0
        if (in_rb & written).all():
            return rb[index]
        in_rb &= written
        staged = {k: np.concatenate([row[k] for row in self._staged]) for k in self._staged[0]} \
            if self._staged else None
        rows = rb[index[in_rb]] if in_rb.any() else None
        in_staged = ~in_rb & written
        out = {}
        for name, spec in self._layout.user_fields().items():
            shape = (len(index), *(int(d or 0) for d in spec.shape))  # fixed shapes
            column = np.zeros(shape, dtype=spec.dtype)  # never written: 0
            if staged is not None:
                column[in_staged] = staged[name][index[in_staged] - stored]
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
        terminated = rows["terminated"]
        if self._forced:  # steps marked done in place (``dones[pos] = True``), not timeouts
            terminated = terminated | (self.forced_done(batch_inds, env_indices)
                                       & ~rows["truncated"])
        dones = terminated.astype(np.float32).reshape(-1, 1)
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
