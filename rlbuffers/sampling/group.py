"""``GroupSampler``: whole groups of transitions (the G completions of one prompt), uniform or
recency-weighted. Registered with the other built-in samplers of
:mod:`rlbuffers.sampling.samplers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from rlbuffers.errors import BufferEmptyError
from rlbuffers.sampling.base import Draw, SampleContext, register_sampler
from rlbuffers.spec import FieldSpec


@register_sampler
@dataclass
class GroupSampler:
    """Whole groups of ``group_size`` transitions: the G completions of one prompt in GRPO
    (Shao et al. 2024, "DeepSeekMath", Sec. 4.1), whose advantages are relative to each other,
    so a batch must never split one.

    A group is stored as one episode (its last transition sets the ``done``/``terminated``
    flag), and a *group* is a run of exactly ``group_size`` stored transitions sharing an
    episode id; a group partly overwritten by the ring is shorter and never drawn.
    ``sample(B)`` returns slots ``[B, group_size]`` (oldest member first).

    Args:
        group_size: transitions per group (>= 1).
        newest: draw only among the newest ``newest`` groups (None: all stored groups).
        half_life: recency weighting: a group ``a`` groups older than the newest is drawn
            with probability proportional to ``0.5 ** (a / half_life)`` (None: uniform).
        replace: draw with replacement; without (default), a batch holds distinct groups
            and asks for at most as many as there are.

    Cost: one read of the episode-id column (``8 * size`` bytes) per ``sample``.

    Raises:
        ValueError: ``group_size`` or ``newest`` < 1, ``half_life`` <= 0.
    """

    group_size: int
    newest: int | None = None
    half_life: float | None = None
    replace: bool = False
    name: ClassVar[str] = "group"
    extra_columns: ClassVar[dict[str, FieldSpec]] = {}

    def __post_init__(self) -> None:
        if int(self.group_size) < 1:
            raise ValueError(f"GroupSampler.group_size: expected >= 1, got {self.group_size}")
        if self.newest is not None and int(self.newest) < 1:
            raise ValueError(f"GroupSampler.newest: expected >= 1 or None, got {self.newest}")
        if self.half_life is not None and not float(self.half_life) > 0:
            raise ValueError(f"GroupSampler.half_life: expected > 0 or None, "
                             f"got {self.half_life}")
        self.group_size = int(self.group_size)

    def group_starts(self, ctx: SampleContext) -> np.ndarray:
        """Logical indices (int64[k], ascending) of the first member of every whole group
        stored (the newest ``newest`` of them when set)."""
        if ctx.size == 0:
            return np.zeros(0, np.int64)
        ids = ctx.episode_ids(ctx.slots(np.arange(ctx.size)))
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        lengths = np.diff(np.r_[starts, ctx.size])
        whole = starts[lengths == self.group_size]
        return whole[-self.newest:] if self.newest is not None else whole

    def sample(self, batch_size: int, ctx: SampleContext, rng: np.random.Generator) -> Draw:
        starts = self.group_starts(ctx)
        k = len(starts)
        if k == 0 or (not self.replace and k < batch_size):
            raise BufferEmptyError(f"cannot sample {batch_size} groups of {self.group_size}: "
                                   f"the buffer holds {k} whole groups"
                                   + ("" if self.newest is None else
                                      f" among the newest {self.newest}"))
        p = None
        if self.half_life is not None:
            age = np.arange(k - 1, -1, -1, dtype=np.float64)
            w = 0.5 ** (age / float(self.half_life))
            p = w / w.sum()
        chosen = rng.choice(k, size=batch_size, replace=self.replace, p=p)
        logical = starts[chosen][:, None] + np.arange(self.group_size)
        return Draw(ctx.slots(logical), np.ones(batch_size, dtype=np.float32))

    def on_write(self, slots: np.ndarray, ctx: SampleContext) -> np.ndarray | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.name, "group_size": self.group_size, "newest": self.newest,
                "half_life": self.half_life, "replace": self.replace}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_size = int(state["group_size"])
        self.newest, self.half_life = state["newest"], state["half_life"]
        self.replace = bool(state["replace"])

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> GroupSampler:
        return cls(int(state["group_size"]), state["newest"], state["half_life"],
                   bool(state["replace"]))
