"""The RNG states that SB3 training draws from, as plain data (JSON) and back.

SB3 samples replay indices with numpy's global RNG (``np.random.randint``), explores with
``np.random.rand`` and its action space's generator, and SAC samples actions with torch's
global generator; ``set_random_seed`` seeds Python's ``random`` too.
"""

from __future__ import annotations

import base64
import random
from typing import Any, cast

import numpy as np
import torch as th

__all__ = ["restore_rng", "rng_state"]


def rng_state() -> dict[str, Any]:
    """numpy global (MT19937), Python ``random`` and torch CPU generator states, JSON-able."""
    name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())
    version, internal, gauss = random.getstate()
    return {
        "numpy": {"bit_generator": name, "keys": keys.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "torch": base64.b64encode(th.get_rng_state().numpy().tobytes()).decode("ascii"),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Set the numpy global, Python ``random`` and torch CPU generators to ``state`` (from
    :func:`rng_state`).

    Raises:
        KeyError: a state without one of ``numpy``, ``python``, ``torch``.
    """
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], np.array(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    th.set_rng_state(th.from_numpy(raw))
