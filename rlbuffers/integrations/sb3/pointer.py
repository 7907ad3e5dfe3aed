"""What SB3's ``save_replay_buffer`` / ``load_replay_buffer``, ``Model.load`` and ``deepcopy``
mean for a buffer on disk.

- **Pickling is a pointer.** SB3's ``model.save_replay_buffer(path)`` pickles the buffer into
  ``path``. A :class:`~rlbuffers.integrations.sb3.ZarrReplayBuffer` pickles as a pointer of a
  few hundred bytes: it commits the buffer first, then the pickle holds the buffer's
  directory, that commit's number, the spaces and the constructor settings (:func:`pointer`;
  what ``Model.load`` built over an existing buffer points at its last commit, untouched).
  ``model.load_replay_buffer(path)`` unpickles it (:func:`reopen`): the buffer opened at that
  commit (it must still be the last one: ValueError otherwise). Only one writer can hold a
  buffer: an instance of this process that holds it (the model's previous buffer) is closed
  first, its steps since the last commit discarded (as loading SB3's pickle drops them).
- **deepcopy and copy refuse** (TypeError): a copy would be a second writer of one directory.
- **Model.load never wipes a buffer.** SB3's ``Model.load`` rebuilds the replay buffer with the
  saved ``replay_buffer_kwargs``. :func:`sb3_context` tells the constructor that it runs inside
  SB3's ``_setup_model`` (and whether inside ``load``): ``overwrite`` is then ignored during a
  load, and removed from the model's ``replay_buffer_kwargs`` in every case, so no saved model
  zip carries ``overwrite=True``.
"""

from __future__ import annotations

import os
import sys
import weakref
from types import FrameType
from typing import Any

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm

from rlbuffers.buffer import ReplayBuffer
from rlbuffers.errors import NotABufferError
from rlbuffers.integrations.sb3.checks import check_int, show

__all__ = ["PointerPickling", "hold", "pointer", "release", "reopen", "sb3_context"]

#: Buffer directory (resolved) -> the instance of this process that holds it.
_HOLDERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

#: Pickled pointers carry this version; :func:`reopen` refuses others.
POINTER_VERSION = 1

_SETUP_CODE = OffPolicyAlgorithm._setup_model.__code__
_LOAD_CODE = BaseAlgorithm.load.__func__.__code__  # type: ignore[attr-defined]


def sb3_context(max_depth: int = 40) -> tuple[Any, bool]:
    """``(model, loading)``: the SB3 model whose ``_setup_model`` is building the replay buffer
    (None when the buffer is built directly, e.g. CleanRL), and whether that runs inside
    ``BaseAlgorithm.load`` (a rebuild from a saved zip). Walks at most ``max_depth`` frames."""
    frame: FrameType | None = sys._getframe(1)
    model, loading = None, False
    for _ in range(max_depth):
        if frame is None:
            break
        if model is None and frame.f_code is _SETUP_CODE:
            model = frame.f_locals.get("self")
        elif frame.f_code is _LOAD_CODE:
            loading = True
            break
        frame = frame.f_back
    return model, loading and model is not None


def _key(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(path))


def hold(path: str | os.PathLike[str], buffer: Any) -> None:
    """Record that ``buffer`` (of this process) holds the buffer at ``path``."""
    _HOLDERS[_key(path)] = buffer


def release(path: str | os.PathLike[str], why: str) -> None:
    """Close the instance of this process that holds ``path``, if any (``why``: what its later
    use will say took it over)."""
    holder = _HOLDERS.pop(_key(path), None)
    if holder is not None:
        holder._hand_over(why)


def pointer(buffer: Any) -> dict[str, Any]:
    """Commit ``buffer`` and return what reopens it at that commit (what it pickles as). The
    commit carries over the last commit's ``model`` and ``num_timesteps`` (CommitCallback's)
    when no step was added since, so ``resume`` still finds its model zip. An instance that
    holds nothing (``Model.load`` built it over an existing buffer, which it
    left alone) points at that buffer's last commit, without writing anything.

    Raises:
        TypeError: another instance of this process took the buffer over. NotABufferError:
        an instance that holds nothing finds no buffer at its path. OSError: the commit
        failed (the last commit stays).
    """
    if buffer._rb is None:
        if buffer._gone is not None:
            raise TypeError(f"pickle({type(buffer).__name__}): closed: {buffer._gone}; "
                            "pickle the buffer that did it (e.g. model.replay_buffer)")
        path = _key(buffer._path)
        with ReplayBuffer.open(path, mode="r") as peek:
            commit = int(peek.commit)
    else:  # CommitCallback's model entry stays true if no step was added since its commit
        buffer.commit(buffer.last_commit_entries(("model", "num_timesteps")))
        path, commit = _key(buffer.storage.path), int(buffer.storage.commit)
    return {"version": POINTER_VERSION, "class": type(buffer), "path": path,
            "commit": commit, "observation_space": buffer.observation_space,
            "action_space": buffer.action_space, "device": str(buffer.device),
            "working_dir": buffer._working_dir, "write_batch": buffer._write_batch}


