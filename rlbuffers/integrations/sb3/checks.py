"""Checks of what the SB3 drop-in is given or reads back: constructor arguments, a commit's
``"sb3"`` state and ``"model"`` entry, and a pickled pointer (a model zip, a manifest or a
pickle may come from anyone). Every refusal is one line naming the argument or field (a
metadata field as ``sb3.pos``, ``model.zip``), what was expected and what was found; every
check runs before anything is opened, held or changed.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

import numpy as np

__all__ = ["check_int", "check_model_entry", "check_path", "check_pending", "check_state",
           "decode_rows", "show"]

#: numpy bit generators whose state an action space's generator may have.
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def show(value: Any) -> str:
    """``<type> <repr>``, one line, at most ~80 characters of repr."""
    text = repr(value).replace("\n", " ")
    return f"{type(value).__name__} {text[:77] + '...' if len(text) > 80 else text}"


def is_int(value: Any) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``int(value)`` if it is an int (not a bool) in ``[lo, hi)``.

    Raises:
        TypeError: not an int. ValueError: out of range (both naming ``name``).
    """
    where = (f" >= {lo}" if hi is None else f" in [{lo}, {hi})") if lo is not None else ""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int{where}, got {show(value)}")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        raise ValueError(f"{name}: expected an int{where}, got {int(value)}")
    return int(value)


def check_path(name: str, value: Any, *, optional: bool = True) -> str | None:
    """``os.fspath(value)`` of a str or ``os.PathLike`` (None if ``optional``).

    Raises:
        TypeError: anything else (naming ``name``).
    """
    if value is None and optional:
        return None
    what = "a path (str or os.PathLike)" + (" or None" if optional else "")
    try:
        path = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise TypeError(f"{name}: expected {what}, got {show(value)}")
    return path


def _get(state: dict[str, Any], key: str, prefix: str, what: str) -> Any:
    if key not in state:
        raise ValueError(f"{prefix}.{key}: expected {what}, got nothing (missing)")
    return state[key]


def _bool(state: dict[str, Any], key: str, prefix: str = "sb3") -> bool:
    value = _get(state, key, prefix, "a bool")
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{prefix}.{key}: expected a bool, got {show(value)}")
    return bool(value)


def _int(state: dict[str, Any], key: str, lo: int, hi: int | None = None,
         prefix: str = "sb3") -> int:
    where = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
    value = _get(state, key, prefix, f"an int {where}")
    try:
        return check_int(f"{prefix}.{key}", value, lo, hi)
    except TypeError as e:
        raise ValueError(str(e)) from None


def decode_rows(name: str, rows: Any) -> dict[str, np.ndarray]:
    """``rows_to_json``'s field -> base64 ``.npy`` text, decoded (no pickles).

    Raises:
        ValueError: not a dict of str -> base64 ``.npy`` text (naming ``name.<key>``).
    """
    if not isinstance(rows, dict):
        raise ValueError(f"{name}: expected a dict of field -> base64 .npy text, got "
                         f"{show(rows)}")
    out = {}
    for key, text in rows.items():
        if not isinstance(text, str):
            raise ValueError(f"{name}.{key}: expected base64 .npy text, got {show(text)}")
        try:
            out[key] = np.load(io.BytesIO(base64.b64decode(text, validate=True)),
                               allow_pickle=False)
        except (ValueError, TypeError, OSError, EOFError, binascii.Error) as e:
            msg = str(e).replace("\n", " ")[:120]
            raise ValueError(f"{name}.{key}: expected base64 .npy text, got {show(text)} "
                             f"({msg})") from None
    return out


