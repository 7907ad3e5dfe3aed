"""What numpy values a pickle may rebuild (:mod:`rlbuffers.integrations.sb3.inert_pickle`): dtypes
of plain
kinds whose pickled state equals what numpy computes itself, shapes of non-negative ints, and the
size checks the unpickler makes before it allocates."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlbuffers.errors import UnsafePickleError

#: dtype kinds a pickle may rebuild: no objects, no datetimes (whose pickled state numpy
#: trusts to carry their unit: a state without one crashed numpy).
_KINDS = "biufcSUV"


def _kinds(d: np.dtype) -> set[str]:
    """The kinds of ``d`` and of every field and subarray base in it (iterative)."""
    out, todo = set(), [d]
    while todo and len(out) < 64:
        x = todo.pop()
        out.add(x.kind)
        if x.subdtype is not None:
            todo.append(x.subdtype[0])
        if x.fields:
            todo.extend(f[0] for f in x.fields.values())
    return out


def _canonical_dtype(d: np.dtype) -> np.dtype:
    """The dtype numpy builds itself for ``d``'s layout (flags computed, not pickled)."""
    if d.names is not None:
        fields = d.fields or {}
        return np.dtype({"names": list(d.names), "formats": [fields[n][0] for n in d.names],
                         "offsets": [fields[n][1] for n in d.names], "itemsize": d.itemsize,
                         "aligned": d.isalignedstruct})
    if d.subdtype is not None:
        return np.dtype((_canonical_dtype(d.subdtype[0]), d.subdtype[1]))
    return np.dtype(d.str)


def check_dtype(d: Any, what: str = "dtype") -> np.dtype:
    """``d`` if it is a numpy dtype without objects whose flags and size are numpy's own.

    Raises:
        UnsafePickleError: not a dtype, an object dtype, or a forged dtype state.
    """
    if not isinstance(d, np.dtype):
        raise UnsafePickleError(f"{what}: expected a numpy dtype, got {type(d).__name__}")
    if d.hasobject or d.kind == "O" or "O" in d.str:
        raise UnsafePickleError(f"{what}: object dtypes are refused (they hold pointers), "
                                f"got {d!r}")
    if _kinds(d) - set(_KINDS):
        raise UnsafePickleError(f"{what}: expected a dtype of kinds {_KINDS!r} (numbers, "
                                f"bools, bytes, str, structs of these), got {d!r}")
    try:
        ref = _canonical_dtype(d)
    except (TypeError, ValueError, KeyError, RecursionError) as e:
        raise UnsafePickleError(f"{what}: a dtype numpy cannot rebuild ({e})") from None
    if ref.hasobject or d.flags != ref.flags or d.itemsize != ref.itemsize or d != ref:
        raise UnsafePickleError(f"{what}: its pickled state (flags {d.flags}, itemsize "
                                f"{d.itemsize}) differs from numpy's own for {ref!r} (flags "
                                f"{ref.flags}, itemsize {ref.itemsize}): forged")
    return d


def _shape(shape: Any, what: str) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or len(shape) > 64 or not all(
            type(n) is int and n >= 0 for n in shape):
        raise UnsafePickleError(f"{what}: expected a tuple of at most 64 ints >= 0, got "
                                f"{shape!r:.80}")
    return tuple(shape)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for k in shape:
        n *= k
    return n


def _check_dtype_state(state: Any) -> None:
    """Refuse a dtype state numpy itself would not write: ``(3, byteorder, subarray, names,
    fields, elsize, alignment, flags)`` (version 4: and a metadata dict), every part of its
    type (numpy's ``__setstate__`` crashes on some others)."""
    def bad(why: str) -> UnsafePickleError:
        return UnsafePickleError(f"numpy dtype state: {why}, got {state!r:.120}")

    if not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] != len(state) - 5:
        raise bad("expected a version-3 8-tuple or version-4 9-tuple")
    _, order, sub, names, fields, elsize, align, flags = state[:8]
    if order not in ("<", ">", "|", "="):
        raise bad("byteorder: expected one of < > | =")
    if sub is not None and not (isinstance(sub, tuple) and len(sub) == 2
                                and isinstance(sub[0], np.dtype)):
        raise bad("subarray: expected None or (dtype, shape)")
    if sub is not None:
        _shape(sub[1], "numpy dtype subarray shape")
    if (names is None) != (fields is None):
        raise bad("names and fields: expected both or neither")
    if names is not None and not _plain_fields(names, fields):
        raise bad("names and fields: expected a tuple of str naming (dtype, offset[, title])")
    if not all(type(v) is int for v in (elsize, align, flags)) or flags < 0:
        raise bad("elsize, alignment, flags: expected ints")
    if len(state) == 9 and not (state[8] is None or isinstance(state[8], dict)):
        raise bad("metadata: expected None or a dict")


def _plain_fields(names: Any, fields: Any) -> bool:
    return (isinstance(names, tuple) and isinstance(fields, dict)
            and all(type(n) is str for n in names) and set(names) <= set(fields)
            and all(isinstance(v, tuple) and len(v) in (2, 3) and isinstance(v[0], np.dtype)
                    and type(v[1]) is int and v[1] >= 0 for v in fields.values()))


def _dtypes_in(state: Any) -> list[np.dtype]:
    """The dtypes a pickled dtype state names: its subarray base and its fields' dtypes."""
    out: list[np.dtype] = []
    todo, seen = [state], 0
    while todo and seen < 100_000:
        x = todo.pop()
        seen += 1
        if isinstance(x, np.dtype):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    if todo:
        raise UnsafePickleError("numpy dtype state: more than 100,000 parts")
    return out
