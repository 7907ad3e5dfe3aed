"""Reading a Stable-Baselines3 replay-buffer pickle (what ``rlbuffers convert sb3`` converts:
:mod:`rlbuffers.integrations.sb3.convert`).

SB3's ``model.save_replay_buffer(path)`` pickles its ``ReplayBuffer`` / ``DictReplayBuffer``
object (protocol 5). Its arrays are ``[buffer_size, n_envs, *shape]`` rings with a write
position ``pos`` and a ``full`` flag; this module reads them (:func:`load_sb3_pickle`), and
:mod:`rlbuffers.integrations.sb3.convert` writes them oldest first into a new rlbuffers buffer in
bounded
batches.

What is streamed and what is not:

- **Streamed**: with protocol 5 (what SB3 writes), every large array is stored in the pickle as
  one contiguous run of raw bytes. :func:`load_sb3_pickle` does not read those bytes: it maps
  them straight from the pickle file (``np.memmap``, read-only), so loading a 100 GB pickle
  costs a few MB of RAM. The conversion then copies the arrays into the buffer batch by batch
  (~32 MiB at a time) and ``save`` compresses them chunk by chunk, so the whole run needs a few
  tens of MB of heap whatever the buffer size; the OS page cache holds the pages in flight.
- **Not streamed**: pickles written with protocol < 5 (arrays are rebuilt through
  ``ndarray.__setstate__``), gzip-compressed pickles, and arrays under 1 MiB are read into
  memory. Each array then needs its full size in RAM once.

The pickle is read with a restricted unpickler (:mod:`rlbuffers.integrations.sb3.inert_pickle`):
numpy
arrays, dtypes and plain containers are rebuilt for real; every other class or function the
pickle names (SB3's buffer classes, gymnasium spaces, ``torch.device``) becomes an inert
stand-in that only records its arguments and state. So neither Stable-Baselines3, gymnasium
nor torch needs to be installed, and no code named by the pickle runs. What a hostile pickle
could still make numpy or Python do is refused before it happens (object dtypes and forged
dtype states, arrays without data or with strides of the pickle's choosing, lengths beyond the
file, allocations beyond ``memory_budget``, cycles of dtypes, too many objects): see
:mod:`rlbuffers.integrations.sb3.inert_pickle`. ``--overwrite`` replaces only an rlbuffers buffer,
and only once
the new one is complete (see :func:`rlbuffers.integrations.sb3.convert.convert_sb3`).

RNG state: a trained model's action space (and observation space, once sampled) carries a
numpy ``Generator`` (gymnasium's ``_np_random``), pickled through numpy's
``numpy.random._pickle`` constructors with a bit generator (PCG64, PCG64DXSM, MT19937, Philox,
SFC64), a ``SeedSequence`` or a legacy ``RandomState``. None of these is rebuilt: each becomes
an inert stand-in that keeps its constructor arguments and its state (a dict as attributes,
anything else, e.g. a tuple, as ``_state``). The converter never uses them and the new
buffer's sampler is seeded from ``seed``, so no RNG state carries over.

Errors: a file that is not a readable pickle (truncated, corrupt, gzip garbage, another
format) or a pickle of anything but an SB3 ``ReplayBuffer`` / ``DictReplayBuffer`` raises
:class:`ConvertError` naming the path and what was expected; only a missing file
(``FileNotFoundError``) and real I/O errors (``OSError``) pass through as they are.
"""

from __future__ import annotations

import gzip
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from rlbuffers.errors import RLBuffersError, UnsafePickleError
from rlbuffers.integrations.sb3.inert_objects import InertObject
from rlbuffers.integrations.sb3.inert_pickle import MEMORY_BUDGET, MappingUnpickler

__all__ = ["ConvertError", "SB3Buffer", "load_sb3_pickle", "obs_arrays"]


class ConvertError(RLBuffersError, ValueError):
    """The input is not a replay-buffer pickle this converter understands."""


