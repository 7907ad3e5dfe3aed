"""A TensorDict's layout as buffer fields: nested keys flattened to field names, torch dtypes to
numpy dtypes, and back. The layout is plain JSON, stored in each commit's metadata.

Three kinds of leaf: dense tensors (a fixed field), nested tensors ragged along their first
axis after the batch (a ragged field of the buffer; read back as a jagged nested tensor) and
non-tensor strings (``NonTensorData`` / ``NonTensorStack``; a ragged ``uint8`` field of UTF-8
bytes; read back as a ``NonTensorStack``, as TorchRL's ``LazyTensorStorage`` returns them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbuffers.integrations import require

require("torchrl", "torchrl")
require("tensordict", "torchrl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import (  # noqa: E402
    TensorDict,
    TensorDictBase,
    is_leaf_nontensor,
    is_non_tensor,
    is_tensor_collection,
)

from rlbuffers import FieldSpec  # noqa: E402
from rlbuffers.spec import EPISODE_END_FIELDS, field_name_problem  # noqa: E402

__all__ = ["Layout", "layout_of"]

#: torch dtypes stored as themselves; bfloat16 (no numpy dtype) is stored as its uint16 bits.
_NUMPY = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8,
          torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
          torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64,
          torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
          torch.complex64: np.complex64, torch.complex128: np.complex128,
          torch.bfloat16: np.uint16}
_BY_NAME = {str(t).removeprefix("torch."): t for t in _NUMPY}
#: the one key of a storage of plain tensors (not TensorDicts)
TENSOR_KEY: tuple[str, ...] = ("tensor",)
#: the kinds of leaf (:attr:`Entry.kind`)
DENSE, RAGGED, STR = "dense", "ragged", "str"


@dataclass(frozen=True)
class Entry:
    """One leaf: its buffer field, TensorDict key, torch dtype and shape of one row, and its
    kind: ``"dense"``; ``"ragged"`` (a nested tensor, ``shape`` the axes after the ragged
    one); ``"str"`` (non-tensor strings, stored as UTF-8 bytes: ``uint8``, ``shape ()``)."""

    field: str
    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str = DENSE

    def spec(self) -> FieldSpec:
        """The buffer field storing this leaf (ragged and strings: first axis ``None``)."""
        lead: tuple[int | None, ...] = () if self.kind == DENSE else (None,)
        return FieldSpec((*lead, *self.shape), _NUMPY[self.dtype])


@dataclass(frozen=True)
class Layout:
    """The leaves of one stored row (a TensorDict, or a plain tensor when ``tensor``), and that
    row's own batch shape ``row_batch`` (``()`` for one transition)."""

    entries: tuple[Entry, ...]
    row_batch: tuple[int, ...]
    tensor: bool

    def fields(self) -> dict[str, FieldSpec]:
        """Field name -> :class:`~rlbuffers.FieldSpec` (shape: the leaf's shape of one row)."""
        return {e.field: e.spec() for e in self.entries}

    def to_fields(self, data: Any, n: int) -> dict[str, Any]:
        """``data`` (a TensorDict of batch ``[n, *row_batch]`` or a tensor ``[n, *shape]``) as
        ``{field: ndarray[n, *shape]}`` (ragged and string leaves: a list of n arrays).

        Raises:
            ValueError: a key missing or added, or a leaf whose dtype or shape differs from the
                layout's (the storage's first row fixed it).
            TypeError: a leaf that is not a dense tensor.
        """
        if self.tensor != (not is_tensor_collection(data)):
            raise ValueError(f"data: expected a {'tensor' if self.tensor else 'TensorDict'} "
                             f"like the storage's first write, got {type(data).__name__}")
        leaves: dict[tuple[str, ...], Any] = {TENSOR_KEY: data} if self.tensor else _leaves(data)
        want = {e.key for e in self.entries}
        if set(leaves) != want:
            raise ValueError(f"data: expected the keys {sorted(want)} of the storage's first "
                             f"write, got {sorted(leaves)} (missing: {sorted(want - set(leaves))}, "
                             f"new: {sorted(set(leaves) - want)})")
        out: dict[str, Any] = {}
        for e in self.entries:
            t = leaves[e.key]
            if e.kind == STR:
                out[e.field] = [np.frombuffer(v.encode("utf-8"), np.uint8)
                                for v in _strings(e.key, t, n)]
                continue
            if e.kind == RAGGED:
                out[e.field] = [_to_numpy(r) for r in _ragged_rows(e, t, n)]
                continue
            _check_dense(e.key, t)
            if t.dtype != e.dtype or tuple(t.shape) != (n, *e.shape):
                raise ValueError(f"data[{e.key!r}]: expected {e.dtype} of shape "
                                 f"{(n, *e.shape)}, got {t.dtype} of shape {tuple(t.shape)}")
            out[e.field] = _to_numpy(t)
        return out

    def from_fields(self, rows: Mapping[str, Any], batch: Sequence[int]) -> Any:
        """``rows`` (``{field: ndarray[N, *shape]}``; ragged fields: a list of N arrays) as a
        TensorDict of batch ``[*batch, *row_batch]`` (or a tensor), ``prod(batch) == N``.
        Ragged leaves come back as a jagged nested tensor ``[N, j, *shape]`` (one row,
        ``batch == ()``: a dense ``[len, *shape]``), strings as a ``NonTensorStack`` (one row:
        ``NonTensorData``).

        Raises:
            ValueError: ``batch`` has more than one axis and the rows hold ragged or string
                leaves (those are read by 1-d indices, as TorchRL's samplers give).
        """
        if len(batch) > 1 and any(e.kind != DENSE for e in self.entries):
            raise ValueError(f"index of shape {tuple(batch)}: rows with ragged or string "
                             "entries are read by an int or a 1-d index")
        leaves: dict[tuple[str, ...], Any] = {}
        for e in self.entries:
            v = rows[e.field]
            if e.kind == DENSE:
                leaves[e.key] = _from_numpy(v, e.dtype).reshape((*batch, *e.shape))
            elif e.kind == STR:
                strings = [bytes(np.ascontiguousarray(r)).decode("utf-8") for r in v]
                leaves[e.key] = strings[0] if not batch else strings
            else:
                parts = [_from_numpy(r, e.dtype) for r in v]
                leaves[e.key] = parts[0] if not batch else _jagged(parts, e)
        if self.tensor:
            return leaves[TENSOR_KEY]
        td = TensorDict({}, batch_size=[*batch, *self.row_batch])
        for key, value in leaves.items():
            td.set(key, value)
        return td

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON data (stored in the commit's metadata)."""
        return {"tensor": self.tensor, "row_batch": list(self.row_batch),
                "entries": [{"field": e.field, "key": list(e.key),
                             "dtype": str(e.dtype).removeprefix("torch."),
                             "shape": list(e.shape), **({"kind": e.kind} if e.kind != DENSE
                                                        else {})} for e in self.entries]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Layout:
        """The layout :meth:`to_json` wrote.

        Raises:
            ValueError: not such a layout (an unknown dtype or a missing entry).
        """
        try:
            entries = tuple(Entry(str(e["field"]), tuple(e["key"]), _BY_NAME[e["dtype"]],
                                  tuple(int(s) for s in e["shape"]), _kind(e.get("kind", DENSE)))
                            for e in d["entries"])
            return cls(entries, tuple(int(s) for s in d["row_batch"]), bool(d["tensor"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"metadata['torchrl']: not a ZarrStorage layout ({e!r})") from None


def layout_of(data: Any) -> Layout:
    """The layout of the rows of ``data``: a TensorDict of batch ``[n, *row_batch]`` (each leaf
    a field; nested keys joined with '.', root ``done``/``terminated``/``truncated`` named
    ``root.done`` ...; a name the buffer refuses, e.g. one starting with ``_``: ``key<i>``)
    or a tensor ``[n, *shape]``. A nested tensor leaf (ragged along its axis after the batch)
    becomes a ragged field, a non-tensor leaf of strings a ragged ``uint8`` field; both need
    ``row_batch == ()``.

    Raises:
        TypeError: ``data`` is neither, or a leaf that cannot be stored: a non-tensor that is
            not a str, a nested tensor ragged along another axis, or an unstored dtype.
    """
    if isinstance(data, torch.Tensor):
        return Layout((_entry(0, TENSOR_KEY, data, ()),), (), True)
    if not is_tensor_collection(data):
        raise TypeError(f"data: expected a TensorDict or a tensor, got {type(data).__name__}")
    row_batch = tuple(data.batch_size[1:])
    leaves = _leaves(data)
    entries = tuple(_entry(i, k, t, row_batch) for i, (k, t) in enumerate(sorted(leaves.items())))
    names = [e.field for e in entries]
    if len(set(names)) != len(names):
        raise TypeError(f"data: keys {sorted(leaves)} flatten to repeated field names {names}")
    return Layout(entries, row_batch, False)


def _kind(kind: Any) -> str:
    if kind not in (DENSE, RAGGED, STR):
        raise ValueError(f"entry kind {kind!r}")
    return str(kind)


def _strings(key: tuple[str, ...], v: Any, n: int) -> list[str]:
    """The ``n`` strings of a non-tensor leaf of a batch of ``n`` rows.

    Raises:
        TypeError: not a non-tensor of strings. ValueError: not ``n`` of them.
    """
    if isinstance(v, str):  # a tensorclass's str field: one string for the whole batch
        return [v] * n
    if not is_non_tensor(v):
        raise TypeError(f"data[{key!r}]: expected non-tensor strings like the storage's "
                        f"first write, got {type(v).__name__}")
    values = v.tolist()
    if not isinstance(values, list):
        values = [values]
    bad = [x for x in values if not isinstance(x, str)]
    if bad:
        raise TypeError(f"data[{key!r}]: non-tensor data must be str to be stored, got "
                        f"{type(bad[0]).__name__} ({bad[0]!r:.40})")
    if len(values) != n:
        raise ValueError(f"data[{key!r}]: expected {n} strings, got {len(values)}")
    return values


def _ragged_rows(e: Entry, t: Any, n: int) -> list[torch.Tensor]:
    """The ``n`` rows ``[len_i, *e.shape]`` of a ragged leaf: a nested tensor, or a dense one
    ``[n, len, *e.shape]`` (one row written alone comes dense).

    Raises:
        ValueError: another dtype, trailing shape or row count.
        TypeError: not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"data[{e.key!r}]: expected a nested tensor, got {type(t).__name__}")
    rows = list(t.unbind(0))
    for r in rows:
        if r.dtype != e.dtype or r.ndim != 1 + len(e.shape) or tuple(r.shape[1:]) != e.shape:
            raise ValueError(f"data[{e.key!r}]: expected rows of {e.dtype} shaped "
                             f"[len, *{list(e.shape)}], got {r.dtype} of shape {list(r.shape)}")
    if len(rows) != n:
        raise ValueError(f"data[{e.key!r}]: expected {n} rows, got {len(rows)}")
    return rows


def _jagged(parts: list[torch.Tensor], e: Entry) -> torch.Tensor:
    """Rows ``[len_i, *e.shape]`` as one jagged nested tensor ``[N, j, *e.shape]``."""
    if not parts:  # torch cannot build an empty nested tensor
        return torch.empty((0, 0, *e.shape), dtype=e.dtype)
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def _check_dense(key: tuple[str, ...], t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"data[{key!r}]: expected a dense tensor like the storage's first "
                        f"write, got {kind} (docs/torchrl.md)")


def _entry(i: int, key: tuple[str, ...], t: Any, row_batch: tuple[int, ...]) -> Entry:
    """The entry of leaf ``t`` of a batch ``[n, *row_batch]`` (a tensor ``[n, *shape]``)."""
    name = ".".join(key)
    if name in EPISODE_END_FIELDS:  # TorchRL's root flags are a state's, shaped (1,): not
        name = f"root.{name}"       # the buffer's episode ends (docs/torchrl.md)
    field = name if not field_name_problem(name) else f"key{i}"
    kind, dtype, shape = DENSE, getattr(t, "dtype", None), tuple(getattr(t, "shape", ())[1:])
    if isinstance(t, str) or is_non_tensor(t) or (isinstance(t, torch.Tensor) and t.is_nested):
        if row_batch:
            raise TypeError(f"data[{key!r}]: ragged and string entries need rows of batch [] "
                            f"(a storage of single transitions), got rows of {list(row_batch)}")
        if isinstance(t, str) or is_non_tensor(t):
            _strings(key, t, 1 if isinstance(t, str) or not isinstance(t.tolist(), list)
                     else len(t.tolist()))
            kind, dtype, shape = STR, torch.uint8, ()
        else:
            first = t.unbind(0)[0] if t.size(0) else t
            kind, shape = RAGGED, tuple(first.shape[1:])
            _ragged_rows(Entry(field, key, t.dtype, shape, RAGGED), t, t.size(0))
    else:
        _check_dense(key, t)
    if dtype not in _NUMPY:
        raise TypeError(f"data[{key!r}]: dtype {dtype} is not stored; expected one of "
                        f"{sorted(_BY_NAME)}")
    return Entry(field, key, dtype, shape, kind)


def _leaves(td: TensorDictBase) -> dict[tuple[str, ...], Any]:
    """Every leaf, non-tensor ones included (TensorDict's default leaves skip them)."""
    return {(k,) if isinstance(k, str) else tuple(k): td.get(k)
            for k in td.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
