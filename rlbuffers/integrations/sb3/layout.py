"""How the steps that SB3 adds map onto rlbuffers rows: the fields, and one step's rows.

Two layouts (``n_envs`` environments, observation shape ``obs_shape``):

- Interleaved (the default): step ``t`` of environment ``e`` is one rlbuffers transition; each
  step appends ``n_envs`` rows, environments in order. Fields (the names of ``rlbuffers
  convert sb3``): ``obs``, ``next_obs`` ``[*obs_shape]`` (``obs.<key>``, ``next_obs.<key>``
  for Dict observations; no ``next_obs`` with ``optimize_memory_usage``), ``action``
  ``[action_dim]``, ``reward`` float32, ``terminated`` (done and not a handled timeout) and
  ``truncated`` (a handled timeout, ``info["TimeLimit.truncated"]``), all ``()`` bool.
- Frame-stacked (``frame_stack_axis``, e.g. SB3's ``VecFrameStack``: ``obs_shape`` is
  ``(k, 84, 84)`` with axis 0, or ``(84, 84, k)`` with axis 2, ``k`` single-channel frames,
  oldest first): step ``t`` is one rlbuffers row holding all environments: ``obs``
  ``[n_envs, *obs_shape]`` declared ``stack_axis = 1 + frame_stack_axis``, so the core buffer
  stores one frame per environment per step (:mod:`rlbuffers.core.framestack`), ``next_obs``
  derived from it (``next_of``; without ``optimize_memory_usage``), ``action``
  ``[n_envs, action_dim]``, ``reward`` float32 ``[n_envs]``, ``env_terminated``,
  ``env_truncated`` bool ``[n_envs]`` (as above, per environment) and ``done`` ``()`` bool:
  some environment's episode ended at this step (or the next step's stacks restart: SB3 reset
  the environments), which is an episode end for the core buffer. Where that step was
  appended already, ``ReplayBuffer.end_episode`` ends it instead.

Why one row per step for frame stacks: the core rebuilds a stack from the frames of the
previous rows of the same episode. Interleaved rows put another environment's transition
before each one, and their episode boundaries differ; one row per step keeps each
environment's previous frame in the previous row, so the core needs no notion of streams (and
its hot paths stay as they are). The cost: when any environment's episode ends, the next step
stores the ``k - 1`` earlier frames of every environment (its stack head), about
``n_envs * (k - 1)`` frames per ended episode; and a sampled transition reads its step's
row, all environments' frames (one chunk read either way).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

from rlbuffers.integrations import require

require("stable_baselines3", "sb3")

import numpy as np  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: E402
from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape  # noqa: E402

from rlbuffers.buffer import ReplayBuffer  # noqa: E402
from rlbuffers.errors import FieldError  # noqa: E402
from rlbuffers.integrations.sb3.checks import decode_rows  # noqa: E402
from rlbuffers.spec import FieldSpec  # noqa: E402

__all__ = ["Layout", "field_name", "rows_from_json", "rows_to_json"]


def rows_to_json(rows: dict[str, np.ndarray]) -> dict[str, str]:
    """Field -> array as field -> base64 ``.npy`` text (a commit's metadata holds it)."""
    out = {}
    for name, arr in rows.items():
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        out[name] = base64.b64encode(buf.getvalue()).decode("ascii")
    return out


def rows_from_json(rows: dict[str, str], name: str = "rows") -> dict[str, np.ndarray]:
    """The inverse of :func:`rows_to_json` (no pickles).

    Raises:
        ValueError: not a dict of field -> base64 ``.npy`` text (naming ``name.<field>``).
    """
    return decode_rows(name, rows)


def field_name(prefix: str, key: str) -> str:
    """``obs`` / ``next_obs`` (``key == ""``) or ``obs.<key>`` of a Dict observation."""
    return f"{prefix}.{key}" if key else prefix


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality of two uint views of one shape (bytes compared with ``memcmp`` when
    both are contiguous, as one environment's stacks are: ~2 us for 21 KB against ~10 for
    ``(a != b).any()``)."""
    if a.flags.c_contiguous and b.flags.c_contiguous:
        return a.tobytes() == b.tobytes()
    return not bool((a != b).any())


@dataclass(frozen=True)
class Layout:
    """The rlbuffers fields of one SB3 buffer and the rows of one step.

    Args:
        obs: observation key ('' for a non-Dict space) -> (shape, dtype).
        spaces_by_key: observation key -> its gymnasium space (Discrete ones are reshaped).
        action_dim, action_dtype: as SB3's buffer stores actions.
        n_envs: environments per step. optimize_memory_usage: no stored ``next_obs``.
        stack_axis: ``frame_stack_axis`` (an axis of ``obs_shape``, >= 0) or None.
    """

    obs: dict[str, tuple[tuple[int, ...], np.dtype]]
    spaces_by_key: dict[str, spaces.Space]
    action_dim: int
    action_dtype: np.dtype
    n_envs: int
    optimize_memory_usage: bool
    stack_axis: int | None = None

    @classmethod
    def of(cls, observation_space: spaces.Space, action_space: spaces.Space, n_envs: int,
           optimize_memory_usage: bool, stack_axis: int | None = None) -> Layout:
        """The layout of an SB3 buffer with these arguments.

        Raises:
            ValueError: a ``stack_axis`` (``frame_stack_axis``) that is not an axis of a Box
            observation space's shape (negative axes count from the end).
        """
        space: Any = observation_space
        if isinstance(space, spaces.Dict):
            obs = {k: (tuple(get_obs_shape(s)), np.dtype(s.dtype)) for k, s in space.items()}
            by_key = dict(space.spaces)
        else:
            obs, by_key = {"": (tuple(get_obs_shape(space)), np.dtype(space.dtype))}, {"": space}
        if stack_axis is not None:
            ndim = len(space.shape) if isinstance(space, spaces.Box) else 0
            if (isinstance(stack_axis, bool) or not isinstance(stack_axis, int | np.integer)
                    or not -ndim <= stack_axis < ndim):
                raise ValueError(f"frame_stack_axis: expected an axis of a Box observation "
                                 f"space's shape, got {stack_axis!r} for {space}")
            stack_axis = int(stack_axis) % ndim
        action_dtype = np.dtype(SB3ReplayBuffer._maybe_cast_dtype(action_space.dtype))
        return cls(obs, by_key, get_action_dim(action_space), action_dtype, n_envs,
                   optimize_memory_usage, stack_axis)

    @property
    def rows_per_step(self) -> int:
        """rlbuffers rows one step appends: ``n_envs`` (interleaved) or 1 (frame-stacked)."""
        return self.n_envs if self.stack_axis is None else 1

    @property
    def next_of(self) -> dict[str, str]:
        """The ``next_of`` of ``ReplayBuffer.create``: ``{"next_obs": "obs"}`` when
        frame-stacked with stored next observations, else empty."""
        if self.stack_axis is None or self.optimize_memory_usage:
            return {}
        return {"next_obs": "obs"}

    def fields(self) -> dict[str, FieldSpec]:
        """The stored fields (``create``'s ``fields``)."""
        if self.stack_axis is not None:
            (shape, dtype), n = self.obs[""], self.n_envs
            return {"obs": FieldSpec((n, *shape), dtype, stack_axis=1 + self.stack_axis),
                    "action": FieldSpec((n, self.action_dim), self.action_dtype),
                    "reward": FieldSpec((n,), "float32"),
                    "env_terminated": FieldSpec((n,), "bool"),
                    "env_truncated": FieldSpec((n,), "bool"), "done": FieldSpec((), "bool")}
        prefixes = ("obs",) if self.optimize_memory_usage else ("obs", "next_obs")
        fields = {field_name(p, k): FieldSpec(shape, dtype)
                  for p in prefixes for k, (shape, dtype) in self.obs.items()}
        return {**fields, "action": FieldSpec((self.action_dim,), self.action_dtype),
                "reward": FieldSpec((), "float32"), "terminated": FieldSpec((), "bool"),
                "truncated": FieldSpec((), "bool")}

    def user_fields(self) -> dict[str, FieldSpec]:
        """The fields ``extend`` takes and reads return (the derived ``next_obs`` included)."""
        fields = self.fields()
        return {**fields, **{n: fields[src] for n, src in self.next_of.items()}}

    def obs_rows(self, obs: Any, prefix: str) -> dict[str, np.ndarray]:
        """``{field: [n_envs, *shape]}`` of one step's observations (numpy assignment
        semantics, as SB3's ``self.observations[pos] = obs``)."""
        rows = {}
        for key, (shape, dtype) in self.obs.items():
            value = np.asarray(obs[key] if key else obs)
            if isinstance(self.spaces_by_key[key], spaces.Discrete):
                value = value.reshape((self.n_envs, *shape))
            # one copy, C order whatever the input's strides (VecTransposeImage gives a
            # transposed view: keeping its layout made every later frame comparison strided)
            row = np.empty((self.n_envs, *shape), dtype=dtype)
            row[...] = value
            rows[field_name(prefix, key)] = row
        return rows

    def step_rows(self, row: dict[str, np.ndarray], action: Any, reward: Any,
                  done: np.ndarray, timeout: np.ndarray) -> dict[str, np.ndarray]:
        """The rows one step appends (``[rows_per_step, ...]``), from its observation rows
        ``row`` (:meth:`obs_rows`), ``action``, ``reward``, ``done`` and ``timeout``
        (``[n_envs]``)."""
        n = self.n_envs
        row = dict(row)
        row["action"] = np.asarray(action).reshape((n, self.action_dim)).astype(
            self.action_dtype)  # astype copies: the caller may reuse its array
        row["reward"] = np.empty(n, dtype=np.float32)
        row["reward"][...] = reward
        terminated, truncated = (done == 1.0) & ~timeout, timeout
        if self.stack_axis is None:
            row["terminated"], row["truncated"] = terminated, truncated
            return row
        row["env_terminated"], row["env_truncated"] = terminated, truncated
        out = {k: v[None] for k, v in row.items()}
        out["done"] = np.array([bool((done == 1.0).any())])
        return out

    def select(self, rows: dict[str, np.ndarray], env_indices: np.ndarray) -> dict[str,
                                                                                  np.ndarray]:
        """Gathered rows -> the sampled transitions' fields ``obs``, ``next_obs`` (if stored
        or derived), ``action``, ``reward``, ``terminated``, ``truncated`` (``[N, ...]``):
        frame-stacked rows hold every environment, keep environment ``env_indices[i]``."""
        if self.stack_axis is None:
            return rows
        pick = np.arange(len(env_indices)), env_indices
        names = {"env_terminated": "terminated", "env_truncated": "truncated"}
        return {names.get(k, k): v[pick] for k, v in rows.items() if k != "done"}

    def _frames(self, a: np.ndarray) -> np.ndarray:
        """``[1, n_envs, *obs_shape]`` -> ``[n_envs, k, *frame]``, as bytes-comparable uints."""
        a = a[0]
        if self.stack_axis:  # axis 0 (VecTransposeImage's [k, 84, 84]) is there already
            a = np.moveaxis(a, 1 + self.stack_axis, 1)
        return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a

    def check_shift(self, row: dict[str, np.ndarray]) -> None:
        """Frame-stacked with a derived ``next_obs``: each environment's ``next_obs`` is its
        ``obs`` shifted by one frame plus a new one, else FieldError (nothing is stored)."""
        if "next_obs" not in self.next_of:
            return
        f, g = self._frames(row["obs"]), self._frames(row["next_obs"])
        bad = (g[:, :-1] != f[:, 1:]).reshape(self.n_envs, -1).any(axis=1)
        if bad.any():
            raise FieldError(
                f"next_obs: environment {int(np.argmax(bad))}'s next observation is not its "
                f"observation shifted by one frame along frame_stack_axis={self.stack_axis} "
                "(frames 1..k-1 of obs must be frames 0..k-2 of next_obs; at an episode end "
                "pass the final observation, as SB3's terminal_observation, not the reset one)")

    def continues(self, previous: dict[str, np.ndarray], row: dict[str, np.ndarray]) -> bool:
        """Whether step ``row`` continues step ``previous`` (both ``[1, ...]`` rows of
        :meth:`step_rows`, frame-stacked) as the core buffer requires within an episode:
        every environment's stack is the previous one shifted by one frame, and equals the
        previous ``next_obs`` where one is stored. True after a step that ended an episode."""
        if bool(previous["done"][0]):
            return True
        f, p = self._frames(row["obs"]), self._frames(previous["obs"])
        if not _equal(f[:, :-1], p[:, 1:]):
            return False
        return "next_obs" not in previous or _equal(
            f[:, -1], self._frames(previous["next_obs"])[:, -1])

    def check_step(self, step: dict[str, np.ndarray], staged: list[dict[str, np.ndarray]],
                   rb: ReplayBuffer) -> None:
        """Frame-stacked: refuse a step (:meth:`step_rows`) whose ``next_obs`` is not its
        ``obs`` shifted; if it does not continue the previous step (environments reset
        outside an episode end, as a second ``learn(reset_num_timesteps=True)`` does), end
        that step's episode: set its ``done`` if it is staged (the newest of ``staged``), else
        ``rb.end_episode()``.

        Raises:
            FieldError: a ``next_obs`` not shifted (nothing changes).
        """
        self.check_shift(step)
        if staged:
            if not self.continues(staged[-1], step):
                staged[-1]["done"] = np.ones_like(staged[-1]["done"])
        elif len(rb) and not self.continues(
                {k: np.asarray(v)[None] for k, v in rb[-1].items()}, step):
            rb.end_episode()
