"""Field specifications: the shape and dtype of each transition field, checked on every add."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers.errors import FieldError

#: Bytes assumed per ragged row when sizing chunks (ragged lengths are unknown up front).
RAGGED_ROWS_GUESS = 256
#: The dtypes both tiers round-trip exactly (working tier: raw bytes; persistent tier: Zarr v3
#: data types), in native byte order. Not stored: longdouble/clongdouble (no Zarr v3 data
#: type), datetime64/timedelta64, strings, structured and object dtypes.
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128"))
#: Largest row of a field (fixed: one transition; ragged: one row along the ragged axis).
MAX_ROW_BYTES = 2**31
#: Most axes of a field's shape.
MAX_NDIM = 32


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one transition field.

    Args:
        shape: per-transition shape, e.g. ``(4, 84, 84)`` for stacked Atari frames or ``()``
            for a scalar reward. A first entry of ``None`` makes the field *ragged*
            (variable length along that axis), e.g. ``(None,)`` for token ids.
        dtype: a numpy dtype or its name (``"uint8"``, ``"float32"``, ``"bool"``...). Values
            of another numeric type are converted only when nothing is lost: integers must
            lie in the dtype's range, floats stored in an integer field must be whole
            numbers, bool fields take 0/1, and a finite float must stay finite (float64 ->
            float32 rounding of in-range values is accepted: that is precision, not range).
        finite: reject NaN and +-inf on ``add`` / ``extend`` (float dtypes only). By default
            non-finite values are stored like any other (``rlbuffers inspect`` counts them).
        stack_axis: the axis of ``shape`` along which the field is a stack of the last
            ``k = shape[stack_axis]`` frames of an episode (oldest first), e.g.
            ``FieldSpec((4, 84, 84), "uint8", stack_axis=0)``. The buffer then stores each
            frame once (:mod:`rlbuffers.core.framestack`); ``None`` (default): a plain field.

    Raises:
        FieldError: ``None`` anywhere but the first axis, a size < 1, a dtype the tiers do
            not store (see :data:`SUPPORTED_DTYPES`), a row over :data:`MAX_ROW_BYTES`, or
            ``finite`` on a non-float dtype, or a ``stack_axis`` on a ragged field or outside
            ``[-ndim, ndim)``.
    """

    shape: tuple[int | None, ...]
    dtype: Any
    finite: bool = False
    stack_axis: int | None = None

    def __post_init__(self) -> None:
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise FieldError(f"shape: expected a tuple of sizes, got {self.shape!r}") from None
        try:
            dtype = np.dtype(self.dtype)
        except (TypeError, ValueError, SyntaxError) as e:
            raise FieldError(f"dtype: expected one of {supported_dtypes()}, got "
                             f"{self.dtype!r} ({e})") from None
        if len(shape) > MAX_NDIM:
            raise FieldError(f"shape {shape}: expected at most {MAX_NDIM} axes")
        if any(s is None for s in shape[1:]):
            raise FieldError(f"shape {shape}: only the first axis may be None (ragged)")
        if any(s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer))
                                  or s < 1) for s in shape):
            raise FieldError(
                f"shape {shape}: expected sizes that are integers >= 1 or a leading None (a "
                "zero-size axis stores nothing; a ragged row may still have length 0)"
            )
        if dtype not in SUPPORTED_DTYPES or not dtype.isnative:
            raise FieldError(f"dtype {dtype} ({dtype.str}): not stored; expected one of "
                             f"{supported_dtypes()} in native byte order")
        row = int(np.prod([s for s in shape if s is not None], dtype=object) or 1)
        if row * dtype.itemsize > MAX_ROW_BYTES:
            raise FieldError(f"shape {shape} {dtype}: a row of {row * dtype.itemsize} bytes; "
                             f"expected at most {MAX_ROW_BYTES}")
        if self.finite and dtype.kind != "f":
            raise FieldError(f"finite=True: expected a float dtype, got {dtype}")
        object.__setattr__(self, "finite", bool(self.finite))
        if self.stack_axis is not None:
            object.__setattr__(self, "stack_axis", _stack_axis(shape, self.stack_axis))
        object.__setattr__(self, "shape", tuple(None if s is None else int(s) for s in shape))
        object.__setattr__(self, "dtype", dtype)

    @property
    def ragged(self) -> bool:
        """True when the first axis is variable-length."""
        return len(self.shape) > 0 and self.shape[0] is None

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row of a ragged field (trailing axes); the full shape otherwise."""
        return tuple(self.shape[1:]) if self.ragged else tuple(self.shape)  # type: ignore[arg-type]

    @property
    def item_bytes(self) -> int:
        """Bytes of one transition (fixed fields) or of one row along the ragged axis."""
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def stack(self) -> int:
        """Frames in a stack, ``k = shape[stack_axis]`` (1 for a plain field)."""
        return 1 if self.stack_axis is None else int(self.shape[self.stack_axis])  # type: ignore

    @property
    def column(self) -> FieldSpec:
        """The spec of what one slot stores: a stacked field stores one frame (``shape``
        without ``stack_axis``, e.g. ``(84, 84)``); any other field itself."""
        if self.stack_axis is None:
            return self
        frame = self.shape[:self.stack_axis] + self.shape[self.stack_axis + 1:]
        return FieldSpec(frame, self.dtype, self.finite)

    def estimate_bytes(self) -> int:
        """Bytes per transition used to size chunks (ragged: a guess of 256 rows)."""
        return self.item_bytes * (RAGGED_ROWS_GUESS if self.ragged else 1)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form for the manifest (``finite`` only when set, so manifests written
        before it existed read back unchanged)."""
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype.str}
        if self.finite:
            out["finite"] = True
        if self.stack_axis is not None:
            out["stack_axis"] = self.stack_axis
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FieldSpec:
        """Inverse of :meth:`to_dict`.

        Raises:
            FieldError: not a dict of ``shape`` (a list), ``dtype`` (a string), an
                optional ``finite`` (a bool) and ``stack_axis`` (an int), or a spec
                :class:`FieldSpec` refuses.
        """
        axis = d.get("stack_axis") if isinstance(d, dict) else None
        if not isinstance(d, dict) or not isinstance(d.get("shape"), list) \
                or not isinstance(d.get("dtype"), str) \
                or not isinstance(d.get("finite", False), bool) \
                or (axis is not None and (isinstance(axis, bool) or not isinstance(axis, int))):
            raise FieldError(f"field spec: expected {{'shape': [...], 'dtype': str, "
                             f"'finite': bool, 'stack_axis': int}}, got {d!r:.200}")
        return cls(tuple(d["shape"]), d["dtype"], d.get("finite", False), axis)

    def describe(self) -> str:
        """Human form, e.g. ``(None, 4) int32`` (``(4, 84, 84) uint8 stack_axis=0``)."""
        stacked = "" if self.stack_axis is None else f" stack_axis={self.stack_axis}"
        return f"{tuple(self.shape)} {self.dtype}{stacked}"


