"""Nested Minari values (gymnasium ``Dict`` / ``Tuple`` spaces of arrays) as flat buffer
fields and back.

A ``Dict`` value ``{"pos": a, "goal": {"xy": b}}`` under the prefix ``obs`` becomes the fields
``obs.pos`` and ``obs.goal.xy``; a ``Tuple`` value ``(a, b)`` becomes ``obs.0`` and ``obs.1``;
a plain array stays ``obs``. Going back, the space (when known) says which level is a Dict and
which a Tuple; without it every level is a Dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["flatten", "infer_space", "unflatten"]


def flatten(value: Any, prefix: str, *, what: str,
            strict: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """``(field name, array)`` for every leaf of ``value`` (arrays with a leading step axis).

    Args:
        value: an array, or a dict / tuple of them (nested).
        prefix: the field name of the top level (``obs``, ``action``, ``info``...).
        what: named in errors (e.g. ``"episode 3 observations"``).
        strict: refuse leaves that are not numeric or bool arrays (False: yield them too).

    Raises:
        ValueError: a Dict key that is not a non-empty string without ``.``, or a leaf that is
            not a numeric or bool array (e.g. a ``Text`` space's strings).
    """
    if isinstance(value, Mapping):
        for key, sub in value.items():
            if not isinstance(key, str) or not key or "." in key or "/" in key:
                raise ValueError(f"{what}: Dict key {key!r} cannot name a field (expected a "
                                 "non-empty string without '.' or '/')")
            yield from flatten(sub, f"{prefix}.{key}", what=what, strict=strict)
    elif isinstance(value, tuple):
        for i, sub in enumerate(value):
            yield from flatten(sub, f"{prefix}.{i}", what=what, strict=strict)
    else:
        arr = np.asarray(value)
        if strict and arr.dtype.kind not in "biufc":
            raise ValueError(f"{what}: {prefix!r} holds {arr.dtype} values (expected numeric or "
                             "bool arrays; Text and other non-array spaces are not supported)")
        yield prefix, arr


def unflatten(columns: Mapping[str, Any], prefix: str, space: Any = None) -> Any:
    """The nested value whose leaves are ``columns[prefix...]`` (inverse of :func:`flatten`).

    Args:
        columns: field name -> array (other names are ignored).
        prefix: the top level's name.
        space: a gymnasium space giving the structure (None: nested dicts).

    Raises:
        KeyError: no field ``prefix`` and none under ``prefix.``.
    """
    if prefix in columns:
        return columns[prefix]
    import gymnasium as gym

    if isinstance(space, gym.spaces.Tuple):
        return tuple(unflatten(columns, f"{prefix}.{i}", s) for i, s in enumerate(space.spaces))
    if isinstance(space, gym.spaces.Dict):
        return {k: unflatten(columns, f"{prefix}.{k}", s) for k, s in space.spaces.items()}
    head = prefix + "."
    keys = [n[len(head):].split(".", 1)[0] for n in columns if n.startswith(head)]
    if not keys:
        raise KeyError(f"no field {prefix!r} or {head}*")
    return {k: unflatten(columns, head + k) for k in dict.fromkeys(keys)}


def infer_space(columns: Mapping[str, Any], prefix: str) -> Any:
    """A gymnasium space for the fields under ``prefix`` when none was recorded: Box with the
    dtype's full range (float: +-inf; bool: MultiBinary), nested Dicts for dotted names.

    Args:
        columns: field name -> a ``FieldSpec`` (``shape``, ``dtype``).
    """
    import gymnasium as gym

    if prefix in columns:
        spec = columns[prefix]
        dtype, shape = np.dtype(spec.dtype), tuple(spec.shape)
        if dtype.kind == "b":
            return gym.spaces.MultiBinary(list(shape)) if shape else gym.spaces.Discrete(2)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            return gym.spaces.Box(info.min, info.max, shape, dtype)
        return gym.spaces.Box(-np.inf, np.inf, shape, dtype)
    head = prefix + "."
    keys = [n[len(head):].split(".", 1)[0] for n in columns if n.startswith(head)]
    if not keys:
        raise KeyError(f"no field {prefix!r} or {head}*")
    return gym.spaces.Dict({k: infer_space(columns, head + k) for k in dict.fromkeys(keys)})
