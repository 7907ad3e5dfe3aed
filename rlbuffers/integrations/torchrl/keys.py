"""A TensorDict's layout as buffer fields: nested keys flattened to field names, torch dtypes to
numpy dtypes, and back. The layout is plain JSON, stored in each commit's metadata."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbuffers.integrations import require

require("torchrl", "torchrl")
require("tensordict", "torchrl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict, TensorDictBase, is_tensor_collection  # noqa: E402

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


@dataclass(frozen=True)
class Entry:
    """One leaf: its buffer field, TensorDict key, torch dtype and shape of one row."""

    field: str
    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The leaves of one stored row (a TensorDict, or a plain tensor when ``tensor``), and that
    row's own batch shape ``row_batch`` (``()`` for one transition)."""

    entries: tuple[Entry, ...]
    row_batch: tuple[int, ...]
    tensor: bool

    def fields(self) -> dict[str, FieldSpec]:
        """Field name -> :class:`~rlbuffers.FieldSpec` (shape: the leaf's shape of one row)."""
        return {e.field: FieldSpec(e.shape, _NUMPY[e.dtype]) for e in self.entries}

    def to_fields(self, data: Any, n: int) -> dict[str, np.ndarray]:
        """``data`` (a TensorDict of batch ``[n, *row_batch]`` or a tensor ``[n, *shape]``) as
        ``{field: ndarray[n, *shape]}``.

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
        out = {}
        for e in self.entries:
            t = leaves[e.key]
            _check_dense(e.key, t)
            if t.dtype != e.dtype or tuple(t.shape) != (n, *e.shape):
                raise ValueError(f"data[{e.key!r}]: expected {e.dtype} of shape "
                                 f"{(n, *e.shape)}, got {t.dtype} of shape {tuple(t.shape)}")
            out[e.field] = _to_numpy(t)
        return out

    def from_fields(self, rows: Mapping[str, np.ndarray], batch: Sequence[int]) -> Any:
        """``rows`` (``{field: ndarray[N, *shape]}``) as a TensorDict of batch ``[*batch,
        *row_batch]`` (or a tensor), ``prod(batch) == N``."""
        leaves = {e.key: _from_numpy(rows[e.field], e.dtype).reshape((*batch, *e.shape))
                  for e in self.entries}
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
                             "shape": list(e.shape)} for e in self.entries]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Layout:
        """The layout :meth:`to_json` wrote.

        Raises:
            ValueError: not such a layout (an unknown dtype or a missing entry).
        """
        try:
            entries = tuple(Entry(str(e["field"]), tuple(e["key"]), _BY_NAME[e["dtype"]],
                                  tuple(int(s) for s in e["shape"])) for e in d["entries"])
            return cls(entries, tuple(int(s) for s in d["row_batch"]), bool(d["tensor"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"metadata['torchrl']: not a ZarrStorage layout ({e!r})") from None


def layout_of(row: Any) -> Layout:
    """The layout of one row: a TensorDict (each leaf a field; nested keys joined with '.',
    root ``done``/``terminated``/``truncated`` named ``root.done`` ...; a name the buffer
    refuses, e.g. one starting with ``_``: ``key<i>``) or a tensor.

    Raises:
        TypeError: a row that is neither, or a leaf that is not a tensor (non-tensor data,
            nested/ragged tensors) or whose dtype cannot be stored.
    """
    if isinstance(row, torch.Tensor):
        return Layout((_entry(0, TENSOR_KEY, row),), (), True)
    if not is_tensor_collection(row):
        raise TypeError(f"data: expected a TensorDict or a tensor, got {type(row).__name__}")
    leaves = _leaves(row)
    entries = tuple(_entry(i, k, t) for i, (k, t) in enumerate(sorted(leaves.items())))
    names = [e.field for e in entries]
    if len(set(names)) != len(names):
        raise TypeError(f"data: keys {sorted(leaves)} flatten to repeated field names {names}")
    return Layout(entries, tuple(row.batch_size), False)


def _check_dense(key: tuple[str, ...], t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"data[{key!r}]: expected a dense tensor, got {kind} (non-tensor and "
                        "nested/ragged entries are not stored: docs/torchrl.md)")


def _entry(i: int, key: tuple[str, ...], t: Any) -> Entry:
    _check_dense(key, t)
    if t.dtype not in _NUMPY:
        raise TypeError(f"data[{key!r}]: dtype {t.dtype} is not stored; expected one of "
                        f"{sorted(_BY_NAME)}")
    name = ".".join(key)
    if name in EPISODE_END_FIELDS:  # TorchRL's root flags are a state's, shaped (1,): not
        name = f"root.{name}"       # the buffer's episode ends (docs/torchrl.md)
    field = name if not field_name_problem(name) else f"key{i}"
    return Entry(field, key, t.dtype, tuple(t.shape))


def _leaves(td: TensorDictBase) -> dict[tuple[str, ...], Any]:
    return {(k,) if isinstance(k, str) else tuple(k): td.get(k)
            for k in td.keys(include_nested=True, leaves_only=True)}


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
