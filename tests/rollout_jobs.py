"""Job functions for the rollout-pool tests (module-level, so Ray workers import them by name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def trajectory(weights: Any, seed: int, length: int) -> dict[str, Any]:
    """A deterministic fake trajectory: obs float32[length, 3] from ``seed``, scaled by the
    shared ``weights["scale"]``."""
    rng = np.random.default_rng(seed)
    return {"obs": (rng.normal(size=(length, 3)) * weights["scale"]).astype(np.float32),
            "seed": seed, "pid": os.getpid()}


def die_once(weights: Any, marker: str, seed: int) -> dict[str, Any]:
    """Kill this worker process the first time it runs (``marker`` does not exist yet)."""
    m = Path(marker)
    if not m.exists():
        m.touch()
        os.kill(os.getpid(), 9)
    return trajectory(weights, seed, 4)


def fail(weights: Any) -> None:
    raise ValueError("job failed on purpose")