def _stack_axis(shape: tuple[Any, ...], axis: Any) -> int:
    """``axis`` of ``shape`` as a non-negative int.

    Raises:
        FieldError: not an int in ``[-ndim, ndim)``, or a ragged ``shape``.
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not (
            -len(shape) <= axis < len(shape)) or None in shape:
        raise FieldError(f"stack_axis: expected an axis of a fixed shape, in "
                         f"[{-len(shape)}, {len(shape)}), for shape {shape}, got {axis!r}")
    return int(axis) % len(shape)


def supported_dtypes() -> str:
    """The names of :data:`SUPPORTED_DTYPES`, for messages."""
    return ", ".join(str(d) for d in SUPPORTED_DTYPES)


def _first(arr: np.ndarray, bad: np.ndarray) -> Any:
    """The first value of ``arr`` where ``bad`` is True, as a Python scalar."""
    return arr.reshape(-1)[int(np.argmax(bad.reshape(-1)))].item()


def _lost_value(arr: np.ndarray, out: np.ndarray, dtype: np.dtype) -> Any | None:
    """A value of ``arr`` that ``out = arr.astype(dtype)`` did not keep, or None."""
    if arr.size == 0:
        return None
    if dtype.kind == "b":
        bad = (arr != 0) & (arr != 1)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        if arr.dtype.kind == "b":
            return None
        if arr.dtype.kind == "f":  # bounds as exact floats: 2**63 is, int64's max is not
            bad = ~np.isfinite(arr) | (arr != np.floor(arr)) | (arr < float(info.min)) \
                | (arr >= float(info.max + 1))
        elif info.min <= arr.min().item() and arr.max().item() <= info.max:
            return None  # integer -> integer in range (compared as Python ints)
        else:
            wide = arr.astype(object)  # only on the error path
            bad = (wide < info.min) | (wide > info.max)
    else:  # float target: a finite value must stay finite
        bad = np.isfinite(arr) & ~np.isfinite(out) if arr.dtype.kind == "f" else ~np.isfinite(out)
    return _first(arr, bad) if bad.any() else None


def _cast(name: str, spec: FieldSpec, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != spec.dtype:
        if arr.dtype.kind not in "biuf":
            raise FieldError(f"field {name!r}: expected dtype {spec.dtype}, got {arr.dtype} "
                             "(values of another dtype must be numeric or bool)")
        with np.errstate(invalid="ignore", over="ignore"):
            out = arr.astype(spec.dtype)
            lost = _lost_value(arr, out, spec.dtype)
        if lost is not None:
            raise FieldError(f"field {name!r}: value {lost!r} ({arr.dtype}) does not fit dtype "
                             f"{spec.dtype} without loss")
        arr = out
    if spec.finite and arr.size and not np.isfinite(arr).all():
        raise FieldError(f"field {name!r}: expected finite values (finite=True), got "
                         f"{_first(arr, ~np.isfinite(arr))!r}")
    return arr


def check_row(name: str, spec: FieldSpec, value: Any) -> np.ndarray:
    """Validate one transition's value for field ``name``.

    Returns:
        the value as an array of ``spec.dtype`` and shape ``spec.shape`` (ragged: ``[n, *row]``).

    Raises:
        FieldError: wrong shape, a value that does not fit ``spec.dtype`` (out of range, a
            fraction into an integer field), or a non-finite value with ``spec.finite``.
    """
    arr = _cast(name, spec, value)
    ok = (
        arr.ndim == len(spec.shape) and arr.shape[1:] == spec.row_shape
        if spec.ragged
        else arr.shape == spec.shape
    )
    if not ok:
        raise FieldError(
            f"field {name!r}: expected shape {spec.describe()}, got {tuple(arr.shape)} {arr.dtype}"
        )
    return arr


def check_batch(name: str, spec: FieldSpec, value: Any, batch_size: int | None) -> Any:
    """Validate a batch of ``B`` values for field ``name`` (leading axis = B).

    Fixed fields: an array ``[B, *shape]``. Ragged fields: a sequence of ``B`` arrays
    ``[n_i, *row_shape]``.

    Returns:
        the validated array (fixed) or list of arrays (ragged).

    Raises:
        FieldError: wrong shape, a value that does not fit ``spec.dtype`` (named with the
            field and the dtype), a non-finite value with ``spec.finite``, or a batch size
            that differs from ``batch_size``.
    """
    if spec.ragged:
        if isinstance(value, np.ndarray) and value.dtype != object:
            raise FieldError(
                f"field {name!r}: ragged field expects a sequence of arrays, got "
                f"one array of shape {value.shape}"
            )
        rows: list[np.ndarray] | np.ndarray = [check_row(name, spec, v) for v in value]
        n = len(rows)
    else:
        arr = _cast(name, spec, value)
        if arr.shape[1:] != spec.shape or arr.ndim != len(spec.shape) + 1:
            raise FieldError(
                f"field {name!r}: expected shape (B, {', '.join(map(str, spec.shape))}) "
                f"{spec.dtype}, got {tuple(arr.shape)} {arr.dtype}"
            )
        rows, n = arr, arr.shape[0]
    if batch_size is not None and n != batch_size:
        raise FieldError(f"field {name!r}: expected batch size {batch_size}, got {n}")
    return rows


def transition_rows(fields: dict[str, FieldSpec], transition: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """One transition (``{field: value}``, shapes as in ``fields``) checked against ``fields``
    as a batch of one: ``{field: [1, *shape]}`` (ragged: a list of one array).

    Raises:
        FieldError: an unknown or missing field, or a wrong shape or dtype.
    """
    check_names(list(fields), list(transition))
    out: dict[str, Any] = {}
    for n, s in fields.items():
        row = check_row(n, s, transition[n])
        out[n] = [row] if s.ragged else row[None]
    return out


def batch_of_rows(fields: dict[str, FieldSpec], batch: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], int]:
    """A batch (``{field: [B, *shape]}``, ragged: B arrays) checked against ``fields``, and B.

    Raises:
        FieldError: an unknown or missing field, a wrong shape or dtype, or unequal batch
        sizes.
    """
    check_names(list(fields), list(batch))
    size = len(batch[next(iter(fields))])
    return {n: check_batch(n, s, batch[n], size) for n, s in fields.items()}, size


def check_names(fields: Sequence[str], given: Sequence[str]) -> None:
    """Raise :class:`FieldError` naming unknown or missing fields."""
    unknown = sorted(set(given) - set(fields))
    missing = sorted(set(fields) - set(given))
    if unknown:
        raise FieldError(f"unknown field(s) {unknown}; the buffer's fields are {sorted(fields)}")
    if missing:
        raise FieldError(f"missing field(s) {missing}; every transition needs {sorted(fields)}")


#: Boolean fields whose True value ends an episode.
EPISODE_END_FIELDS = ("terminated", "truncated", "done")


def episode_ends(rows: dict[str, Any], n: int) -> np.ndarray:
    """bool[n]: which of ``n`` transitions (``rows``: field -> ``[n, ...]``) end an episode
    (any of :data:`EPISODE_END_FIELDS` set)."""
    done = np.zeros(n, dtype=bool)
    for name in EPISODE_END_FIELDS:
        if name in rows:
            done |= np.asarray(rows[name], dtype=bool).reshape(n)
    return done


#: Longest field name (it is a file name in both tiers).
MAX_NAME_CHARS = 200


def field_name_problem(name: Any, reserved: Sequence[str] = (), internal: bool = False) -> str:
    """Why ``name`` is not a valid field name (``""`` if it is): the one rule for names given
    to ``create`` and names read from a manifest. A name is a file name in both tiers, so it
    must be a non-empty string of at most :data:`MAX_NAME_CHARS` characters, must not start
    with ``.`` or (user fields) ``_``, must not contain ``/``, ``\\``, NUL or other control
    characters, and must not be in ``reserved``. Internal columns (``internal``) start with
    ``_`` and follow the same rule after it."""
    rule = (f"must be a non-empty string of at most {MAX_NAME_CHARS} characters, must not "
            "start with '_' or '.', contain '/', '\\' or control characters, or be one of "
            f"{tuple(reserved)}")
    if not isinstance(name, str):
        return rule
    if internal:
        if not name.startswith("_"):
            return "expected an internal column name starting with '_'"
        name = name[1:]
    if (not name or len(name) > MAX_NAME_CHARS or name.startswith(("_", "."))
            or any(ch in name for ch in "/\\") or any(ord(ch) < 32 or ord(ch) == 127
                                                         for ch in name)
            or name in reserved):
        return rule
    return ""


def check_field_specs(fields: Any, reserved: Sequence[str] = ()) -> None:
    """Validate the ``fields`` mapping given to ``ReplayBuffer.create``.

    Raises:
        FieldError: no fields, a value that is not a :class:`FieldSpec`, a name that
        :func:`field_name_problem` refuses, or an episode-end
        flag (``terminated``, ``truncated``, ``done``) that is not ``FieldSpec((), "bool")``.
    """
    if not fields:
        raise FieldError("fields: expected at least one field, got none")
    for name, spec in fields.items():
        if not isinstance(spec, FieldSpec):
            raise FieldError(f"field {name!r}: expected a FieldSpec, got {type(spec).__name__}")
        problem = field_name_problem(name, reserved)
        if problem:
            raise FieldError(f"field name {name!r}: {problem}")
        if name in EPISODE_END_FIELDS and (spec.shape != () or spec.dtype != np.bool_):
            raise FieldError(
                f"field {name!r}: episode-end flags must be FieldSpec((), 'bool'), "
                f"got {spec.describe()}"
            )


def batch_rows(fields: dict[str, FieldSpec], shape: tuple[int, ...], gather: Any) -> dict[str, Any]:
    """Shape gathered rows as a batch: ``{field: [*shape, *row_shape]}``; ragged fields give a
    list (``shape = (B,)``) or a list of ``B`` lists of ``L`` arrays (``shape = (B, L)``), or
    whatever else ``gather`` returned for them as it is (a :class:`~rlbuffers.packed.Packed`
    or :class:`~rlbuffers.padded.Padded` of all ``B * L`` rows). ``gather(name)`` returns the
    flat rows of field ``name``."""
    out: dict[str, Any] = {}
    for name, spec in fields.items():
        data = gather(name)
        if not spec.ragged:
            out[name] = data.reshape(*shape, *spec.row_shape)
        elif len(shape) == 1 or not isinstance(data, list):
            out[name] = data
        else:
            out[name] = [data[i:i + shape[1]] for i in range(0, len(data), shape[1])]
    return out
