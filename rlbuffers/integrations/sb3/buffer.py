"""Stable-Baselines3 replay buffers stored in an rlbuffers :class:`~rlbuffers.ReplayBuffer`.

:class:`ZarrReplayBuffer` and :class:`ZarrDictReplayBuffer` subclass SB3's ``ReplayBuffer`` and
``DictReplayBuffer`` with the same constructor (plus ``path``) and the same ``add`` / ``sample``
contract, but keep the transitions on disk (``add`` stages a few steps in RAM and appends them
to the working tier, ``commit`` saves incrementally) instead of in numpy arrays of
``buffer_size`` rows in RAM.

Layout (:mod:`rlbuffers.integrations.sb3.layout`): each ``add`` appends ``R`` rows, ``R =
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

from rlbuffers.buffer import ReplayBuffer, SaveReport  # noqa: E402
from rlbuffers.errors import FieldError  # noqa: E402
from rlbuffers.integrations.sb3.arrays import ArrayViews  # noqa: E402
from rlbuffers.integrations.sb3.checks import (  # noqa: E402
    check_int,
    check_path,
    check_pending,
    check_state,
    show,
)
from rlbuffers.integrations.sb3.layout import (  # noqa: E402
    Layout,
    field_name,
    rows_to_json,
)
from rlbuffers.integrations.sb3.pointer import (  # noqa: E402
    PointerPickling,
    hold,
    sb3_context,
)
from rlbuffers.integrations.sb3.rng import rng_state  # noqa: E402
from rlbuffers.integrations.sb3.sample import Sampling  # noqa: E402
from rlbuffers.storage.compression import DEFAULT_CODEC  # noqa: E402
from rlbuffers.storage.saver import SaveFuture  # noqa: E402

__all__ = ["META_KEY", "ZarrDictReplayBuffer", "ZarrReplayBuffer"]

log = logging.getLogger(__name__)

#: ``add`` stages at most this many steps, and about this many bytes, before appending them
#: to the rlbuffers buffer in one ``extend`` (~80x faster than one ``extend`` per step for
#: small transitions); sampling reads staged steps from RAM, commits append them first.
WRITE_BATCH_STEPS, WRITE_BATCH_BYTES = 64, 4 << 20

#: Key of the commit metadata that holds the SB3 buffer's state (``state_dict()``).
META_KEY = "sb3"


class _ZarrBuffer(Sampling, ArrayViews, PointerPickling, SB3ReplayBuffer):
    """What ZarrReplayBuffer and ZarrDictReplayBuffer share (before DictReplayBuffer in the
    latter's MRO, so its methods replace SB3's)."""

    _dict_obs: bool = False
    #: whether :meth:`check_openable` can check an open on a read-only view (not HER's)
    _checked_before_open: bool = True
    _rb: ReplayBuffer | None  # None: not created (Model.load over a buffer) or handed over

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
        **unknown: Any,
    ) -> None:
        if unknown:  # one line, naming the class that takes HER's arguments
            raise TypeError(f"{sorted(unknown)}: {type(self).__name__} takes no such arguments"
                            " (HER's n_sampled_goal, goal_selection_strategy: ZarrHerReplayBuffer)")
        self._working_dir = check_path("working_dir", working_dir)
        if not isinstance(codec, str | Mapping):
            raise TypeError(f"codec: expected a codec name (str) or a dict field -> name, "
                            f"got {show(codec)}")
        self._setup(buffer_size, observation_space, action_space, device, n_envs,
                    optimize_memory_usage, handle_timeout_termination, write_batch,
                    frame_stack_axis)
        model, loading = sb3_context()
        if model is not None:  # no model zip may carry overwrite=True (see sb3_pointer)
            model.replay_buffer_kwargs = {k: v for k, v in model.replay_buffer_kwargs.items()
                                          if k != "overwrite"}
        if loading and overwrite:
            log.info("%s: overwrite=True ignored: SB3's Model.load is rebuilding the buffer "
                     "from saved kwargs, and loading never wipes a buffer", path)
            overwrite = False
        try:
            self._rb = ReplayBuffer.create(
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
        else:
            hold(path, self)

    def _setup(self, buffer_size: int, observation_space: spaces.Space,
               action_space: spaces.Space, device: th.device | str, n_envs: int,
               optimize_memory_usage: bool, handle_timeout_termination: bool,
               write_batch: int | None = None, frame_stack_axis: int | None = None) -> None:
        check_int("buffer_size", buffer_size, 1)
        check_int("n_envs", n_envs, 1)
        if write_batch is not None:
            check_int("write_batch", write_batch, 1)
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
            raise TypeError(f"observation_space: {type(self).__name__} expected "
                            f"{'a ' if self._dict_obs else 'a non-'}Dict space, got "
                            f"{type(observation_space).__name__}")
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        self._layout = Layout.of(observation_space, action_space, n_envs, optimize_memory_usage,
                                 frame_stack_axis)
        # optimize_memory_usage: the next observation of the newest step, [n_envs, *obs_shape]
        self._pending: dict[str, np.ndarray] | None = None
        # steps added but not yet appended to the rlbuffers buffer (one extend per batch)
        self._staged: list[dict[str, np.ndarray]] = []
        self._forced: set[tuple[int, int]] = set()  # (step id, env) marked done in place
        self._gone: str | None = None  # why another instance took the buffer over
        self._rb = None
        step_bytes = self.n_envs // self._layout.rows_per_step * sum(
            math.prod(cast(tuple[int, ...], s.shape)) * np.dtype(s.dtype).itemsize
            for s in self._layout.user_fields().values())
        if write_batch is None:
            write_batch = max(1, min(WRITE_BATCH_STEPS, WRITE_BATCH_BYTES // step_bytes))
        self._write_batch = int(write_batch)
        self._committed_rows: int | None = None  # storage.total_added at the last commit

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
        if self._rb is None and self._gone is not None:
            raise ValueError(f"{type(self).__name__}: closed: {self._gone}; use the buffer "
                             "that did it (e.g. model.replay_buffer)")
        if self._rb is None:
            raise FileExistsError(
                f"{self._path}: already holds a buffer, so this one was not created (SB3's "
                "Model.load builds one this way). Continue from its last commit with "
                "ZarrReplayBuffer.open(path, observation_space, action_space) or "
                "rlbuffers.integrations.sb3.resume(...); start over with overwrite=True")
        return self._rb

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
        done, given = np.empty(n, dtype=np.float32), done
        done[...] = given  # numpy assignment semantics, as SB3's ``self.dones[self.pos] = ``
        if not ((done == 0.0) | (done == 1.0)).all():
            raise FieldError(f"done: expected 0/1 (or bool) values, got {done.tolist()}")
        timeout = np.zeros(n, dtype=bool)
        if self.handle_timeout_termination:
            # numpy assignment semantics, as SB3's ``self.timeouts[self.pos] = ...``
            timeout[...] = np.array([info.get("TimeLimit.truncated", False) for info in infos])
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
                "frame_stack_axis": self._layout.stack_axis, "pending_next_obs": pending,
                "forced_dones": self._live_forced()}

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
        rb = self.storage
        report = rb.save(metadata=meta, background=background)
        self._committed_rows = rb.total_added
        return report

    def last_commit_entries(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """The last commit's metadata entries ``keys`` if no step was added since it (the
        stored row count, ``pos`` and ``full`` unchanged), else ``{}``: what a commit that
        adds nothing may carry over (``save_replay_buffer`` after ``CommitCallback``)."""
        rb = self.storage
        last = rb.metadata if isinstance(rb.metadata, dict) else {}
        state = last.get(META_KEY)
        if (self._committed_rows != rb.total_added or not isinstance(state, dict)
                or (state.get("pos"), state.get("full")) != (self.pos, self.full)):
            return {}
        return {k: last[k] for k in keys if k in last}

    save = commit

    def close(self) -> None:
        """Release the buffer's files (changes since the last commit are discarded)."""
        if self._rb is not None:
            self._rb.close()

    def _hand_over(self, why: str) -> None:
        """Close: another instance of this process takes the buffer over (``why``)."""
        rb, self._rb, self._gone, self._staged = self._rb, None, why, []
        if rb is not None:
            rb.close()

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
            metadata, a field of it is missing or wrong (naming ``sb3.<field>``: expected,
            actual), or the stored fields do not match the spaces; ``write_batch`` < 1.
            TypeError: ``working_dir`` is not a path or None, ``write_batch`` not an int.
            On any error nothing stays open or held.
        """
        working_dir = check_path("working_dir", working_dir)
        if write_batch is not None:
            check_int("write_batch", write_batch, 1)
        rb = ReplayBuffer.open(path, working_dir=working_dir)
        try:
            self, state = cls._prepared(rb, path, observation_space, action_space, device,
                                        write_batch)
        except BaseException:
            rb.close()
            raise
        self._rb, self._working_dir = rb, working_dir
        self._committed_rows = rb.total_added
        self._forced = state["forced_dones"]
        self.pos, self.full = state["pos"], state["full"]
        self._pending = state["pending_next_obs"]
        hold(path, self)
        return self

    @classmethod
    def check_openable(cls, path: str | os.PathLike[str], observation_space: spaces.Space,
                       action_space: spaces.Space, device: th.device | str = "auto", *,
                       write_batch: int | None = None) -> None:
        """Check what :meth:`open` checks (the ``"sb3"`` state, the fields against the
        spaces) on a read-only view of the last commit: nothing is locked, held or changed,
        so a caller that must close the buffer's current writer before :meth:`open`
        (``load_replay_buffer``, ``resume``) refuses first. ZarrHerReplayBuffer's HER part is
        checked by its ``open``.

        Raises:
            As :meth:`open`.
        """
        if write_batch is not None:
            check_int("write_batch", write_batch, 1)
        if not cls._checked_before_open:  # ZarrHerReplayBuffer: its _setup needs the HER state
            return
        with ReplayBuffer.open(path, mode="r") as peek:
            cls._prepared(peek, path, observation_space, action_space, device, write_batch)

    @classmethod
    def _prepared(cls, rb: ReplayBuffer, path: str | os.PathLike[str],
                  observation_space: spaces.Space, action_space: spaces.Space,
                  device: th.device | str, write_batch: int | None,
                  ) -> tuple[Any, dict[str, Any]]:
        """A new instance set up from ``rb``'s last commit (not attached to it), and the
        checked ``"sb3"`` state."""
        state = check_state(rb.metadata.get(META_KEY), path, rb.capacity)
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
        check_pending(state["pending_next_obs"], {
            field_name("next_obs", k): ((self.n_envs, *shape), dtype)
            for k, (shape, dtype) in self._layout.obs.items()})
        return self, state


class ZarrReplayBuffer(_ZarrBuffer):
    """SB3's ``ReplayBuffer`` (same arguments, ``add`` and ``sample``) with the transitions on
    disk in an rlbuffers buffer at ``path``.

    Args:
        buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
            handle_timeout_termination: as SB3's ``ReplayBuffer``.
        path: directory of the rlbuffers buffer (created; see ``overwrite``).
        overwrite: replace a buffer at ``path``; ignored inside SB3's ``Model.load``
            (loading never wipes a buffer), and removed from the model's
            ``replay_buffer_kwargs`` so that no saved zip carries it. Without it an existing
            ``path`` is left untouched and this instance stays unused (``add`` raises
            FileExistsError): that is what ``Model.load`` builds; continue with
            :meth:`open` or ``resume``.

    SB3's arrays (``observations``, ``next_observations``, ``actions``, ``rewards``:
    read-only views ``[buffer_size, n_envs, *shape]`` of the working tier; ``dones``,
    ``timeouts``: float32 copies, ``dones[i] = True`` marks step ``i`` done):
    :mod:`rlbuffers.integrations.sb3.arrays`. Pickling (SB3's ``save_replay_buffer``)
    commits and pickles a pointer that ``load_replay_buffer`` reopens; ``deepcopy``
    refuses: :mod:`rlbuffers.integrations.sb3.pointer`.
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
            :mod:`rlbuffers.integrations.sb3.layout`.

    Raises:
        ValueError: ``optimize_memory_usage`` with ``handle_timeout_termination`` (as SB3),
        ``buffer_size``, ``n_envs`` or ``write_batch`` < 1, or a ``frame_stack_axis`` that
        is not an axis of a Box observation. TypeError: a Dict observation space (use
        :class:`ZarrDictReplayBuffer`); ``buffer_size``, ``n_envs``, ``write_batch`` not an
        int, ``working_dir`` not a path or None, ``codec`` not a str or dict; unknown
        arguments. Each names the argument, what was expected and what was given.
    """


class ZarrDictReplayBuffer(_ZarrBuffer, DictReplayBuffer):  # type: ignore[misc,override]
    """SB3's ``DictReplayBuffer`` with the transitions on disk; arguments as
    :class:`ZarrReplayBuffer` (``optimize_memory_usage`` is refused, as by SB3)."""

    _dict_obs = True
