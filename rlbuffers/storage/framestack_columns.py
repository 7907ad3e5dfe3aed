"""The columns and manifest entries of frame-stacked fields (``FieldSpec(stack_axis=...)``)
and of fields derived from them (``next_of``): their names, the internal side columns a
stacked field needs, and the checks of ``next_of`` and of a manifest's stacked fields. The
encoding and rebuilding of the stacks themselves: :mod:`rlbuffers.core.framestack`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlbuffers.errors import FieldError
from rlbuffers.spec import FieldSpec, field_name_problem


def head_column(name: str) -> str:
    """Internal column holding the earlier stack entries of episode starts and the oldest."""
    return f"_head_{name}"


def final_column(name: str) -> str:
    """Internal column holding the next frame where the next transition is not stored."""
    return f"_final_{name}"


def stacked(fields: Mapping[str, FieldSpec]) -> dict[str, FieldSpec]:
    """The stacked fields of ``fields``."""
    return {n: s for n, s in fields.items() if s.stack_axis is not None}


def side_columns(fields: Mapping[str, FieldSpec],
                 next_of: Mapping[str, str]) -> dict[str, FieldSpec]:
    """The internal columns the stacked fields of ``fields`` need (ragged frames)."""
    out = {}
    for name, spec in stacked(fields).items():
        frame = FieldSpec((None, *spec.column.shape), spec.dtype)
        out[head_column(name)] = frame
        if name in next_of.values():
            out[final_column(name)] = frame
    return out


def check_next_of(fields: Mapping[str, FieldSpec], next_of: Any,
                  reserved: tuple[str, ...]) -> dict[str, str]:
    """Validate ``next_of`` (derived field name -> stacked source field) given to ``create``.

    Raises:
        FieldError: not a mapping of str -> str, a derived name that is a field already or
            that :func:`~rlbuffers.spec.field_name_problem` refuses, a source that is not a
            stacked field, or a source with two derived fields; also an internal column
            name (``_head_F``) too long for a stacked field's name.
    """
    if next_of is None:
        next_of = {}
    if not isinstance(next_of, Mapping):
        raise FieldError(f"next_of: expected a mapping of field name -> stacked field, got "
                         f"{type(next_of).__name__}")
    for name, src in next_of.items():
        problem = field_name_problem(name, reserved)
        if problem:
            raise FieldError(f"next_of: field name {name!r}: {problem}")
        if name in fields:
            raise FieldError(f"next_of: {name!r} is a field already; a derived next field "
                             "has no spec of its own (it takes its source's)")
        if not isinstance(src, str) or src not in fields or fields[src].stack_axis is None:
            raise FieldError(f"next_of[{name!r}]: expected a stacked field (FieldSpec(..., "
                             f"stack_axis=...)) of {sorted(stacked(fields))}, got {src!r}")
    if len(set(next_of.values())) != len(next_of):
        raise FieldError(f"next_of: expected at most one derived field per source, got "
                         f"{dict(next_of)}")
    _check_column_names(fields)
    return dict(next_of)


def _check_column_names(fields: Mapping[str, FieldSpec]) -> None:
    """Raise FieldError if a stacked field's internal column names are not valid names."""
    for name in stacked(fields):
        for col in (head_column(name), final_column(name)):
            if field_name_problem(col, internal=True):
                raise FieldError(f"field {name[:40]!r}...: name too long for a stacked field "
                                 f"(its internal column {col[:40]!r}... must be a valid name)")


def user_fields(fields: Mapping[str, FieldSpec], next_of: Mapping[str, str]) -> dict[str,
                                                                                     FieldSpec]:
    """Every field ``add`` takes and ``sample`` returns: ``fields`` plus the derived ones
    (each with its source's spec)."""
    return {**fields, **{n: fields[src] for n, src in next_of.items()}}


def manifest_problem(fields: Mapping[str, FieldSpec], internal: Mapping[str, FieldSpec],
                     next_of: Any, version: int) -> tuple[str, str, Any] | None:
    """``(key, expected, actual)`` of the first way a manifest's stacked fields, ``next_of``
    and their internal columns disagree, or None."""
    if not isinstance(next_of, dict):
        return "next_of", "a JSON object of field name -> stacked field", next_of
    has = stacked(fields)
    if (has or next_of) and version < 4:
        return "format_version", "4 or more for stacked fields or next_of", version
    try:
        check_next_of(fields, next_of, ("indices", "weights"))
    except FieldError as e:
        return "next_of", f"a valid next_of ({e})", next_of
    if set(next_of) & set(internal):
        return "next_of", "names distinct from the internal columns'", sorted(next_of)
    for col, spec in side_columns(fields, next_of).items():
        if internal.get(col) != spec:
            got = internal[col].to_dict() if col in internal else None
            return f"internal.{col}", f"the column {spec.to_dict()}", got
    return None
