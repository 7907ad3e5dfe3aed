"""Incremental commits of a Stable-Baselines3 run and its exact resume.

:class:`CommitCallback` commits the run's :class:`ZarrReplayBuffer` every N environment steps
and at the end of training; given ``checkpoint_dir`` it first saves the model
(``model_<num_timesteps>.zip``), so each buffer commit names the model zip of the same step and
holds the RNG states. :func:`resume` restores all three from the last commit.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
from pathlib import Path
from typing import Any

from rlbuffers.integrations import require

require("stable_baselines3", "sb3")

import numpy as np  # noqa: E402
import torch as th  # noqa: E402
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.base_class import BaseAlgorithm  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402

from rlbuffers.buffer import ReplayBuffer  # noqa: E402
from rlbuffers.errors import UnsafePathError  # noqa: E402
from rlbuffers.integrations.sb3.buffer import (  # noqa: E402
    META_KEY,
    ZarrDictReplayBuffer,
    ZarrReplayBuffer,
    _ZarrBuffer,
)
from rlbuffers.integrations.sb3.checks import check_model_entry, check_state  # noqa: E402
from rlbuffers.integrations.sb3.her import ZarrHerReplayBuffer, check_committable  # noqa: E402
from rlbuffers.integrations.sb3.pointer import release  # noqa: E402
from rlbuffers.integrations.sb3.rng import check_rng, set_rng  # noqa: E402
from rlbuffers.storage.safe_files import open_inside  # noqa: E402

__all__ = ["CommitCallback", "resume"]

log = logging.getLogger(__name__)

#: Metadata key of the model checkpoint a commit belongs to.
MODEL_KEY = "model"


class CommitCallback(BaseCallback):
    """Commit the model's :class:`ZarrReplayBuffer` every ``every_n_steps`` environment steps
    (``model.num_timesteps``, all environments together) and when training ends.

    A commit happens at the end of the rollout (SB3's ``train_freq`` steps) in which the count
    crossed a multiple of ``every_n_steps``: there every step counted is in the buffer and the
    model is between collecting and training (in ``on_step`` SB3 has not yet added the step's
    transition). Each commit's metadata: ``num_timesteps``, the buffer's ``"sb3"`` state, the
    RNG states (``"rng"``) and ``"model"``: the zip saved just before (with
    ``checkpoint_dir``; older ``model_*.zip`` there are deleted once the commit naming the new
    one is done) and the state of the action space's generator (SB3's ``load`` reseeds it).

    Args:
        every_n_steps: steps between commits (>= 1).
        checkpoint_dir: where to save ``model_<num_timesteps>.zip``; None: no model save.

    Raises:
        ValueError: ``every_n_steps < 1``. TypeError (at the first commit): the model's
        replay buffer is not a ZarrReplayBuffer; (when learn starts) it is SB3's HerReplayBuffer.
    """

    def __init__(self, every_n_steps: int, checkpoint_dir: str | os.PathLike[str] | None = None,
                 verbose: int = 0) -> None:
        super().__init__(verbose)
        if int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps: expected >= 1, got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self._committed_at: int | None = None

    def _init_callback(self) -> None:
        check_committable(getattr(self.model, "replay_buffer", None))

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        last = self._committed_at or 0
        if self.model.num_timesteps // self.every_n_steps > last // self.every_n_steps:
            self.commit()

    def _on_training_end(self) -> None:
        if self._committed_at != self.model.num_timesteps:
            self.commit()

    def commit(self) -> None:
        """Save the model (with ``checkpoint_dir``), then commit the buffer."""
        buffer = getattr(self.model, "replay_buffer", None)
        if not isinstance(buffer, _ZarrBuffer):
            raise TypeError("CommitCallback: model.replay_buffer must be a ZarrReplayBuffer, "
                            f"got {type(buffer).__name__}")
        steps = int(self.model.num_timesteps)
        model: dict[str, Any] = {
            "action_space_rng": self.model.action_space.np_random.bit_generator.state}
        keep = None
        if self.checkpoint_dir is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            zip_path = (self.checkpoint_dir / f"model_{steps}.zip").resolve()
            last = buffer.storage.metadata
            entry = last.get(MODEL_KEY) if isinstance(last, dict) else None
            named = entry.get("zip") if isinstance(entry, dict) else None
            # the last commit names this step's zip (e.g. learn() after resume() added no
            # step): never rewrite it, a kill during the save would leave no checkpoint
            if not (last.get("num_timesteps") == steps and isinstance(named, str)
                    and Path(named).resolve() == zip_path and zip_path.is_file()):
                save_zip_atomically(self.model, zip_path)
            model["zip"] = str(zip_path)
            keep = zip_path.name
        report = buffer.commit({"num_timesteps": steps, MODEL_KEY: model})
        self._committed_at = steps
        if self.checkpoint_dir is not None:
            for old in [*self.checkpoint_dir.glob("model_*.zip"),
                        *self.checkpoint_dir.glob(".model_*.tmp")]:
                if old.name != keep:
                    old.unlink(missing_ok=True)
        if self.verbose:
            log.info("committed the replay buffer at step %d: %s", steps, report)


def save_zip_atomically(model: BaseAlgorithm, path: Path) -> None:
    """``model.save`` into a new temporary file beside ``path`` (a unique name, created with
    ``O_EXCL``), fsynced, then renamed onto ``path``: a kill at any moment leaves either the
    previous file at ``path`` or the complete new one, never a partial zip.

    Raises:
        OSError: the write or the rename failed (``path`` is unchanged, the temporary removed).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o644)
            break
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            model.save(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def resume(model_cls: type[BaseAlgorithm], buffer_path: str | os.PathLike[str], *,
           zip_path: str | os.PathLike[str] | None = None, env: Any = None,
           device: Any = "auto", **load_kwargs: Any) -> BaseAlgorithm:
    """Restore a run from the last commit of its buffer: the model (``model_cls.load`` of the
    zip the commit names, or ``zip_path``), the buffer (:meth:`ZarrReplayBuffer.open`) and the
    numpy global, Python, torch and action-space RNG states of the commit, so that sampling
    goes on exactly as in the uninterrupted run. The environment is not part of SB3's
    checkpoint: ``load`` with an ``env`` resets it at the next ``learn``.

    The commit's metadata (``model``, ``num_timesteps``, ``rng``, ``sb3``) is checked before
    anything changes; the zip is opened without following a symlink or blocking on a FIFO
    (``zip_path`` may be a symlink: it is resolved first). On any error nothing stays open
    or held and the global RNG states are as before (SB3's ``load`` reseeds them).

    Raises:
        ValueError: the commit names no model zip and ``zip_path`` is None, a metadata field
        is wrong (naming it: ``model``, ``model.zip``, ``model.action_space_rng``,
        ``num_timesteps``, ``rng.<key>``, ``sb3.<field>``; expected, actual), the zip's
        ``num_timesteps`` differs from the commit's, or ``env`` has another number of
        environments than the buffer. UnsafePathError: the zip is not a regular file (a
        FIFO, a symlink, a directory). FileNotFoundError: no zip there. NotABufferError:
        no buffer there. Errors of ``model_cls.load`` and ``ZarrReplayBuffer.open``.
    """
    meta, model_meta, state, rngs, path = _checked(buffer_path, zip_path)
    saved = np.random.get_state(), random.getstate(), th.get_rng_state()
    buffer: Any = None
    try:
        with open_zip(path) as f:
            model: Any = model_cls.load(f, env=env, device=device, **load_kwargs)
        if "num_timesteps" in meta and model.num_timesteps != meta["num_timesteps"]:
            raise ValueError(f"{path}: num_timesteps {model.num_timesteps} differs from "
                             f"the buffer commit's {meta['num_timesteps']}")
        if state["n_envs"] != model.n_envs:
            raise ValueError(f"env: the buffer at {buffer_path} was filled with n_envs="
                             f"{state['n_envs']}, the model now has n_envs={model.n_envs}")
        generator = model.action_space.np_random.bit_generator
        space_rng = model_meta.get("action_space_rng")
        if space_rng is not None and space_rng["bit_generator"] != type(generator).__name__:
            raise ValueError(f"model.action_space_rng: expected a {type(generator).__name__} "
                             f"state (the action space's), got {space_rng['bit_generator']}")
        buffer = _reopen(model, buffer_path)
    except BaseException:
        if buffer is not None:
            buffer.close()
        np.random.set_state(saved[0])
        random.setstate(saved[1])
        th.set_rng_state(saved[2])
        raise
    if rngs is not None:
        set_rng(rngs)
    if space_rng is not None:
        generator.state = space_rng
    return model


def _checked(buffer_path: str | os.PathLike[str], zip_path: str | os.PathLike[str] | None
             ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], Any, str]:
    """The last commit's metadata, its ``model`` entry, ``sb3`` state and RNG states checked
    (nothing changes), and the zip's path (``zip_path`` resolved, else the commit's)."""
    with ReplayBuffer.open(buffer_path, mode="r") as peek:
        meta, capacity = peek.metadata, peek.capacity
    model_meta = check_model_entry(meta)
    state = check_state(meta.get(META_KEY), buffer_path, capacity)
    rngs = check_rng(meta["rng"]) if "rng" in meta else None
    if zip_path is not None:
        path = os.path.realpath(zip_path)
    elif model_meta.get("zip") is not None:
        path = model_meta["zip"]
    else:
        raise ValueError(f"{buffer_path}: the last commit names no model zip (commit with "
                         "CommitCallback(checkpoint_dir=...)), and zip_path is None")
    return meta, model_meta, state, rngs, path


