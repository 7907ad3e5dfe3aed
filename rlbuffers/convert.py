"""Convert a Stable-Baselines3 replay-buffer pickle into an rlbuffers :class:`ReplayBuffer`.

:func:`convert_sb3` reads the pickle with :func:`~rlbuffers.sb3_pickle.load_sb3_pickle`
(memory-mapped, restricted unpickler, no SB3 needed: see :mod:`rlbuffers.sb3_pickle`) and
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
from rlbuffers.compression import DEFAULT_CODEC
from rlbuffers.errors import BufferExistsError
from rlbuffers.inert_pickle import MEMORY_BUDGET
from rlbuffers.sb3_pickle import ConvertError, SB3Buffer, load_sb3_pickle, obs_arrays
from rlbuffers.spec import FieldSpec

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


def _take(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]`` flattened to ``[len(rows) * n_envs, ...]``; a view when rows are a range."""
    part = a[rows[0] : rows[-1] + 1] if rows[-1] - rows[0] + 1 == len(rows) else a[rows]
    return part.reshape(len(rows) * a.shape[1], *a.shape[2:])


def sb3_batches(b: SB3Buffer, *, batch_bytes: int = BATCH_BYTES) -> Iterator[dict[str, Any]]:
    """Batches ``{field: [B, *shape]}`` of the SB3 buffer's transitions, oldest first.

    Transitions are ordered by SB3 time step, oldest first, and within a step by environment
    (``0 .. n_envs-1``), the order SB3 stored them. Fixed observation arrays are views of the
    (memory-mapped) pickle where possible; at most ``batch_bytes`` raw bytes per batch.
    """
    obs = obs_arrays(b.observations, "obs")
    nxt = None if b.next_observations is None else obs_arrays(b.next_observations, "next_obs")
    row_bytes = b.n_envs * sum(a[0, 0].nbytes * 2 for a in obs.values()) + 64 * b.n_envs
    env_ids = np.arange(b.n_envs, dtype=np.int64)
    for rows in _runs(b.time_order(), max(1, batch_bytes // row_bytes)):
        out: dict[str, Any] = {k: _take(a, rows) for k, a in obs.items()}
        if nxt is None:
            succ = (rows + 1) % b.buffer_size
            out.update({"next_" + k: _take(a, succ) for k, a in obs.items()})
        else:
            out.update({k: _take(a, rows) for k, a in nxt.items()})
        act = _take(b.actions, rows)
        out["action"] = act.reshape(len(act)) if b.discrete_action else act
        out["reward"] = _take(b.rewards, rows).astype(np.float32)
        done = _take(b.dones, rows) != 0
        timeout = _take(b.timeouts, rows) != 0
        out["terminated"], out["truncated"] = done & ~timeout, timeout
        if b.n_envs > 1:
            out["env"] = np.tile(env_ids, len(rows))
        yield out


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

    Returns:
        the new buffer, open read/write, committed once (commit 1) with
        ``metadata["converted_from"]`` describing the source.

    Raises:
        FileNotFoundError: no such pickle. ConvertError: not an SB3 replay-buffer pickle.
        BufferExistsError: ``out_path`` is not empty and ``overwrite`` is False, or it holds
        something other than an rlbuffers buffer (checked before the pickle is read).
        ValueError: ``out_path`` is a URL.
    """
    if "://" in os.fspath(out_path):
        raise ValueError(f"out_path: expected a local directory, got the URL {out_path!s} "
                         "(convert locally, then copy the buffer)")
    out = Path(out_path)
    os.stat(pickle_path)  # a missing pickle is named first (FileNotFoundError)
    _check_out(out, overwrite)
    b = load_sb3_pickle(pickle_path, memory_budget=memory_budget)
    total = len(b.time_order()) * b.n_envs
    tmp = out.parent / f".{out.name}.converting-{uuid.uuid4().hex[:12]}"
    log.info("converting %s (%s, %d transitions, %d bytes mapped) into %s (built in %s)",
             pickle_path, b.kind, total, b.mapped_bytes, out, tmp)
    try:
        buf = ReplayBuffer.create(
            tmp,
            capacity=capacity or b.buffer_size * b.n_envs,
            fields=sb3_fields(b),
            chunk_transitions=chunk_transitions,
            codec=codec,
            seed=seed,
        )
        try:
            done = 0
            for batch in sb3_batches(b):
                buf.extend(batch)
                done += len(batch["reward"])
                if progress is not None:
                    progress(done, total)
            meta = {"converted_from": {
                "format": "stable-baselines3", "class": b.kind, "path": str(pickle_path),
                "n_envs": b.n_envs, "buffer_size": b.buffer_size, "pos": b.pos,
                "full": b.full, "optimize_memory_usage": b.next_observations is None,
                "transitions": total, **{k: float(v) for k, v in b.extra.items()},
            }}
            buf.save(metadata=meta)
        finally:
            buf.close()
        _swap_in(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ReplayBuffer.open(out, mode="r+")


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
