"""Samplers: pure index policies. A sampler never reads transition data; it returns slots.

The contract every sampler meets is :class:`Sampler` (a ``Protocol``). Samplers are registered
by name (:func:`register_sampler`), the name is stored in the buffer's manifest with the
sampler's settings, and :func:`sampler_from_state` rebuilds it on ``open``: a user-defined
sampler saves and reopens like the built-in ones once registered.

- :class:`UniformSampler`: every stored transition equally likely.
- :class:`PrioritizedSampler`: proportional prioritized replay (Schaul et al., 2016).
- :class:`SequenceSampler`: contiguous windows of ``length`` transitions that never cross an
  episode boundary or the ring seam.
- :class:`GroupSampler`: whole groups (e.g. GRPO's G completions of one prompt), uniform or
  recency-weighted.

Randomness always comes from the ``np.random.Generator`` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from rlbuffers.errors import BufferEmptyError, FieldError, NotPrioritizedError
from rlbuffers.ring import RingState
from rlbuffers.sampling.base import (
    EPISODE_ID,
    PRIORITY,
    Draw,
    SampleContext,
    Sampler,
    register_sampler,
    registered_samplers,
)
from rlbuffers.sampling.group import GroupSampler
from rlbuffers.sampling.segment_tree import SegmentTree
from rlbuffers.spec import FieldSpec

__all__ = [
    "EPISODE_ID", "PRIORITY", "Draw", "GroupSampler", "PrioritizedSampler", "SampleContext",
    "Sampler", "SequenceSampler", "UniformSampler", "generator_from_state", "priority_update",
    "register_sampler", "sampler_from_state",
]

def sampler_from_state(state: dict[str, Any]) -> Sampler:
    """Rebuild a sampler from its ``state_dict()``.

    Raises:
        ValueError: ``state["type"]`` names no registered sampler.
    """
    kind = state.get("type")
    registry = registered_samplers()
    if kind not in registry:
        raise ValueError(f"sampler type: expected one of {sorted(registry)}, got {kind!r} "
                         "(register a custom sampler with rlbuffers.register_sampler)")
    return registry[kind].from_state_dict(state)


def priority_update(sampler: Sampler, ctx: SampleContext, ring: RingState, indices: Any,
                    priorities: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Give the sampler new priorities of transition ids ``indices`` (int64[N]); returns the
    distinct slots still stored (int64[k]), their raw priorities (float64[k]) to store in
    the :data:`PRIORITY` column, and how many ids were still stored (ids of transitions
    overwritten since they were sampled are skipped). Where an id repeats, its last priority
    wins.

    Raises:
        NotPrioritizedError: the sampler keeps no priorities. FieldError: ``priorities`` not
        float[N] finite and >= 0, or ids never added.
    """
    update = getattr(sampler, "update", None)
    if PRIORITY not in sampler.extra_columns or update is None:
        raise NotPrioritizedError("update_priorities needs a PrioritizedSampler, buffer "
                                  f"has {type(sampler).__name__}")
    ids = np.asarray(indices, dtype=np.int64).ravel()
    pr = np.asarray(priorities, dtype=np.float64).ravel()
    n = len(ids)
    if pr.shape != (n,):
        raise FieldError(f"priorities: expected shape ({n},) like indices, got {pr.shape}")
    if not np.all(np.isfinite(pr)) or (pr < 0).any():
        raise FieldError(
            "priorities: expected finite values >= 0, got "
            f"min {np.nanmin(pr) if len(pr) else 0}, non-finite {int((~np.isfinite(pr)).sum())}"
        )
    live = ring.live(ids)
    slots, last = np.unique((ids[live] % ring.capacity)[::-1], return_index=True)
    if not len(slots):
        return slots, np.zeros(0), 0
    return slots, update(slots, pr[live][::-1][last], ctx), int(live.sum())