def reopen(ptr: dict[str, Any]) -> Any:
    """The buffer a :func:`pointer` names, opened at its commit (an instance of this process
    that holds it is closed first). A pickle may come from anyone: every field is checked
    before anything is opened, and the pointer's ``working_dir`` is used only when the
    instance of this process that holds the buffer uses that same one (it made it); else
    the working tier goes to its default place (``<path>/.working``), rebuilt from the commit.

    Raises:
        ValueError: another pointer version, a missing field, the buffer has been
        committed since (its last commit is not the pointer's), or the buffer does not
        match the pointer's class and spaces (checked before the holder is closed).
        TypeError: a field of another type (``path``, ``working_dir``: str; ``class``: one
        of the Zarr buffer classes; the spaces; ``commit``; ``device``), each naming
        ``pointer.<field>``.
        NotABufferError: no buffer there any more.
    """
    path, write_batch = _checked(ptr)
    try:
        with ReplayBuffer.open(path, mode="r") as peek:
            last = int(peek.commit)
    except NotABufferError as e:
        raise NotABufferError(f"pointer.path: expected a buffer, got {e}") from None
    if last != ptr["commit"]:
        raise ValueError(
            f"{path}: the pickled pointer names commit {ptr['commit']}, but the buffer's last "
            f"commit is {last} (a buffer on disk keeps its newest state only); open the last "
            "commit with ZarrReplayBuffer.open(path, ...) or resume(...)")
    holder = _HOLDERS.get(_key(path))
    working_dir = ptr["working_dir"]
    if working_dir is not None and getattr(holder, "_working_dir", None) != working_dir:
        working_dir = None   # not this process's: the default place, never a pickle's path
    ptr["class"].check_openable(path, ptr["observation_space"], ptr["action_space"],
                                ptr["device"], write_batch=write_batch)
    release(path, "load_replay_buffer (unpickling) reopened its buffer")
    return ptr["class"].open(path, ptr["observation_space"], ptr["action_space"],
                             ptr["device"], working_dir=working_dir, write_batch=write_batch)


def _checked(ptr: Any) -> tuple[str, int | None]:
    """:func:`reopen`'s checks of the pointer's fields (see its Raises): path, write_batch."""
    from gymnasium import spaces

    if not isinstance(ptr, dict):
        raise TypeError(f"pointer: expected a dict, got {show(ptr)}")
    if ptr.get("version") != POINTER_VERSION:
        raise ValueError(f"pointer.version: expected {POINTER_VERSION}, got "
                         f"{ptr.get('version')!r}")
    kinds: dict[str, tuple[Any, str]] = {
        "class": (type, "one of ZarrReplayBuffer, ZarrDictReplayBuffer, ZarrHerReplayBuffer"),
        "path": (str, "a path (str)"), "commit": (int, "an int >= 0"),
        "observation_space": (spaces.Space, "a gymnasium space"),
        "action_space": (spaces.Space, "a gymnasium space"),
        "device": (str, "a device name (str)"),
        "working_dir": ((str, type(None)), "a path (str) or None")}
    for key, (kind, what) in kinds.items():
        if key not in ptr:
            raise ValueError(f"pointer.{key}: expected {what}, got nothing (missing)")
        value = ptr[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (
                key == "class" and not issubclass(value, PointerPickling)) or (  # ours only
                key == "commit" and value < 0):
            raise TypeError(f"pointer.{key}: expected {what}, got {show(value)}")
    path, write_batch = ptr["path"], ptr.get("write_batch")
    if not path:
        raise ValueError("pointer.path: expected the buffer's directory, got str ''")
    if write_batch is not None:
        check_int("pointer.write_batch", write_batch, 1)
    return path, write_batch


class PointerPickling:
    """Pickling (SB3's ``save_replay_buffer``) as a pointer; ``deepcopy`` / ``copy`` refuse."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return reopen, (pointer(self),)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(f"deepcopy({type(self).__name__}): refused, a copy would be a second "
                        "writer of the same directory; commit() and open a reader with "
                        "rlbuffers.ReplayBuffer.open(path, mode='r') instead")

    def __copy__(self) -> Any:
        raise TypeError(f"copy({type(self).__name__}): refused, a copy would be a second "
                        "writer of the same directory; commit() and open a reader with "
                        "rlbuffers.ReplayBuffer.open(path, mode='r') instead")
