"""Deprecated names kept for one release after a rename: keywords and attributes that still
work and emit a :class:`DeprecationWarning` naming the new name."""

from __future__ import annotations

import warnings
from typing import Any

#: Marks a deprecated keyword that was not given.
UNSET: Any = object()


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (the warning points at the caller
    of the function that calls this, with the default ``stacklevel``)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def renamed_keyword(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of keyword ``new``, or of its deprecated spelling ``old`` if that was given
    (``old_value`` is not :data:`UNSET`; a :class:`DeprecationWarning` names ``new``).

    Raises:
        TypeError: both were given (``new_value`` differs from None, its "not given" value).
    """
    if old_value is UNSET:
        return new_value
    warn_renamed(f"keyword {old}=", f"{new}=", stacklevel=4)
    if new_value is not None:
        raise TypeError(f"{new}: given twice, as {new}={new_value!r} and as the deprecated "
                        f"{old}={old_value!r}; give {new} only")
    return old_value


def renamed_attribute(old: str, new: str) -> property:
    """A read-only property ``old`` that returns attribute ``new`` with a
    :class:`DeprecationWarning`."""

    def get(self: Any) -> Any:
        warn_renamed(f"{type(self).__name__}.{old}", f"{type(self).__name__}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated: use ``{new}``.")
