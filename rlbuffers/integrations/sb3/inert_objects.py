"""What the restricted unpickler (:mod:`~rlbuffers.integrations.sb3.inert_pickle`) builds in
place of running code a pickle names: :class:`InertObject` stand-ins that only record their
arguments and state, and the few callables it lets a pickle name (``copyreg.stub_reconstructor``
for stand-ins, ``numpy.ndarray`` as an argument only, ``_codecs.encode`` to latin-1 only)."""

from __future__ import annotations

import codecs
import pickle
from typing import Any

from rlbuffers.errors import UnsafePickleError


class InertObject:
    """Inert stand-in for a class or function named by the pickle: keeps its arguments and
    whatever state the pickle sets. A dict state becomes attributes; a ``(dict, slots)`` pair
    (the default reduce form) likewise, its second part kept as ``_state``; any other state,
    such as the tuple a legacy numpy ``RandomState`` or a gymnasium space may restore from, is
    kept as ``_state``. Items and elements the pickle adds (the ``SETITEMS`` / ``APPENDS`` of
    dict and list subclasses) are kept in ``_items`` / ``_list``. Nothing here can fail on
    what a pickle passes, and nothing runs."""

    _origin = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args
        if kwargs:
            self._kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict) and plain_names(state):
            self.__dict__.update(state)
        elif (isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict)
              and plain_names(state[0])):
            self.__dict__.update(state[0])
            self._state = state[1]
        else:
            self._state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("_items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("_list", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("_list", []).extend(values)

    def add(self, value: Any) -> None:  # the ADDITEMS of set subclasses
        self.append(value)

    def __repr__(self) -> str:
        return f"<inert {self._origin}>"


def plain_names(state: dict[Any, Any]) -> bool:
    """Attribute names only, none a dunder (an instance ``__setstate__`` or ``append`` would
    be called by the next opcode), none of the names the stand-in itself uses."""
    return all(isinstance(k, str) and not (k.startswith("__") and k.endswith("__"))
               and k not in OWN_NAMES for k in state)


OWN_NAMES = frozenset({"append", "extend", "add", "_origin", "_items", "_list"})


def stub_reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    """``copyreg.stub_reconstructor`` (protocol 0/1 pickles of plain classes), for stubs only."""
    if isinstance(cls, type) and issubclass(cls, InertObject):
        return cls.__new__(cls)
    raise pickle.UnpicklingError(f"copyreg.stub_reconstructor of {cls!r} is not supported")



def numpy_multiarray() -> tuple[Any, Any]:
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 2
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    return multiarray, numeric


class NdarrayName:
    """What ``numpy.ndarray`` names in a pickle: only an argument of ``_reconstruct``.
    Calling it (``ndarray(shape, dtype, buffer, offset, strides)``) would give arrays without
    data (uninitialised memory) or with strides of the pickle's choosing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsafePickleError("numpy.ndarray(...) called directly is refused (arrays come "
                                "only from numpy's own pickle paths)")

    def __repr__(self) -> str:
        return "numpy.ndarray"


NDARRAY = NdarrayName()


def latin1_encode(text: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes: text to latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "latin_1"):
        raise UnsafePickleError(f"_codecs.encode: expected (str, 'latin1'), got "
                                f"({type(text).__name__}, {encoding!r:.20})")
    return codecs.encode(text, encoding, errors if errors == "strict" else "strict")