def generator_from_state(state: dict[str, Any]) -> np.random.Generator:
    """A ``np.random.Generator`` in the saved ``bit_generator.state`` ``state``."""
    rng = np.random.Generator(getattr(np.random, state["bit_generator"])())
    rng.bit_generator.state = state
    return rng


def _need(ctx: SampleContext, n: int) -> None:
    if ctx.size < n:
        raise BufferEmptyError(f"cannot sample: buffer holds {ctx.size} transitions, need >= {n}")


@register_sampler
@dataclass
class UniformSampler:
    """Uniform sampling with replacement over the stored transitions."""

    name: ClassVar[str] = "uniform"
    extra_columns: ClassVar[dict[str, FieldSpec]] = {}

    def sample(self, batch_size: int, ctx: SampleContext, rng: np.random.Generator) -> Draw:
        _need(ctx, 1)
        logical = rng.integers(0, ctx.size, size=batch_size)
        return Draw(ctx.slots(logical), np.ones(batch_size, dtype=np.float32))

    def on_write(self, slots: np.ndarray, ctx: SampleContext) -> np.ndarray | None:
        """Called after new transitions land in ``slots``; returns their priorities (none)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> UniformSampler:
        return cls()


@register_sampler
@dataclass
class SequenceSampler:
    """Windows of ``length`` consecutive transitions from one episode, uniformly over all valid
    window starts (rejection sampling; an exact scan of valid starts when rejections pile up).

    ``sample`` returns slots ``[B, length]``; a window never crosses an episode end (a
    transition whose ``terminated``/``truncated``/``done`` flag is set ends its episode) nor
    the ring seam (it lies within logical indices ``[0, size)``).
    """

    length: int
    name: ClassVar[str] = "sequence"
    extra_columns: ClassVar[dict[str, FieldSpec]] = {}

    def __post_init__(self) -> None:
        if int(self.length) < 1:
            raise ValueError(f"SequenceSampler.length: expected >= 1, got {self.length}")
        self.length = int(self.length)

    def _valid(self, starts: np.ndarray, ctx: SampleContext) -> np.ndarray:
        first = ctx.episode_ids(ctx.slots(starts))
        last = ctx.episode_ids(ctx.slots(starts + self.length - 1))
        return first == last

    def sample(self, batch_size: int, ctx: SampleContext, rng: np.random.Generator) -> Draw:
        _need(ctx, self.length)
        n_starts = ctx.size - self.length + 1
        chosen: list[np.ndarray] = []
        have = 0
        for _ in range(16):
            cand = rng.integers(0, n_starts, size=2 * (batch_size - have) + 8)
            ok = cand[self._valid(cand, ctx)]
            chosen.append(ok[: batch_size - have])
            have += len(chosen[-1])
            if have == batch_size:
                break
        else:
            valid = np.flatnonzero(self._valid(np.arange(n_starts), ctx))
            if len(valid) == 0:
                raise BufferEmptyError(
                    f"no episode segment of length {self.length} in {ctx.size} transitions"
                )
            chosen.append(rng.choice(valid, size=batch_size - have))
        starts = np.concatenate(chosen)
        logical = starts[:, None] + np.arange(self.length)
        return Draw(ctx.slots(logical), np.ones(batch_size, dtype=np.float32))

    def on_write(self, slots: np.ndarray, ctx: SampleContext) -> np.ndarray | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.name, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.length = int(state["length"])

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> SequenceSampler:
        return cls(length=int(state["length"]))


@register_sampler
@dataclass
class PrioritizedSampler:
    """Proportional prioritized experience replay (Schaul et al., ICLR 2016, Sec. 3.3).

    A transition with priority ``p_i`` (stored as ``|delta_i| + eps``) is drawn with
    probability ``P(i) = p_i^alpha / sum_k p_k^alpha`` (Eq. 1), using stratified sampling over
    ``batch_size`` equal segments of the total mass (Appendix B.2.1). Importance weights are
    ``w_i = (N * P(i))^-beta / max_j w_j`` (Sec. 3.4), with ``max_j`` over all stored
    transitions (the one with the smallest priority). New transitions get the largest priority
    seen so far (Algorithm 1, line 6).

    Args:
        alpha: prioritization exponent (0 = uniform), >= 0.
        beta: importance-sampling exponent (1 = full correction), in [0, 1]; may be annealed by
            assigning ``sampler.beta``.
        eps: added to every priority so no transition gets probability 0, > 0.
    """

    alpha: float = 0.6
    beta: float = 0.4
    eps: float = 1e-6
    max_priority: float = 1.0
    name: ClassVar[str] = "prioritized"
    extra_columns: ClassVar[dict[str, FieldSpec]] = {PRIORITY: FieldSpec((), "float64")}
    #: (sum tree, min tree) over ``p^alpha``, built on first use
    _trees_: tuple[SegmentTree, SegmentTree] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.alpha >= 0:
            raise ValueError(f"PrioritizedSampler.alpha: expected >= 0, got {self.alpha}")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"PrioritizedSampler.beta: expected in [0, 1], got {self.beta}")
        if not self.eps > 0:
            raise ValueError(f"PrioritizedSampler.eps: expected > 0, got {self.eps}")

    def _trees(self, ctx: SampleContext) -> tuple[SegmentTree, SegmentTree]:
        """The sum and min trees, built from the stored priorities on first use (lazy, so that
        opening a buffer stays O(1))."""
        if self._trees_ is None:
            raw = ctx.priorities()
            scaled = np.where(raw > 0, raw, 0.0) ** self.alpha
            tsum = SegmentTree(ctx.capacity, np.add, 0.0)
            tsum.rebuild(np.where(raw > 0, scaled, 0.0))
            tmin = SegmentTree(ctx.capacity, np.minimum, np.inf)
            tmin.rebuild(np.where(raw > 0, scaled, np.inf))
            self._trees_ = (tsum, tmin)
        return self._trees_

    def sample(self, batch_size: int, ctx: SampleContext, rng: np.random.Generator) -> Draw:
        _need(ctx, 1)
        tsum, tmin = self._trees(ctx)
        total = tsum.root
        bounds = np.arange(batch_size) + rng.random(batch_size)
        bounds *= total / batch_size
        slots = tsum.find_prefix(np.minimum(bounds, np.nextafter(total, 0), out=bounds))
        weights = tsum.get(slots) / tmin.root
        weights **= -self.beta
        return Draw(slots, weights.astype(np.float32))

    def on_write(self, slots: np.ndarray, ctx: SampleContext) -> np.ndarray:
        """New transitions in ``slots`` get ``max_priority``; returns their raw priorities."""
        raw = np.full(len(slots), self.max_priority, dtype=np.float64)
        if self._trees_ is not None:
            self._set(self._trees_, slots, raw)
        return raw

    def update(self, slots: np.ndarray, priorities: np.ndarray, ctx: SampleContext) -> np.ndarray:
        """Set priorities ``|delta| + eps`` for ``slots``; returns the raw priorities stored."""
        raw = np.abs(np.asarray(priorities, dtype=np.float64)) + self.eps
        self._set(self._trees(ctx), slots, raw)
        self.max_priority = max(self.max_priority, float(raw.max(initial=0.0)))
        return raw

    def _set(self, trees: tuple[SegmentTree, SegmentTree], slots: np.ndarray,
             raw: np.ndarray) -> None:
        scaled = raw**self.alpha
        for tree in trees:
            tree.set(slots, scaled)

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": self.name,
            "alpha": self.alpha,
            "beta": self.beta,
            "eps": self.eps,
            "max_priority": self.max_priority,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha, self.beta = float(state["alpha"]), float(state["beta"])
        self.eps, self.max_priority = float(state["eps"]), float(state["max_priority"])
        self._trees_ = None

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrioritizedSampler:
        sampler = cls()
        sampler.load_state_dict(state)
        return sampler
