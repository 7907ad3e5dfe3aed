"""Convert a Stable-Baselines3 replay-buffer pickle into an rlbuffers :class:`ReplayBuffer`.

:func:`convert_sb3` reads the pickle with
:func:`~rlbuffers.integrations.sb3.pickle_reader.load_sb3_pickle`
(memory-mapped, restricted unpickler, no SB3 needed: see
:mod:`rlbuffers.integrations.sb3.pickle_reader`) and
writes its transitions oldest first into a new buffer, in bounded batches, built beside the
output and renamed into place once complete. With ``frame_stack_axis`` the observations
(frame stacks, e.g. SB3's ``VecFrameStack``) are stored one frame per transition.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.buffer import ReplayBuffer
from rlbuffers.errors import BufferExistsError
from rlbuffers.integrations.sb3.inert_pickle import MEMORY_BUDGET
from rlbuffers.integrations.sb3.pickle_reader import (
    ConvertError,
    SB3Buffer,
    load_sb3_pickle,
    obs_arrays,
)
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.compression import DEFAULT_CODEC

__all__ = ["BATCH_BYTES", "ConvertError", "SB3Buffer", "convert_sb3", "load_sb3_pickle",
           "sb3_batches", "sb3_fields"]

log = logging.getLogger(__name__)

#: Raw bytes of one batch of transitions written to the buffer (all fields together).
BATCH_BYTES = 32 * 2**20


# -- writing the rlbuffers buffer ----------------------------------------------------------------
def sb3_fields(b: SB3Buffer) -> dict[str, FieldSpec]:
    """The rlbuffers fields a converted SB3 buffer gets.

    ``obs``/``next_obs`` (``obs.<key>``/``next_obs.<key>`` for dict observations) with the
    stored per-env shape and dtype; ``action`` (scalar for ``Discrete``, else ``(action_dim,)``);
    ``reward`` float32; ``terminated`` and ``truncated`` bool; ``env`` int64 (which of the
    ``n_envs`` environments) when ``n_envs > 1``.
    """
    fields: dict[str, FieldSpec] = {}
    for prefix in ("obs", "next_obs"):
        for name, a in obs_arrays(b.observations, prefix).items():
            fields[name] = FieldSpec(a.shape[2:], a.dtype)
    act_shape = () if b.discrete_action else b.actions.shape[2:]
    fields.update(
        action=FieldSpec(act_shape, b.actions.dtype),
        reward=FieldSpec((), "float32"),
        terminated=FieldSpec((), "bool"),
        truncated=FieldSpec((), "bool"),
    )
    if b.n_envs > 1:
        fields["env"] = FieldSpec((), "int64")
    return fields


def _runs(rows: np.ndarray, max_rows: int) -> Iterator[np.ndarray]:
    """Split ring rows into pieces of consecutive rows, each at most ``max_rows`` long."""
    start = 0
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    for stop in [*breaks.tolist(), len(rows)]:
        for a in range(start, stop, max_rows):
            yield rows[a : min(a + max_rows, stop)]
        start = stop


def _take(a: np.ndarray, rows: np.ndarray, env: int | None = None) -> np.ndarray:
    """``a[rows]`` flattened to ``[len(rows) * n_envs, ...]`` (``a[rows, env]`` with ``env``);
    a view when rows are a range."""
    part = a[rows[0] : rows[-1] + 1] if rows[-1] - rows[0] + 1 == len(rows) else a[rows]
    if env is not None:
        return part[:, env]
    return part.reshape(len(rows) * a.shape[1], *a.shape[2:])


def sb3_batches(b: SB3Buffer, *, batch_bytes: int = BATCH_BYTES,
                env: int | None = None) -> Iterator[dict[str, Any]]:
    """Batches ``{field: [B, *shape]}`` of the SB3 buffer's transitions, oldest first.

    Transitions are ordered by SB3 time step, oldest first, and within a step by environment
    (``0 .. n_envs-1``), the order SB3 stored them; with ``env``, only that environment's.
    Fixed observation arrays are views of the (memory-mapped) pickle where possible; at most
    ``batch_bytes`` raw bytes per batch.
    """
    obs = obs_arrays(b.observations, "obs")
    nxt = None if b.next_observations is None else obs_arrays(b.next_observations, "next_obs")
    envs = b.n_envs if env is None else 1
    row_bytes = envs * sum(a[0, 0].nbytes * 2 for a in obs.values()) + 64 * envs
    env_ids = np.arange(b.n_envs, dtype=np.int64) if env is None else np.array([env])
    for rows in _runs(b.time_order(), max(1, batch_bytes // row_bytes)):
        out: dict[str, Any] = {k: _take(a, rows, env) for k, a in obs.items()}
        if nxt is None:
            succ = (rows + 1) % b.buffer_size
            out.update({"next_" + k: _take(a, succ, env) for k, a in obs.items()})
        else:
            out.update({k: _take(a, rows, env) for k, a in nxt.items()})
        act = _take(b.actions, rows, env)
        out["action"] = act.reshape(len(act)) if b.discrete_action else act
        out["reward"] = _take(b.rewards, rows, env).astype(np.float32)
        done = _take(b.dones, rows, env) != 0
        timeout = _take(b.timeouts, rows, env) != 0
        out["terminated"], out["truncated"] = done & ~timeout, timeout
        if b.n_envs > 1:
            out["env"] = np.tile(env_ids, len(rows))
        yield out


def _bits(a: np.ndarray) -> np.ndarray:
    """``a`` as unsigned integers of its item size: equality is bit equality (NaN, -0.0)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _restarts(batch: dict[str, Any], axis: int, before: dict[str, Any] | None) -> list[int]:
    """Rows ``j`` of ``batch`` (one environment's, oldest first) whose stack does not
    continue row ``j - 1``'s (``before``: the previous batch's last row) although that one
    did not end its episode: where SB3 reset the environments outside an episode end (a
    second ``learn(reset_num_timesteps=True)``)."""
    rows = {k: batch[k] for k in ("obs", "next_obs", "terminated", "truncated")}
    if before is not None:
        rows = {k: np.concatenate([before[k][-1:], v]) for k, v in rows.items()}
    f = _bits(np.moveaxis(rows["obs"], 1 + axis, 1))
    g = _bits(np.moveaxis(rows["next_obs"], 1 + axis, 1))
    if len(f) < 2:
        return []
    same = ((f[1:, :-1] == f[:-1, 1:]).reshape(len(f) - 1, -1).all(axis=1)
            & (f[1:, -1] == g[:-1, -1]).reshape(len(f) - 1, -1).all(axis=1))
    ended = rows["terminated"][:-1] | rows["truncated"][:-1]
    shift = 0 if before is not None else 1
    return (np.flatnonzero(~same & ~ended) + shift).tolist()


