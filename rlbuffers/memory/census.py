"""A census of live torch tensors: bytes by device, dtype and owner, and the largest ones."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

OWNERS = ("parameter", "gradient", "optimizer_state", "other")


@dataclass(frozen=True)
class TensorSummary:
    """Live tensors grouped by ``(device, dtype, owner)``.

    Attributes:
        groups: ``[{"device", "dtype", "owner", "count", "bytes"}]``, largest first.
        top: the ``k`` largest tensors: ``[{"shape", "device", "dtype", "owner", "bytes"}]``.
        total_bytes: bytes of all distinct storages counted.
    """

    groups: list[dict[str, Any]] = field(default_factory=list)
    top: list[dict[str, Any]] = field(default_factory=list)
    total_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form."""
        return {"groups": self.groups, "top": self.top, "total_bytes": self.total_bytes}


def _owners(objects: list[Any]) -> dict[int, str]:
    """id(tensor) -> owner for parameters, their gradients and optimizer state."""
    owner: dict[int, str] = {}
    for obj in objects:
        kind = type(obj)  # not isinstance: some objects warn when __class__ is read
        if issubclass(kind, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        owner[id(v)] = "optimizer_state"
        elif issubclass(kind, torch.nn.Parameter):
            owner[id(obj)] = "parameter"
            if obj.grad is not None:
                owner[id(obj.grad)] = "gradient"
    return owner


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    st = t.untyped_storage()
    return str(t.device), st.data_ptr() if st.data_ptr() else id(st)


def tensor_summary(*, top_k: int = 10) -> TensorSummary:
    """Count the torch tensors alive now (found through the garbage collector).

    A storage shared by several views is counted once, for the first tensor met; owners are
    ``parameter`` (``nn.Parameter``), ``gradient`` (a parameter's ``.grad``),
    ``optimizer_state`` (in a live ``torch.optim.Optimizer``'s state) and ``other``.

    Args:
        top_k: how many of the largest tensors to list (>= 0).

    Raises:
        ValueError: ``top_k`` < 0.
    """
    if top_k < 0:
        raise ValueError(f"top_k: expected >= 0, got {top_k}")
    objects = gc.get_objects()
    owner = _owners(objects)
    seen: set[tuple[str, int]] = set()
    groups: dict[tuple[str, str, str], list[int]] = {}
    tensors: list[dict[str, Any]] = []
    for obj in objects:
        if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        key = _storage_key(obj)
        if key in seen:
            continue
        seen.add(key)
        nbytes = obj.untyped_storage().nbytes()
        who = owner.get(id(obj), "other")
        g = groups.setdefault((str(obj.device), str(obj.dtype), who), [0, 0])
        g[0] += 1
        g[1] += nbytes
        tensors.append({"shape": list(obj.shape), "device": str(obj.device),
                        "dtype": str(obj.dtype), "owner": who, "bytes": nbytes})
    rows: list[dict[str, Any]] = [{"device": d, "dtype": t, "owner": o, "count": c, "bytes": b}
                                  for (d, t, o), (c, b) in groups.items()]
    rows.sort(key=lambda r: -int(r["bytes"]))
    tensors.sort(key=lambda r: -int(r["bytes"]))
    return TensorSummary(rows, tensors[:top_k], sum(r["bytes"] for r in rows))
