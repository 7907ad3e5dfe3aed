"""Integer arithmetic used across the library (one home, so nobody writes ``-(-a // b)``)."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers ``a >= 0``, ``b > 0``, without floats."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (> 0) that is >= ``a``."""
    return ceil_div(a, multiple) * multiple
