"""The RNG states that SB3 training draws from, as plain data (JSON) and back.

SB3 samples replay indices with numpy's global RNG (``np.random.randint``), explores with
``np.random.rand`` and its action space's generator, and SAC samples actions with torch's
global generator; ``set_random_seed`` seeds Python's ``random`` too.
"""

from __future__ import annotations

import base64
import binascii
import random
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch as th

from rlbuffers.integrations.sb3.checks import is_int, show

__all__ = ["check_rng", "restore_rng", "rng_state", "set_rng"]


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


def check_rng(state: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], th.Tensor]:
    """``state`` (from :func:`rng_state`) checked part by part, without changing any RNG: the
    numpy, Python and torch states ready to set (each first set on a new generator).

    Raises:
        ValueError: ``state`` is not a dict, or a part is missing or wrong (naming
        ``rng.<key>``, what was expected and what was found).
    """
    if not isinstance(state, dict):
        raise ValueError(f"rng: expected a dict with numpy, python, torch, got {show(state)}")
    return _numpy_state(state), _python_state(state), _torch_state(state)


def _numpy_state(state: dict[str, Any]) -> tuple[Any, ...]:
    n = _part(state, "numpy", dict, "a dict (numpy's MT19937 state)")
    if n.get("bit_generator") != "MT19937":
        raise ValueError(f"rng.numpy.bit_generator: expected 'MT19937', got "
                         f"{show(n.get('bit_generator'))}")
    keys = _words("rng.numpy.keys", n.get("keys"), 624)
    pos = n.get("pos")
    if not is_int(pos) or not 0 <= pos <= 624:
        raise ValueError(f"rng.numpy.pos: expected an int in [0, 624], got {show(pos)}")
    if n.get("has_gauss") not in (0, 1) or isinstance(n.get("has_gauss"), float):
        raise ValueError(f"rng.numpy.has_gauss: expected 0 or 1, got {show(n.get('has_gauss'))}")
    cached = n.get("cached_gaussian")
    if not isinstance(cached, int | float) or isinstance(cached, bool):
        raise ValueError(f"rng.numpy.cached_gaussian: expected a float, got {show(cached)}")
    numpy_state = ("MT19937", np.array(keys, dtype=np.uint32), int(pos),
                   int(n["has_gauss"]), float(cached))
    _probe("rng.numpy", lambda: np.random.RandomState().set_state(numpy_state))
    return numpy_state


def _python_state(state: dict[str, Any]) -> tuple[Any, ...]:
    p = _part(state, "python", dict, "a dict (random.getstate())")
    version, gauss = p.get("version"), p.get("gauss")
    if version != 3 or not is_int(version):
        raise ValueError(f"rng.python.version: expected 3, got {show(version)}")
    internal = _words("rng.python.internal", p.get("internal"), 625)
    if internal[-1] > 624:
        raise ValueError(f"rng.python.internal: expected its last item (the index) in "
                         f"[0, 624], got {internal[-1]}")
    if gauss is not None and (not isinstance(gauss, int | float) or isinstance(gauss, bool)):
        raise ValueError(f"rng.python.gauss: expected None or a float, got {show(gauss)}")
    python_state = (3, tuple(int(w) for w in internal), gauss)
    _probe("rng.python", lambda: random.Random().setstate(python_state))
    return python_state


def _torch_state(state: dict[str, Any]) -> th.Tensor:
    text = _part(state, "torch", str, "base64 text of torch's CPU generator state")
    size = th.get_rng_state().numel()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"rng.torch: expected base64 text, got {show(text)} ({e})") from None
    if len(raw) != size:
        raise ValueError(f"rng.torch: expected {size} bytes (torch's CPU generator state), "
                         f"got {len(raw)}")
    torch_state = th.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    _probe("rng.torch", lambda: th.Generator().set_state(torch_state))
    return torch_state


def _part(state: dict[str, Any], key: str, kind: type, what: str) -> Any:
    if not isinstance(state.get(key), kind):
        got = show(state[key]) if key in state else "nothing (missing)"
        raise ValueError(f"rng.{key}: expected {what}, got {got}")
    return state[key]


def _words(name: str, value: Any, n: int) -> list[int]:
    """A list of ``n`` ints in [0, 2**32)."""
    if not isinstance(value, list) or len(value) != n:
        got = f"a list of {len(value)}" if isinstance(value, list) else show(value)
        raise ValueError(f"{name}: expected a list of {n} ints in [0, 2**32), got {got}")
    for i, w in enumerate(value):
        if not (is_int(w) and 0 <= w < 2**32):
            raise ValueError(f"{name}: expected a list of {n} ints in [0, 2**32), got "
                             f"{show(w)} at index {i}")
    return value


def _probe(name: str, set_state: Callable[[], object]) -> None:
    try:
        set_state()
    except (TypeError, ValueError, OverflowError, IndexError, RuntimeError) as e:
        msg = str(e).replace("\n", " ")[:120]
        raise ValueError(f"{name}: expected a state the generator accepts, got one it "
                         f"refuses ({type(e).__name__}: {msg})") from None


def restore_rng(state: dict[str, Any]) -> None:
    """Set the numpy global, Python ``random`` and torch CPU generators to ``state`` (from
    :func:`rng_state`): every part is checked first (:func:`check_rng`), so a refused state
    changes no generator.

    Raises:
        ValueError: ``state`` is not such a state (naming ``rng.<key>``: expected, actual).
    """
    set_rng(check_rng(state))


def set_rng(checked: tuple[tuple[Any, ...], tuple[Any, ...], th.Tensor]) -> None:
    """Set the three generators to what :func:`check_rng` returned (does not raise)."""
    np.random.set_state(checked[0])
    random.setstate(checked[1])
    th.set_rng_state(checked[2])
