"""Running statistics without keeping the history, and schedules evaluated once per step.

:class:`RunningMeanStd` merges batch moments with the parallel update of Chan, Golub &
LeVeque (1979), "Updating formulae and a pairwise algorithm for computing sample variances"
(the batch form of Welford 1962): for counts ``n_a, n_b``, means ``m_a, m_b`` and sums of
squared deviations ``M_a, M_b``: ``delta = m_b - m_a``, ``n = n_a + n_b``,
``m = m_a + delta * n_b / n``, ``M = M_a + M_b + delta**2 * n_a * n_b / n``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np


class RunningMeanStd:
    """Mean and variance of every value seen, per element of ``shape``, in float64.

    Used to normalise rewards or advantages without keeping their history.

    Args:
        shape: shape of one value (``()`` for scalars); ``update`` takes ``[N, *shape]``.

    Attributes:
        count: number of values seen.
        mean: ``float64[*shape]``.
        var: ``float64[*shape]`` population variance (``ddof=0``); 0 before any value.
    """

    def __init__(self, shape: tuple[int, ...] = ()) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.count = 0
        self.mean = np.zeros(self.shape, dtype=np.float64)
        self._m2 = np.zeros(self.shape, dtype=np.float64)

    @property
    def var(self) -> np.ndarray:
        return self._m2 / self.count if self.count else np.zeros(self.shape)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    def update(self, x: Any) -> None:
        """Add a batch ``x: float[N, *shape]`` (a tensor is converted with ``np.asarray``
        after ``.detach().cpu()``).

        Raises:
            ValueError: ``x`` is not ``[N, *shape]`` or holds NaN/inf.
        """
        if hasattr(x, "detach"):
            x = x.detach().cpu()
        a = np.asarray(x, dtype=np.float64)
        if a.ndim == len(self.shape):
            a = a[None] if self.shape else a.reshape(-1)
        if a.shape[1:] != self.shape:
            raise ValueError(f"x: expected shape [N, {', '.join(map(str, self.shape))}], "
                             f"got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("x: expected finite values, got NaN or inf")
        n_b = a.shape[0]
        if n_b == 0:
            return
        mean_b = a.mean(axis=0)
        m2_b = ((a - mean_b) ** 2).sum(axis=0)
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self._m2 = self._m2 + m2_b + delta**2 * (self.count * n_b / n)
        self.count = n

    def normalize(self, x: Any, *, eps: float = 1e-8) -> Any:
        """``(x - mean) / sqrt(var + eps)``, same type as ``x`` (numpy or torch)."""
        if hasattr(x, "detach"):
            mean = x.new_tensor(self.mean.tolist(), dtype=x.dtype)
            return (x - mean) / x.new_tensor(np.sqrt(self.var + eps).tolist(), dtype=x.dtype)
        return (np.asarray(x) - self.mean) / np.sqrt(self.var + eps)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (lists of floats), JSON-ready."""
        return {"shape": list(self.shape), "count": self.count,
                "mean": np.asarray(self.mean).tolist(), "m2": np.asarray(self._m2).tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            ValueError: the state's shape differs from this object's.
        """
        if tuple(state["shape"]) != self.shape:
            raise ValueError(f"state['shape']: expected {list(self.shape)}, "
                             f"got {state['shape']}")
        self.count = int(state["count"])
        self.mean = np.asarray(state["mean"], dtype=np.float64).reshape(self.shape)
        self._m2 = np.asarray(state["m2"], dtype=np.float64).reshape(self.shape)


def cached_schedule(fn: Callable[[int], float]) -> Callable[[int], float]:
    """Wrap a decay schedule ``fn(step) -> value`` (alpha decay, KL coefficient...) so each
    step value is computed once; the wrapper has ``cache_info()`` and ``cache_clear()``.

    Only the latest 1,024 step values are kept, so memory stays bounded over long runs.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable step -> value, got {type(fn).__name__}")
    return functools.lru_cache(maxsize=1024)(fn)
