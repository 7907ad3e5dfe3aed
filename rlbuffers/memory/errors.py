"""Errors of the memory toolkit (part of the :mod:`rlbuffers.errors` tree)."""

from __future__ import annotations

from rlbuffers.errors import RLBuffersError


class MemoryBudgetError(RLBuffersError, MemoryError):
    """Not even the smallest unit of work fits the memory budget (micro-batch 1 ran out of
    memory, or a plan cannot fit one item)."""
