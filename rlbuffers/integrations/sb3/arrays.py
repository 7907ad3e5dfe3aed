"""SB3's buffer arrays (``observations``, ``next_observations``, ``actions``, ``rewards``,
``dones``, ``timeouts``) of a :class:`~rlbuffers.integrations.sb3.buffer.ZarrReplayBuffer`, in
SB3's layout ``[buffer_size, n_envs, *shape]``, read from the working tier.

The working tier keeps each field as one ``[capacity, *shape]`` file, rows in slot order
(``slot = transition id % capacity``). One SB3 step appends ``n_envs`` rows (interleaved) or one
row holding every environment (frame-stacked), so step ``t`` of SB3's ring is slot block ``t``
of the file as long as SB3's ``pos`` counts the steps added (no ``reset()`` since): the arrays
are then read-only views of the memory-mapped files (no copy; the OS page cache holds what is
read). After ``reset()`` (SB3's ``pos`` restarts, the rows stay where they are) they are
read-only copies rolled into SB3's order. Rows never written read as zeros, as SB3's
``np.zeros`` arrays do.

``dones`` and ``timeouts`` are computed (float32 copies): ``dones`` is 1 where a step ended
its environment's episode (terminated or truncated), ``timeouts`` where a handled timeout
ended it. Writing ``dones`` in place (SB3 does ``replay_buffer.dones[pos] = True`` when
``learn(reset_num_timesteps=True)`` runs again with ``optimize_memory_usage``) marks those steps
done for sampling; the marks are kept by ``commit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rlbuffers.integrations.sb3.layout import Layout, field_name

if TYPE_CHECKING:
    from stable_baselines3.common.buffers import ReplayBuffer as _Base

    from rlbuffers.buffer import ReplayBuffer
else:
    _Base = object

__all__ = ["ArrayViews", "DonesArray"]


class DonesArray(np.ndarray):
    """SB3's ``dones`` (float32 ``[buffer_size, n_envs]``, a copy); assigning nonzero values
    marks those steps done in the buffer (see :meth:`ArrayViews.mark_done`).

    Raises:
        ValueError: (on assignment) clearing a stored episode end (stored steps keep theirs).
    """

    _owner: Any = None

    def __setitem__(self, key: Any, value: Any) -> None:
        before = np.array(self, dtype=np.float32)
        after = before.copy()
        after[key] = value
        owner = self._owner
        if owner is not None:
            owner.mark_done(after != 0, before != 0)
        super().__setitem__(key, value)


class ArrayViews(_Base):
    """The SB3 array attributes of ``_ZarrBuffer`` (a mixin: it uses ``_layout``,
    ``storage``, ``pos``, ``buffer_size``, ``n_envs``, ``_forced``)."""

    if TYPE_CHECKING:
        _layout: Layout
        _staged: list[dict[str, np.ndarray]]
        _forced: set[tuple[int, int]]

        def _buffer(self) -> ReplayBuffer: ...

        @property
        def storage(self) -> ReplayBuffer: ...

    # -- helpers ----------------------------------------------------------------------------
    def _column(self, name: str) -> np.ndarray:
        """Field ``name`` of the working tier as SB3's ``[buffer_size, n_envs, *shape]``
        (read-only: a view when SB3's ``pos`` counts the steps added, else a rolled copy)."""
        rb: Any = self.storage
        view = rb._storage.working.columns[name].view.view(np.ndarray)
        bs, n = self.buffer_size, self.n_envs
        per_step = self._layout.rows_per_step
        stacked = self._layout.stack_axis is not None
        arr = view.reshape((bs, n, *view.shape[2 if stacked else 1:]))
        shift = (rb.total_added // per_step - self.pos) % bs
        if shift:
            arr = np.roll(arr, -shift, axis=0)
        arr.flags.writeable = False
        return arr

    def _obs_column(self, prefix: str, attribute: str) -> Any:
        layout = self._layout
        if layout.stack_axis is not None:
            raise AttributeError(
                f"{attribute}: {type(self).__name__}(frame_stack_axis={layout.stack_axis}) "
                "stores one frame per environment per step, not SB3's "
                "[buffer_size, n_envs, *obs_shape] array; read stacks with sample() or "
                "buffer.storage[positions] (rebuilt, bit-identical)")
        keys = list(layout.obs)
        if keys == [""]:
            return self._column(field_name(prefix, ""))
        return {k: self._column(field_name(prefix, k)) for k in keys}

    # -- SB3's arrays ---------------------------------------------------------------------------
    @property
    def observations(self) -> Any:  # type: ignore[override]
        """``[buffer_size, n_envs, *obs_shape]`` read-only (Dict: per key); with
        ``optimize_memory_usage`` step ``t + 1``'s observation is step ``t``'s next one.

        Raises:
            AttributeError: frame-stacked storage (``frame_stack_axis``): use ``sample``.
        """
        return self._obs_column("obs", "observations")

    @property
    def next_observations(self) -> Any:  # type: ignore[override]
        """``[buffer_size, n_envs, *obs_shape]`` read-only (Dict: per key).

        Raises:
            AttributeError: ``optimize_memory_usage`` (SB3 has no such array then: read
            ``observations``), or frame-stacked storage (use ``sample``).
        """
        if self.optimize_memory_usage:
            raise AttributeError(
                "next_observations: with optimize_memory_usage=True there is no such array "
                "(as in SB3): step t's next observation is observations[t + 1]")
        return self._obs_column("next_obs", "next_observations")

    @property
    def actions(self) -> np.ndarray:  # type: ignore[override]
        """``[buffer_size, n_envs, action_dim]`` read-only, SB3's action dtype."""
        return self._column("action")

    @property
    def rewards(self) -> np.ndarray:  # type: ignore[override]
        """float32 ``[buffer_size, n_envs]`` read-only."""
        return self._column("reward")

    def _flags(self) -> tuple[np.ndarray, np.ndarray]:
        stacked = self._layout.stack_axis is not None
        terminated = self._column("env_terminated" if stacked else "terminated")
        truncated = self._column("env_truncated" if stacked else "truncated")
        return terminated, truncated

    @property
    def timeouts(self) -> np.ndarray:  # type: ignore[override]
        """float32 ``[buffer_size, n_envs]`` (a read-only copy): 1 where a handled timeout
        (``info["TimeLimit.truncated"]``) ended the episode."""
        out = self._flags()[1].astype(np.float32)
        out.flags.writeable = False
        return out

    @property
    def dones(self) -> np.ndarray:  # type: ignore[override]
        """float32 ``[buffer_size, n_envs]`` (a copy, a :class:`DonesArray`): 1 where the step
        ended its environment's episode (``done`` as SB3 stores it). Assigning 1 marks steps
        done for sampling (what SB3's ``learn`` does to the newest step)."""
        terminated, truncated = self._flags()
        done = terminated | truncated
        forced = self._forced_mask()
        out = (done | forced).astype(np.float32).view(DonesArray)
        out._owner = self
        return out

    # -- marks of steps done in place ---------------------------------------------------------
    def _step_ids(self, batch_inds: np.ndarray) -> np.ndarray:
        """Step ids (0 = the first step ever added) of SB3 indices ``batch_inds``."""
        rb_rows = len(self._staged) * self._layout.rows_per_step
        total = (self._buffer().total_added + rb_rows) // self._layout.rows_per_step
        age = (self.pos - 1 - np.asarray(batch_inds, dtype=np.int64)) % self.buffer_size
        return total - 1 - age

    def _forced_mask(self) -> np.ndarray:
        bs, n = self.buffer_size, self.n_envs
        mask = np.zeros((bs, n), dtype=bool)
        if self._forced:
            ids = self._step_ids(np.arange(bs))
            for step, env in self._forced:
                mask[ids == step, env] = True
        return mask

    def forced_done(self, batch_inds: np.ndarray, env_indices: np.ndarray) -> np.ndarray:
        """bool[N]: which sampled transitions were marked done in place."""
        if not self._forced:
            return np.zeros(len(batch_inds), dtype=bool)
        ids = self._step_ids(batch_inds)
        return np.array([(int(s), int(e)) in self._forced
                         for s, e in zip(ids, env_indices, strict=True)], dtype=bool)

    def mark_done(self, after: np.ndarray, before: np.ndarray) -> None:
        """Record the steps ``after`` marks done and ``before`` did not (bool
        ``[buffer_size, n_envs]``): sampled with done = 1 (unless a handled timeout).

        Raises:
            ValueError: ``after`` clears a stored episode end.
        """
        terminated, truncated = self._flags()
        ids = self._step_ids(np.arange(self.buffer_size))
        for t, e in zip(*np.nonzero(before & ~after), strict=True):
            if (terminated[t, e] or truncated[t, e]) or (int(ids[t]), int(e)) not in \
                    self._forced:
                raise ValueError(f"dones[{t}, {e}]: expected 1 (a stored episode end "
                                 "cannot be cleared), got 0")
            self._forced.discard((int(ids[t]), int(e)))
        for t, e in zip(*np.nonzero(after & ~before), strict=True):
            if ids[t] >= 0:
                self._forced.add((int(ids[t]), int(e)))

    def _live_forced(self) -> list[list[int]]:
        """The marks of steps still stored, as JSON (``[[step, env], ...]``)."""
        if not self._forced:
            return []
        oldest = int(self._step_ids(np.array([self.pos]))[0])
        if not self.full:
            oldest = int(self._step_ids(np.array([0]))[0])
        return sorted([s, e] for s, e in self._forced if s >= oldest)