# -- reading an SB3 buffer ---------------------------------------------------------------------
@dataclass
class SB3Buffer:
    """The contents of an SB3 replay-buffer pickle, as stored (no copies).

    Attributes:
        kind: the pickled class, e.g. ``stable_baselines3.common.buffers.ReplayBuffer``.
        observations: ``[buffer_size, n_envs, *obs_shape]`` (a dict of such arrays for a
            ``DictReplayBuffer``); ``next_observations`` likewise, or None when SB3 used
            ``optimize_memory_usage`` (next observation = the following row of observations).
        actions: ``[buffer_size, n_envs, action_dim]``; ``discrete_action``: the action space
            was ``Discrete`` (action_dim 1).
        rewards, dones, timeouts: float32 ``[buffer_size, n_envs]`` (timeouts all 0 unless SB3's
            ``handle_timeout_termination``).
        pos, full, buffer_size, n_envs: SB3's ring state (``buffer_size`` per env).
        mapped_bytes: bytes of arrays memory-mapped from the pickle rather than read.
    """

    kind: str
    observations: np.ndarray | dict[str, np.ndarray]
    next_observations: np.ndarray | dict[str, np.ndarray] | None
    actions: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    timeouts: np.ndarray
    pos: int
    full: bool
    buffer_size: int
    n_envs: int
    discrete_action: bool
    mapped_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def time_order(self) -> np.ndarray:
        """Ring rows holding valid transitions, oldest first: int64[T].

        Full: ``pos .. buffer_size-1, 0 .. pos-1`` (without ``optimize_memory_usage``'s invalid
        row ``pos``, whose observation was overwritten); otherwise ``0 .. pos-1``.
        """
        if not self.full:
            return np.arange(self.pos, dtype=np.int64)
        order = (self.pos + np.arange(self.buffer_size, dtype=np.int64)) % self.buffer_size
        return order[1:] if self.next_observations is None else order


_REQUIRED = ("observations", "actions", "rewards", "dones", "pos", "full", "buffer_size",
             "n_envs")


def _open(path: Path) -> tuple[IO[bytes], Path | None]:
    f: IO[bytes] = open(path, "rb")  # closed by the caller
    if f.read(2) == b"\x1f\x8b":
        f.close()
        return gzip.open(path, "rb"), None  # type: ignore[return-value]
    f.seek(0)
    return f, path


def load_sb3_pickle(path: str | os.PathLike[str], *,
                    memory_budget: int = MEMORY_BUDGET) -> SB3Buffer:
    """Read an SB3 ``save_replay_buffer`` pickle (plain or gzip-compressed).

    Large arrays of a protocol-5 pickle are memory-mapped read-only from the file (no copy in
    RAM); see the module docstring. Stable-Baselines3 need not be installed.

    Args:
        memory_budget: bytes the pickle may make this process hold (read into memory, not
            mapped, or allocated by what it calls); default 16 GiB. A hostile pickle cannot
            make the load allocate more than this, nor more than its own size per opcode.

    Raises:
        FileNotFoundError: no such file. ConvertError: not a pickle, a pickle the restricted
        unpickler refuses (its ``__cause__`` an :class:`~rlbuffers.errors.UnsafePickleError`:
        object dtypes, arrays without data or with forged strides, lengths beyond the file,
        budgets exceeded; see :mod:`rlbuffers.integrations.sb3.inert_pickle`), a pickle of
        something other than
        an SB3 replay buffer (e.g. a ``RolloutBuffer``), or inconsistent shapes.
    """
    p = Path(path)
    f, mappable = _open(p)
    with f:
        up = MappingUnpickler(f, mappable, memory_budget=memory_budget)
        try:
            obj = up.load()
        except OSError as e:  # a read error is reported as such, a corrupt gzip stream is not
            if not isinstance(e, gzip.BadGzipFile):
                raise
            raise ConvertError(f"{p}: {_EXPECTED}, but it is not a readable pickle "
                               f"(corrupt gzip stream: {e})") from e
        except Exception as e:  # whatever a truncated, corrupt or foreign file makes fail
            raise ConvertError(f"{p}: {_EXPECTED}, but it is not a readable pickle "
                               f"({_what_file(p) or _why(e)})") from e
    kind = getattr(obj, "_origin", None) or type(obj).__qualname__
    state = obj.__dict__ if isinstance(obj, InertObject) else {}
    missing = [k for k in _REQUIRED if k not in state]
    optimized = isinstance(state.get("optimize_memory_usage"), (bool, int, np.bool_, np.integer)) \
        and bool(state["optimize_memory_usage"])
    if missing or "next_observations" not in state and not optimized:
        raise ConvertError(
            f"{p}: {_EXPECTED}, got a pickled {kind} "
            f"(missing attributes {', '.join(missing or ['next_observations'])})"
        )
    try:
        buf = _sb3_from_state(state, kind)
        buf.mapped_bytes = up.mapped_bytes
        _check_shapes(p, buf)
    except ConvertError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
        raise ConvertError(f"{p}: {_EXPECTED}, got a pickled {kind} with unexpected "
                           f"attributes ({_why(e)})") from e
    return buf


_EXPECTED = "expected an SB3 ReplayBuffer/DictReplayBuffer pickle (model.save_replay_buffer)"