def _extend_stacked(buf: ReplayBuffer, b: SB3Buffer, axis: int,
                    progress: Callable[[int], None]) -> None:
    """Each environment's transitions in turn, oldest first, into a buffer whose ``obs`` is
    stacked along ``axis``: a stream's previous frame is then the previous row. The episode
    open at the end of a stream, and one that SB3 restarted mid-way, end there
    (``ReplayBuffer.end_episode``)."""
    for env in range(b.n_envs):
        before = None
        for batch in sb3_batches(b, env=env):
            start = 0
            for cut in _restarts(batch, axis, before):
                if cut > start:
                    buf.extend({k: v[start:cut] for k, v in batch.items()})
                buf.end_episode()
                start = cut
            buf.extend({k: v[start:] for k, v in batch.items()})
            before = batch
            progress(len(batch["reward"]))
        buf.end_episode()


def convert_sb3(
    pickle_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    capacity: int | None = None,
    chunk_transitions: int | None = None,
    codec: str | Mapping[str, str] = DEFAULT_CODEC,
    seed: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    memory_budget: int = MEMORY_BUDGET,
    frame_stack_axis: int | None = None,
) -> ReplayBuffer:
    """Convert an SB3 replay-buffer pickle into a new rlbuffers buffer at ``out_path``.

    The buffer gets the fields of :func:`sb3_fields`; transitions go in oldest first (SB3 time
    step, then environment), with ``terminated = dones & ~timeouts`` and
    ``truncated = timeouts``. With ``optimize_memory_usage``, ``next_obs`` is the next row of
    SB3's observations, and once SB3's ring was full its oldest row (overwritten) is dropped.
    SB3 draws samples with numpy's global RNG, so there is no sampler state to carry over; the
    new buffer is uniform, seeded with ``seed``. Memory: see the module docstring (bounded for
    protocol-5 pickles, which SB3 writes).

    The new buffer is built in a temporary directory beside ``out_path``
    (``.<name>.converting-<id>``) and renamed into place once complete, so a conversion that
    fails or is killed never leaves a partial buffer at ``out_path``, and never removes what
    was there: with ``overwrite``, an existing buffer is replaced only after the new one is
    complete (it is renamed aside, the new one renamed in, then the old one deleted).

    Note: with ``n_envs > 1`` the environments' transitions interleave (as in SB3), so episode
    numbers (used by ``SequenceSampler``) mix environments; the ``env`` field tells them apart.

    Args:
        pickle_path: the file ``model.save_replay_buffer`` wrote (plain or gzip-compressed).
        out_path: directory of the new buffer (a local path).
        capacity: ring size in transitions; default SB3's ``buffer_size * n_envs``. When the
            SB3 buffer holds more, only the newest ``capacity`` stay.
        chunk_transitions, codec, seed: as in :meth:`ReplayBuffer.create`.
        overwrite: replace ``out_path`` if it holds an rlbuffers buffer (``manifest.json``);
            a directory holding anything else is never replaced (or deleted).
        progress: called as ``progress(done, total)`` (transitions) after every batch.
        memory_budget: bytes the pickle may make the load hold (see :func:`load_sb3_pickle`).
        frame_stack_axis: the axis of the per-env observation shape along which each
            observation is a stack of ``k`` single-channel frames, oldest first (SB3's
            ``VecFrameStack``: ``(k, 84, 84)`` -> 0, ``(84, 84, k)`` -> 2 or -1), or None.
            With it ``obs`` is ``FieldSpec(shape, dtype, stack_axis=frame_stack_axis)`` and
            ``next_obs`` is derived (``next_of``): one frame stored per transition, about
            ``1 / 2k`` of the observation bytes (:mod:`rlbuffers.core.framestack`). The
            transitions then go in environment by environment (each oldest first), so each
            stack follows its own environment's previous one; episodes left open at the end
            of an environment's transitions, or restarted without an episode end, are ended
            there (``ReplayBuffer.end_episode``).

    Returns:
        the new buffer, open read/write, committed once (commit 1) with
        ``metadata["converted_from"]`` describing the source.

    Raises:
        FileNotFoundError: no such pickle. ConvertError: not an SB3 replay-buffer pickle.
        BufferExistsError: ``out_path`` is not empty and ``overwrite`` is False, or it holds
        something other than an rlbuffers buffer (checked before the pickle is read).
        ValueError: ``out_path`` is a URL; with ``frame_stack_axis``: an axis outside the
        observation shape, Dict observations, ``optimize_memory_usage`` (SB3 kept no
        next observation of an episode's last step), or with ``n_envs > 1`` a ``capacity``
        below the transitions held (the newest would not be the last written).
        FieldError: with ``frame_stack_axis``, observations that are not stacks of
        consecutive frames (see :mod:`rlbuffers.core.framestack`).
    """
    if "://" in os.fspath(out_path):
        raise ValueError(f"out_path: expected a local directory, got the URL {out_path!s} "
                         "(convert locally, then copy the buffer)")
    out = Path(out_path)
    os.stat(pickle_path)  # a missing pickle is named first (FileNotFoundError)
    _check_out(out, overwrite)
    b = load_sb3_pickle(pickle_path, memory_budget=memory_budget)
    total = len(b.time_order()) * b.n_envs
    fields, next_of = sb3_fields(b), None
    if frame_stack_axis is not None:
        frame_stack_axis = _check_stack_axis(b, frame_stack_axis, capacity, total)
        obs = fields.pop("obs")
        del fields["next_obs"]
        fields = {"obs": FieldSpec(obs.shape, obs.dtype, stack_axis=frame_stack_axis),
                  **fields}
        next_of = {"next_obs": "obs"}
    tmp = out.parent / f".{out.name}.converting-{uuid.uuid4().hex[:12]}"
    log.info("converting %s (%s, %d transitions, %d bytes mapped) into %s (built in %s)",
             pickle_path, b.kind, total, b.mapped_bytes, out, tmp)
    try:
        buf = ReplayBuffer.create(
            tmp,
            capacity=capacity or b.buffer_size * b.n_envs,
            fields=fields,
            next_of=next_of,
            chunk_transitions=chunk_transitions,
            codec=codec,
            seed=seed,
        )
        try:
            done = 0

            def advance(n: int) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(done, total)

            if frame_stack_axis is not None:
                _extend_stacked(buf, b, frame_stack_axis, advance)
            for batch in sb3_batches(b) if frame_stack_axis is None else ():
                buf.extend(batch)
                advance(len(batch["reward"]))
            meta = {"converted_from": {
                "format": "stable-baselines3", "class": b.kind, "path": str(pickle_path),
                "n_envs": b.n_envs, "buffer_size": b.buffer_size, "pos": b.pos,
                "full": b.full, "optimize_memory_usage": b.next_observations is None,
                "transitions": total, "frame_stack_axis": frame_stack_axis,
                **{k: float(v) for k, v in b.extra.items()},
            }}
            buf.save(metadata=meta)
        finally:
            buf.close()
        _swap_in(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ReplayBuffer.open(out, mode="r+")


def _check_stack_axis(b: SB3Buffer, axis: Any, capacity: int | None, total: int) -> int:
    """``frame_stack_axis`` as an axis >= 0 of the per-env observation shape.

    Raises:
        ValueError: see :func:`convert_sb3`.
    """
    if not isinstance(b.observations, np.ndarray):
        raise ValueError("frame_stack_axis: expected a Box observation space, got Dict "
                         f"observations (keys {sorted(b.observations)})")
    if b.next_observations is None:
        raise ValueError("frame_stack_axis: the SB3 buffer used optimize_memory_usage, so it "
                         "holds no next observation of an episode's last step to store")
    ndim = b.observations.ndim - 2
    if (isinstance(axis, bool) or not isinstance(axis, int | np.integer)
            or not -ndim <= axis < ndim):
        raise ValueError(f"frame_stack_axis: expected an axis of the observation shape "
                         f"{b.observations.shape[2:]}, got {axis!r}")
    if b.n_envs > 1 and capacity is not None and capacity < total:
        raise ValueError(f"capacity: with frame_stack_axis and n_envs={b.n_envs} expected at "
                         f"least the {total} transitions held (written environment by "
                         f"environment), got {capacity}")
    return int(axis) % ndim


#: What ``ReplayBuffer.create`` writes at the root of every buffer.
_BUFFER_MARK = "manifest.json"


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is neither absent, an empty directory, nor (with ``overwrite``)
    an rlbuffers buffer.

    Raises:
        BufferExistsError: as above (what is there named).
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise BufferExistsError(f"{out}: expected a directory for the new buffer, got a file")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise BufferExistsError(f"{out}: already exists and is not empty "
                                "(pass overwrite=True / --overwrite to replace a buffer)")
    if _BUFFER_MARK not in entries:
        shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise BufferExistsError(
            f"{out}: overwrite replaces only an rlbuffers buffer (a directory with "
            f"{_BUFFER_MARK}) or an empty directory, got a directory holding {shown}")


def _swap_in(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the complete buffer ``tmp`` to ``out``; a buffer already at ``out`` (checked
    again: nothing else) is renamed aside first and deleted only after the new one is in."""
    _check_out(out, overwrite)
    old = None
    if out.exists() and any(out.iterdir()):
        old = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:12]}"
        os.rename(out, old)
    elif out.exists():
        out.rmdir()  # empty: rename() would replace it, but not on every platform
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
