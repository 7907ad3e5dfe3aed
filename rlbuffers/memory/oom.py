"""Which exceptions mean "out of memory", on CUDA and on CPU."""

from __future__ import annotations

import gc
import sys

#: Substrings of allocator errors raised as plain ``RuntimeError`` (CPU allocator, older CUDA).
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory",
                 "cannot allocate memory")


class SoftLimitExceeded(MemoryError):
    """A micro-batch's predicted or measured peak exceeded the soft budget."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError``, ``MemoryError`` (this includes
    :class:`SoftLimitExceeded`) and allocator ``RuntimeError`` s ("DefaultCPUAllocator:
    can't allocate memory", "CUDA out of memory")."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def free_memory() -> None:
    """Collect garbage and give cached CUDA blocks back, after an out-of-memory error."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