def _what_file(p: Path) -> str | None:
    """What a file that failed to unpickle is instead, when its first bytes tell."""
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if not head:
        return "the file is empty"
    if head.startswith(b"PK\x03\x04"):
        return ("a zip archive: model.save() writes one, the replay buffer comes from "
                "model.save_replay_buffer()")
    if head.startswith(b"\x93NUMPY"):
        return "a numpy .npy file"
    return None


def _why(e: BaseException) -> str:
    """A short reason for an unpickling failure (some exceptions carry no message)."""
    if isinstance(e, EOFError) or "exhausted before end of frame" in str(e):
        return "it ends too early: truncated?"
    if isinstance(e, UnsafePickleError) and "are left in" in str(e):  # or a forged length
        return "it ends too early: truncated?"  # the claim itself: in the cause
    if isinstance(e, MemoryError):
        return "a length field asks for more memory than there is: corrupt?"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _truth(s: dict[str, Any], key: str, default: bool = False) -> bool:
    """``bool(s[key])`` for a pickled flag (Python or numpy bool/int); TypeError otherwise."""
    v = s.get(key, default)
    if not isinstance(v, (bool, int, np.bool_, np.integer)):
        raise TypeError(f"{key}: expected a bool, got {type(v).__name__}")
    return bool(v)


def _sb3_from_state(s: dict[str, Any], kind: str) -> SB3Buffer:
    space = s.get("action_space")
    origin = getattr(space, "_origin", None) or type(space).__qualname__
    discrete = origin.rsplit(".", 1)[-1] == "Discrete"
    rewards = s["rewards"]
    if not isinstance(rewards, np.ndarray):  # before zeros_like walks whatever it is
        raise TypeError(f"rewards: expected a numpy array, got {type(rewards).__name__}")
    timeouts = s.get("timeouts")
    if timeouts is None or not _truth(s, "handle_timeout_termination", True):
        timeouts = np.zeros_like(rewards)
    optimize = _truth(s, "optimize_memory_usage")
    return SB3Buffer(
        kind=kind,
        observations=s["observations"],
        next_observations=None if optimize else s["next_observations"],
        actions=s["actions"],
        rewards=rewards,
        dones=s["dones"],
        timeouts=timeouts,
        pos=operator.index(s["pos"]),
        full=_truth(s, "full"),
        buffer_size=operator.index(s["buffer_size"]),
        n_envs=operator.index(s["n_envs"]),
        discrete_action=discrete,
        extra={k: float(s[k]) for k in ("n_steps", "gamma")
               if isinstance(s.get(k), (int, float, np.integer, np.floating))},
    )


def obs_arrays(obs: Any, prefix: str) -> dict[str, np.ndarray]:
    if isinstance(obs, Mapping):
        return {f"{prefix}.{k}": v for k, v in obs.items()}
    return {prefix: obs}


def _check_shapes(p: Path, b: SB3Buffer) -> None:
    if b.buffer_size < 1 or b.n_envs < 1:
        raise ConvertError(f"{p}: expected buffer_size and n_envs >= 1, got "
                           f"{b.buffer_size} and {b.n_envs}")
    lead = (b.buffer_size, b.n_envs)
    arrays = {**obs_arrays(b.observations, "observations"), "actions": b.actions,
              "rewards": b.rewards, "dones": b.dones, "timeouts": b.timeouts}
    if b.next_observations is not None:
        arrays.update(obs_arrays(b.next_observations, "next_observations"))
    for name in ("observations", "next_observations"):
        obs = getattr(b, name)
        if isinstance(obs, Mapping) and (not obs or not all(isinstance(k, str) for k in obs)):
            raise ConvertError(f"{p}: {name}: expected a dict of arrays by key name, got "
                               f"keys {list(obs)!r}")
    for name, a in arrays.items():
        scalar = name in ("rewards", "dones", "timeouts")  # [buffer_size, n_envs] exactly
        if (not isinstance(a, np.ndarray) or a.shape[:2] != lead
                or scalar and a.ndim != 2 or a.dtype.hasobject or a.dtype.kind not in "biuf"):
            got = f"{a.shape} {a.dtype}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ConvertError(
                f"{p}: {name}: expected a numeric array of shape ({lead[0]}, {lead[1]}"
                f"{')' if scalar else ', ...)'}, got {got}"
            )
    if not 0 <= b.pos < b.buffer_size:
        raise ConvertError(f"{p}: pos: expected 0 <= pos < {b.buffer_size}, got {b.pos}")
    if b.discrete_action and b.actions.shape[2:] != (1,):
        raise ConvertError(
            f"{p}: actions: Discrete action space expects shape (..., 1), got {b.actions.shape}"
        )
