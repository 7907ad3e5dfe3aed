"""ZarrPrioritizedSampler: TorchRL's ``PrioritizedSampler`` contract on rlbuffers' sum tree, its
priorities a column of the ZarrStorage's buffer (committed with it, restored on reopen)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rlbuffers.integrations import require

require("torchrl", "torchrl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torchrl.data.replay_buffers.samplers import PrioritizedSampler  # noqa: E402

from rlbuffers import PrioritizedSampler as BufferPrioritizedSampler  # noqa: E402
from rlbuffers import ReplayBuffer  # noqa: E402
from rlbuffers.integrations.torchrl.storage import ZarrStorage  # noqa: E402

__all__ = ["SAMPLER_FILE", "ZarrPrioritizedSampler"]

#: the file ``dumps(dir)`` writes in ``dir``: the sampler's settings, as JSON
SAMPLER_FILE = "rlbuffers_sampler.json"
_REDUCTIONS = ("max", "min", "sum", "mean", "median")


class ZarrPrioritizedSampler(PrioritizedSampler):
    """Proportional prioritized replay (Schaul et al., ICLR 2016, Sec. 3.3, Eq. 1 and the
    importance weights of Sec. 3.4) for a :class:`ZarrStorage`, as TorchRL's
    ``PrioritizedSampler``: ``sample(storage, B)`` returns storage indices int64[B] and
    ``{"priority_weight": float32[B]}`` with ``w_i = (p_i / min_k p_k)^-beta``; ``p_i =
    (|priority_i| + eps)^alpha``; new rows get the largest priority seen so far (Algorithm 1).

    The priorities live in the storage's buffer, in rlbuffers' numpy sum tree (no compiled
    extension: it works on any torch): ``storage.commit()`` commits them with the rows, and a
    reopened storage samples at once, the same stream as an uninterrupted one (draws come from
    the buffer's own generator, saved by each commit; TorchRL's ``rb.set_rng`` does not apply).
    A storage attached to a replay buffer with this sampler creates its buffer prioritized.

    Args:
        max_capacity: the storage's ``max_size``.
        alpha: prioritization exponent, >= 0 (0: uniform).
        beta: importance-sampling exponent, in [0, 1]; may be annealed (``sampler.beta = b``).
        eps: added to every ``|priority|``, > 0.
        reduction: how TorchRL's ``TensorDictReplayBuffer`` reduces a row's several
            priorities to one: ``"max"``, ``"min"``, ``"sum"``, ``"mean"`` or ``"median"``.

    Raises:
        ValueError: an argument out of range (named, with its value).
    """

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 reduction: str = "max") -> None:
        if isinstance(max_capacity, bool) or not isinstance(max_capacity, int) \
                or max_capacity < 1:
            raise ValueError(f"ZarrPrioritizedSampler max_capacity: expected an int >= 1, got "
                             f"{max_capacity!r}")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"ZarrPrioritizedSampler reduction: expected one of "
                             f"{_REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        # rlbuffers' PrioritizedSampler checks alpha, beta and eps, naming each
        BufferPrioritizedSampler(alpha=float(alpha), beta=float(beta), eps=float(eps))
        self._max_capacity = max_capacity
        self._alpha_value, self._beta_value, self._eps = float(alpha), float(beta), float(eps)
        self._storage: ZarrStorage | None = None

    # TorchRL's PrioritizedSampler keeps these on its C++ trees: plain values here.
    alpha = property(lambda self: self._alpha_value, doc="Prioritization exponent.")

    @property
    def beta(self) -> float:
        """Importance-sampling exponent (assign to anneal; the next draw uses it)."""
        return self._beta_value

    @beta.setter
    def beta(self, value: float) -> None:
        BufferPrioritizedSampler(alpha=self._alpha_value, beta=float(value), eps=self._eps)
        self._beta_value = float(value)

    max_size = property(lambda self: self._max_capacity, doc="The storage's max_size.")

    def buffer_sampler(self) -> BufferPrioritizedSampler:
        """The rlbuffers sampler a new ZarrStorage's buffer is created with."""
        return BufferPrioritizedSampler(alpha=self._alpha_value, beta=self._beta_value,
                                        eps=self._eps)

    def bind(self, storage: ZarrStorage) -> None:
        """Know ``storage`` (for ``update_priority`` without ``storage=``); the storage calls
        this at each write of a replay buffer using this sampler."""
        self._storage = storage

    def _buffer(self, storage: Any) -> ReplayBuffer:
        if not isinstance(storage, ZarrStorage):
            raise TypeError(f"ZarrPrioritizedSampler storage: expected a ZarrStorage, got "
                            f"{type(storage).__name__}")
        if storage.max_size != self._max_capacity:
            raise ValueError(f"ZarrPrioritizedSampler max_capacity: expected the storage's "
                             f"max_size {storage.max_size}, got {self._max_capacity}")
        buf = storage.buffer
        if buf is None or len(buf) == 0:
            raise RuntimeError("Cannot sample from an empty storage.")
        s = buf.sampler
        if not isinstance(s, BufferPrioritizedSampler):
            raise ValueError(f"ZarrPrioritizedSampler: the buffer at {storage.path!r} was "
                             f"created with the {s.name!r} sampler; attach the storage to a "
                             "replay buffer with this sampler before its first write")
        if not math.isclose(s.alpha, self._alpha_value) or not math.isclose(s.eps, self._eps):
            raise ValueError(f"ZarrPrioritizedSampler alpha, eps: expected the buffer's "
                             f"{s.alpha}, {s.eps}, got {self._alpha_value}, {self._eps}")
        s.beta = self._beta_value
        self._storage = storage
        return buf

    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """Draw ``batch_size`` storage indices (int64[B]) by priority (stratified over B
        equal segments of the total mass, Schaul et al. Appendix B.2.1) and their importance
        weights ``{"priority_weight": float32[B]}``.

        Raises:
            TypeError: ``storage`` is not a ZarrStorage.
            ValueError: another capacity, alpha or eps than the storage's buffer, or a buffer
                not created prioritized.
            RuntimeError: the storage is empty.
        """
        buf = self._buffer(storage)
        ids, weights = buf.draw(batch_size)
        index = torch.from_numpy(ids % buf.capacity)
        return index, {"priority_weight": torch.from_numpy(weights)}

    def update_priority(self, index: Any, priority: Any, *,
                        storage: Any = None) -> None:
        """Set the priorities (``|priority| + eps``) of the rows at storage indices ``index``
        (int64[N]; negative ones are skipped, as TorchRL does); ``priority`` float[N] or a
        scalar for all. The reset a TorchRL replay buffer makes when it is built over a
        non-empty storage (every row to ``default_priority``) is skipped: the committed
        priorities are kept.

        Raises:
            RuntimeError: no storage known yet (pass ``storage``, or sample first).
            rlbuffers.FieldError: unequal lengths, negative or non-finite priorities, or an
                index holding no row.
        """
        first_use, default = self._storage is None, self.default_priority
        storage = storage if storage is not None else self._storage
        if storage is None:
            raise RuntimeError("ZarrPrioritizedSampler.update_priority: pass storage= (or "
                               "sample once first)")
        buf = self._buffer(storage)
        idx = torch.as_tensor(index).detach().cpu().reshape(-1).numpy().astype(np.int64)
        p = torch.as_tensor(priority, dtype=torch.float64).detach().cpu().reshape(-1).numpy()
        if first_use and _is_default_reset(idx, p, len(buf), default):
            return  # TorchRL's replay buffer resets a reopened storage's priorities: kept
        if p.size == 1 and idx.size != 1:
            p = np.full(idx.size, p[0])
        keep = idx >= 0
        if p.size == idx.size:
            idx, p = idx[keep], p[keep]
        # storage index (slot) -> the transition id stored there (slot = id % capacity)
        last = buf.total_added - 1
        ids = last - (last - idx) % buf.capacity
        buf.update_priorities(ids, p)

    def add(self, index: Any) -> None:
        """No-op: a new row gets the largest priority when the storage writes it."""

    def extend(self, index: Any) -> None:
        """No-op: new rows get the largest priority when the storage writes them."""

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        """No-op: overwritten rows are given new priorities by the storage."""

    @property
    def default_priority(self) -> float:
        """The priority new rows get: the largest seen so far (1.0 before any update)."""
        buf = None if self._storage is None else self._storage.buffer
        s = None if buf is None else buf.sampler
        return float(s.max_priority) if isinstance(s, BufferPrioritizedSampler) else 1.0

    def _empty(self) -> None:
        """No-op: the priorities go with the storage's rows."""

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the settings (the priorities are committed with the storage)."""
        return {"max_capacity": self._max_capacity, "alpha": self._alpha_value,
                "beta": self._beta_value, "eps": self._eps, "reduction": self.reduction}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the settings of :meth:`state_dict`.

        Raises:
            ValueError: a value out of range.
        """
        self.__init__(int(state_dict["max_capacity"]), state_dict["alpha"],  # type: ignore[misc]
                      state_dict["beta"], state_dict["eps"],
                      state_dict.get("reduction", "max"))

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Write the settings to ``path/rlbuffers_sampler.json`` (the priorities are in the
        storage's commit)."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        (d / SAMPLER_FILE).write_text(json.dumps(self.state_dict()))

    def loads(self, path: str | os.PathLike[str]) -> None:
        """Read the settings :meth:`dumps` wrote (keeping the storage this sampler knows).

        Raises:
            FileNotFoundError: no settings file in ``path``.
        """
        storage = self._storage
        self.load_state_dict(json.loads((Path(path) / SAMPLER_FILE).read_text()))
        self._storage = storage

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_storage": None}

    def __repr__(self) -> str:
        return (f"ZarrPrioritizedSampler(max_capacity={self._max_capacity}, "
                f"alpha={self._alpha_value}, beta={self._beta_value}, eps={self._eps})")


def _is_default_reset(idx: np.ndarray, p: np.ndarray, n: int, default: float) -> bool:
    """Whether ``(idx, p)`` is TorchRL's reset of all ``n`` rows to the default priority (as
    float32), which ``ReplayBuffer._initialize_prioritized_sampler`` makes on construction."""
    return (len(idx) == n and np.array_equal(idx, np.arange(n))
            and bool(np.all(p == np.float32(default))))
