"""Offline-to-online sampling: each batch drawn from two buffers, an offline dataset and the
online buffer a run fills, with a fixed or scheduled offline fraction.

RLPD (Ball et al. 2023, "Efficient Online Reinforcement Learning with Offline Data") draws
every batch half from the offline data and half from the online buffer ("symmetric
sampling": ``fraction=0.5``); a fraction annealed linearly toward online data
(:class:`LinearFraction`) is the other common schedule. The mixture only calls the buffers'
public methods (``len(buf)``, ``buf.fields``, ``buf.sample(n, rng=...)``), so the offline
buffer may be a read-only snapshot reader (``ReplayBuffer.open(path, mode="r")``) that many
runs share, and either buffer may use any sampler (its ``weights`` are kept).

Both draws use the mixture's own generator, never the buffers', so the mixture's state
(:meth:`Mixture.state_dict`: batches drawn and the generator) resumes the stream exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["OFFLINE", "ONLINE", "LinearFraction", "Mixture", "mix"]

#: ``batch["source"]`` value of a row drawn from the offline buffer
OFFLINE = 0
#: ``batch["source"]`` value of a row drawn from the online buffer
ONLINE = 1


def _fraction_value(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    f = float(value)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    return f


class LinearFraction:
    """An offline fraction annealed linearly: ``start`` at batch 0, ``end`` from batch
    ``steps`` on (as TorchRL's offline-to-online anneal).

    Args:
        start, end: fractions in [0, 1].
        steps: batches over which to anneal (>= 1).

    Raises:
        ValueError: a fraction outside [0, 1] or ``steps`` < 1 (naming the argument).
    """

    def __init__(self, start: float, end: float, steps: int) -> None:
        self.start = _fraction_value("start", start)
        self.end = _fraction_value("end", end)
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
        self.steps = int(steps)

    def __call__(self, step: int) -> float:
        t = min(max(step, 0), self.steps) / self.steps
        return self.start + (self.end - self.start) * t

    def to_dict(self) -> dict[str, Any]:
        """The schedule as JSON (kept in :meth:`Mixture.state_dict`)."""
        return {"linear": [self.start, self.end, self.steps]}

    def __repr__(self) -> str:
        return f"LinearFraction({self.start}, {self.end}, {self.steps})"


Fraction = float | LinearFraction | Callable[[int], float]


def _describe(fraction: Fraction) -> Any:
    if isinstance(fraction, LinearFraction):
        return fraction.to_dict()
    if callable(fraction):
        return "callable"
    return float(fraction)


class Mixture:
    """Batches drawn from ``offline`` and ``online`` buffers; build with :func:`mix`.

    Attributes:
        step: batches drawn so far (the schedule's argument).
        last_counts: ``(offline rows, online rows)`` of the last batch.
    """

    def __init__(self, offline: Any, online: Any, fraction: Fraction = 0.5, *,
                 seed: int | None = None, fields: Sequence[str] | None = None) -> None:
        if not callable(fraction):
            fraction = _fraction_value("fraction", fraction)
        self.offline, self.online, self.fraction = offline, online, fraction
        self.fields = _common_fields(offline.fields, online.fields, fields)
        self._dtypes = {n: np.dtype(online.fields[n].dtype) for n in self.fields}
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.step = 0
        self.last_counts = (0, 0)

    def current_fraction(self) -> float:
        """The offline fraction of the next batch.

        Raises:
            ValueError: the schedule gave a value outside [0, 1].
        """
        f = self.fraction(self.step) if callable(self.fraction) else self.fraction
        return _fraction_value(f"fraction at batch {self.step}", f)

    def _split(self, batch_size: int, f: float) -> int:
        """Offline rows of a batch: ``floor(f * B)``, plus one with probability equal to the
        remainder, so the expected share is exactly ``f`` (no draw when ``f * B`` is whole)."""
        want = f * batch_size
        n = math.floor(want)
        rest = want - n
        if rest > 0 and self._rng.random() < rest:
            n += 1
        return n

    def sample(self, batch_size: int) -> dict[str, Any]:
        """Draw ``batch_size`` (B) rows: ``n`` from the offline buffer, then ``B - n`` from the
        online one, ``n`` following :meth:`current_fraction` ``f`` (``f * B`` whole: exactly
        that; else its floor or ceiling, with mean ``f * B``).

        Returns:
            ``{field: [B, *shape]}`` in the online buffer's dtypes (offline rows first), plus
            ``indices`` int64[B] (each buffer's transition ids), ``source`` uint8[B]
            (:data:`OFFLINE` or :data:`ONLINE`), and ``weights`` float32[B]: importance
            weights toward uniform sampling over both buffers' rows together, i.e. the
            buffer's own weight times ``(len(buffer) / (len(offline) + len(online))) /
            share``, ``share`` = ``f`` (offline) or ``1 - f`` (online): 1 for uniform
            buffers when ``f`` equals the offline share of the rows.

        Raises:
            ValueError: ``batch_size`` < 1 (the generator does not move), or a schedule
                value outside [0, 1]. BufferEmptyError: a buffer asked for rows has none.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
        f = self.current_fraction()
        n_off = self._split(int(batch_size), f)
        n_on = int(batch_size) - n_off
        sizes = (len(self.offline), len(self.online))
        parts = []
        for n, buf, source, share in ((n_off, self.offline, OFFLINE, f),
                                      (n_on, self.online, ONLINE, 1.0 - f)):
            if n:
                draw = buf.sample(n, rng=self._rng)
                scale = (len(buf) / sum(sizes)) / share
                parts.append((draw, source, np.asarray(draw["weights"], np.float64) * scale))
        self.step += 1
        self.last_counts = (n_off, n_on)
        return self._join(parts)

    def _join(self, parts: list[tuple[dict[str, Any], int, np.ndarray]]) -> dict[str, Any]:
        out = {n: np.concatenate([np.asarray(d[n]).astype(self._dtypes[n], copy=False)
                                  for d, _, _ in parts]) for n in self.fields}
        out["indices"] = np.concatenate([np.asarray(d["indices"], np.int64) for d, _, _ in parts])
        out["source"] = np.concatenate([np.full(len(w), s, np.uint8) for _, s, w in parts])
        out["weights"] = np.concatenate([w for _, _, w in parts]).astype(np.float32)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The mixture's state as JSON: ``step``, the generator's state and the schedule
        (store it with a commit, e.g. in the online buffer's ``save(metadata=...)``)."""
        return {"step": self.step, "rng": self._rng.bit_generator.state,
                "fraction": _describe(self.fraction)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next batches equal those the saved mixture
        would have drawn (given the same buffer contents and the buffers' samplers' state).

        Raises:
            ValueError: a malformed state, or one saved with another fraction or schedule.
        """
        if not isinstance(state, dict) or not {"step", "rng", "fraction"} <= state.keys():
            raise ValueError(f"state: expected a dict with step, rng and fraction, got "
                             f"{state!r:.200}")
        mine = _describe(self.fraction)
        if state["fraction"] != mine:
            raise ValueError(f"state: saved with fraction {state['fraction']!r}, this mixture "
                             f"has {mine!r}")
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = state["rng"]
        self._rng, self.step = rng, int(state["step"])

    def __repr__(self) -> str:
        return (f"Mixture(fraction={_describe(self.fraction)!r}, step={self.step}, "
                f"offline={len(self.offline)} rows, online={len(self.online)} rows)")


def _common_fields(off: Any, on: Any, fields: Sequence[str] | None) -> list[str]:
    if fields is None:
        names = [n for n in on if n in off]
        if not names:
            raise ValueError(f"offline, online: no field in common (offline has "
                             f"{', '.join(off)}; online has {', '.join(on)})")
    else:
        names = list(fields)
        for n in names:
            if n not in off or n not in on:
                raise ValueError(f"fields: {n!r} is not a field of both buffers (offline: "
                                 f"{', '.join(off)}; online: {', '.join(on)})")
    for n in names:
        a, b = tuple(off[n].shape), tuple(on[n].shape)
        if a != b:
            raise ValueError(f"field {n!r}: offline shape {a}, online shape {b} (expected "
                             "equal; pass fields= to leave it out)")
        if a and a[0] is None:
            raise ValueError(f"field {n!r}: ragged fields cannot be mixed (pass fields= to "
                             "leave it out)")
    return names


def mix(offline: Any, online: Any, fraction: Fraction = 0.5, *, seed: int | None = None,
        fields: Sequence[str] | None = None) -> Mixture:
    """Sample batches from an offline and an online buffer (see the module docstring).

    Args:
        offline: the offline data, e.g. ``ReplayBuffer.open(path, mode="r")`` of a buffer
            ``rlbuffers convert minari`` wrote.
        online: the buffer the run fills.
        fraction: the offline share of each batch: a number in [0, 1] (0.5: RLPD's
            symmetric sampling), a :class:`LinearFraction`, or any ``step -> fraction``
            callable (its state cannot be checked on resume).
        seed: seed of the mixture's generator (PCG64).
        fields: the fields to return (default: those both buffers have, in the online
            buffer's order).

    Returns:
        a :class:`Mixture`; ``mixture.sample(B)`` draws a batch.

    Raises:
        ValueError: a fraction outside [0, 1], no common field, a field in ``fields`` one
            buffer lacks, a shape that differs between them, or a ragged field.
    """
    return Mixture(offline, online, fraction, seed=seed, fields=fields)