def check_state(state: Any, where: Any, capacity: int | None = None) -> dict[str, Any]:
    """The commit's ``"sb3"`` state (``_ZarrBuffer.state_dict``) checked: the fields
    ``open`` reads, their types and ranges, ``buffer_size`` against the stored
    ``capacity`` (rows), the HER part if present; ``pending_next_obs`` comes back decoded
    (checked against the spaces by :func:`check_pending`), ``forced_dones`` as a set.

    Raises:
        ValueError: no ``"sb3"`` dict, or a field missing or wrong (naming ``sb3.<field>``).
    """
    if not isinstance(state, dict):
        raise ValueError(f"{where}: the last commit has no 'sb3' metadata (it was not "
                         f"written by ZarrReplayBuffer.commit), got {show(state)}")
    out = dict(state)
    out["buffer_size"] = _int(state, "buffer_size", 1)
    out["n_envs"] = n_envs = _int(state, "n_envs", 1)
    axis = state.get("frame_stack_axis")
    if axis is not None and not is_int(axis):
        raise ValueError(f"sb3.frame_stack_axis: expected an int or None, got {show(axis)}")
    rows = out["buffer_size"] * (n_envs if axis is None else 1)
    if capacity is not None and rows != capacity:
        raise ValueError(f"sb3.buffer_size: expected {capacity} rows (the buffer's capacity) "
                         f"for n_envs={n_envs}, got buffer_size={out['buffer_size']}")
    out["pos"] = _int(state, "pos", 0, out["buffer_size"])
    for key in ("full", "optimize_memory_usage", "handle_timeout_termination"):
        out[key] = _bool(state, key)
    pending = _get(state, "pending_next_obs", "sb3", "None or a dict of base64 .npy text")
    out["pending_next_obs"] = None if pending is None else decode_rows(
        "sb3.pending_next_obs", pending)
    forced = state.get("forced_dones", [])
    if not isinstance(forced, list) or not all(
            isinstance(p, list) and len(p) == 2 and is_int(p[0]) and is_int(p[1])
            and p[0] >= 0 and 0 <= p[1] < n_envs for p in forced):
        raise ValueError(f"sb3.forced_dones: expected a list of [step >= 0, env in [0, "
                         f"{n_envs})] pairs, got {show(forced)}")
    out["forced_dones"] = {(int(s), int(e)) for s, e in forced}
    if "her" in state:
        her = state["her"]
        if not isinstance(her, dict):
            raise ValueError(f"sb3.her: expected a dict, got {show(her)}")
        for key in ("n_sampled_goal", "goal_selection_strategy", "info_bytes"):
            _get(her, key, "sb3.her", "a value")
        _bool(her, "copy_info_dict", "sb3.her")
        starts = _get(her, "current_ep_start", "sb3.her", f"{n_envs} ints >= 0")
        if not (isinstance(starts, list) and len(starts) == n_envs
                and all(is_int(s) and s >= 0 for s in starts)):
            raise ValueError(f"sb3.her.current_ep_start: expected a list of {n_envs} ints "
                             f">= 0, got {show(starts)}")
    return out


def check_pending(pending: dict[str, np.ndarray] | None,
                  expected: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """The decoded ``pending_next_obs`` against the spaces: ``expected`` is field ->
    (shape, dtype) of one step's next observations.

    Raises:
        ValueError: other fields, shapes or dtypes (naming ``sb3.pending_next_obs``).
    """
    if pending is None:
        return
    got = {k: (tuple(v.shape), v.dtype) for k, v in pending.items()}
    if got != {k: (tuple(s), np.dtype(d)) for k, (s, d) in expected.items()}:
        raise ValueError(f"sb3.pending_next_obs: expected {expected} (the spaces), got {got}")


def _bit_generator(name: str, state: Any) -> None:
    """Set ``state`` on a new numpy bit generator of the kind it names (nothing global)."""
    kind = state.get("bit_generator") if isinstance(state, dict) else None
    if kind not in BIT_GENERATORS:
        raise ValueError(f"{name}: expected a numpy bit generator state (a dict whose "
                         f"'bit_generator' is one of {list(BIT_GENERATORS)}), got {show(state)}")
    try:
        getattr(np.random, kind)().state = state
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
        msg = str(e).replace("\n", " ")[:120]
        raise ValueError(f"{name}: expected a valid {kind} state, got {show(state)} "
                         f"({type(e).__name__}: {msg})") from None


def check_model_entry(meta: dict[str, Any]) -> dict[str, Any]:
    """A commit's ``"model"`` entry (CommitCallback's: ``zip``, ``action_space_rng``) and
    ``num_timesteps``, checked; ``{}`` when the commit has none.

    Raises:
        ValueError: ``model`` not a dict, ``model.zip`` not a string,
        ``model.action_space_rng`` not a numpy bit generator state that numpy accepts, or
        ``num_timesteps`` not an int >= 0 (each naming the field).
    """
    model = meta.get("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"model: expected a dict (CommitCallback's model entry), got "
                         f"{show(model)}")
    if model.get("zip") is not None and not isinstance(model["zip"], str):
        raise ValueError(f"model.zip: expected a path (str), got {show(model['zip'])}")
    if "action_space_rng" in model:
        _bit_generator("model.action_space_rng", model["action_space_rng"])
    if "num_timesteps" in meta:
        _int(meta, "num_timesteps", 0, prefix="commit")
    return model