def _reopen(model: Any, buffer_path: str | os.PathLike[str]) -> Any:
    """Close what ``load`` built, take the buffer over and open it as the model's."""
    old = getattr(model, "replay_buffer", None)
    buffer_cls = type(old) if isinstance(old, _ZarrBuffer) else (
        ZarrDictReplayBuffer if isinstance(model.observation_space, spaces.Dict)
        else ZarrReplayBuffer)
    buffer_cls.check_openable(buffer_path, model.observation_space, model.action_space,
                              device=model.device)   # before the current holder is closed
    if isinstance(old, _ZarrBuffer):  # what load built (it holds nothing: sb3_pointer)
        old.close()
    release(buffer_path, "resume() reopened its buffer")  # one writer per buffer
    buffer = buffer_cls.open(buffer_path, model.observation_space, model.action_space,
                             device=model.device)
    model.replay_buffer = buffer
    if isinstance(buffer, ZarrHerReplayBuffer):  # computes relabelled goals' rewards
        buffer.set_env(model.get_env())
    return buffer


def open_zip(path: str) -> Any:
    """The model zip at ``path`` opened for reading (a binary file object) if it is a regular
    file: never through a symlink, never blocking on a FIFO.

    Raises:
        UnsafePathError: a symlink, FIFO, socket, device or directory there (naming the
        file). FileNotFoundError: nothing there.
    """
    parent, name = os.path.split(path)
    try:
        fd = open_inside(parent or ".", name)
    except UnsafePathError as e:
        raise UnsafePathError(f"model zip {path}: expected a regular file, refused: {e}") \
            from None
    except FileNotFoundError:
        raise FileNotFoundError(f"model zip {path}: expected a regular file, got nothing "
                                "there") from None
    return os.fdopen(fd, "rb")
