"""A restricted unpickler that runs no code from the pickle and maps large arrays from it.

Numpy arrays, dtypes and plain containers (``builtins`` types, ``OrderedDict``) are rebuilt
for real; every other class or function the pickle names becomes an inert stand-in
(:class:`InertObject`) that only records its arguments and state, so no code named by the
pickle runs and the libraries that wrote it need not be installed. With protocol 5, each large
array is one run of raw bytes in the file (``BYTEARRAY8`` outside pickle frames): those of at
least :data:`MIN_MAP_BYTES` are not read but memory-mapped read-only (``np.memmap``), so
loading a 100 GB pickle costs a few MB of RAM. Used by :mod:`rlbuffers.convert`.
"""

from __future__ import annotations

import _compat_pickle
import builtins
import codecs
import os
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

#: Arrays at least this large (bytes) are memory-mapped from the pickle instead of read.
MIN_MAP_BYTES = 2**20


@dataclass(frozen=True)
class _Extent:
    """A run of raw bytes left in the pickle file (offset and length in bytes)."""

    offset: int
    nbytes: int


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
        if isinstance(state, dict) and all(isinstance(k, str) for k in state):
            self.__dict__.update(state)
        elif (isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict)
              and all(isinstance(k, str) for k in state[0])):
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


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    """``copyreg._reconstructor`` (protocol 0/1 pickles of plain classes), for stubs only."""
    if isinstance(cls, type) and issubclass(cls, InertObject):
        return cls.__new__(cls)
    raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r} is not supported")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 2
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]

    table: dict[tuple[str, str], Any] = {("numpy", "dtype"): np.dtype,
                                         ("numpy", "ndarray"): np.ndarray}
    for pkg in ("numpy.core", "numpy._core"):
        table[(f"{pkg}.multiarray", "_reconstruct")] = multiarray._reconstruct
        table[(f"{pkg}.multiarray", "scalar")] = multiarray.scalar
        table[(f"{pkg}.numeric", "_frombuffer")] = numeric._frombuffer  # type: ignore[attr-defined]
    return table


#: Plain classes rebuilt for real (everything else but numpy's becomes a :class:`InertObject`).
_PLAIN: dict[tuple[str, str], Any] = {
    ("builtins", n): getattr(builtins, n)
    for n in ("set", "frozenset", "slice", "complex", "bytearray", "object", "tuple", "list",
              "dict", "int", "float", "bool", "str", "bytes", "range")
}
_PLAIN[("collections", "OrderedDict")] = OrderedDict
_PLAIN[("_codecs", "encode")] = codecs.encode  # bytes in protocol-2 pickles
_PLAIN[("copyreg", "_reconstructor")] = _reconstructor  # objects in protocol-0/1 pickles


class MappingUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be overridden
    """``MappingUnpickler(file, path).load()``: the pickle's object, with numpy arrays, dtypes
    and plain containers rebuilt, every other class an :class:`InertObject`, and protocol-5
    raw byte runs of at least :data:`MIN_MAP_BYTES` memory-mapped from ``path`` (None: read
    into memory); :attr:`mapped_bytes` counts the mapped bytes."""

    dispatch = dict(pickle._Unpickler.dispatch)
    # Set by the pure-Python unpickler's __init__ / load; declared here for type checkers.
    read: Callable[[int], bytes]
    readinto: Callable[[bytearray], int]
    append: Callable[[Any], None]
    _unframer: Any
    proto: int
    fix_imports: bool

    def __init__(self, file: IO[bytes], path: Path | None) -> None:
        super().__init__(file)
        self._src, self._path = file, path
        self._allowed = {**_numpy_globals(), **_PLAIN}
        self._stubs: dict[tuple[str, str], type] = {}
        frombuffer = self._allowed[("numpy._core.numeric", "_frombuffer")]
        for key in [k for k in self._allowed if k[1] == "_frombuffer"]:
            self._allowed[key] = self._mapped_frombuffer(frombuffer)
        self.mapped_bytes = 0

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as pickle.Unpickler maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        key = (module, name)
        if key not in self._stubs:
            self._stubs[key] = type(name, (InertObject,), {"__module__": module,
                                                      "_origin": f"{module}.{name}"})
        return self._stubs[key]

    def _mapped_frombuffer(self, frombuffer: Callable[..., Any]) -> Callable[..., Any]:
        def build(buf: Any, dtype: Any, shape: Any, order: str = "C") -> np.ndarray:
            if isinstance(buf, _Extent):
                self.mapped_bytes += buf.nbytes
                return np.memmap(self._path, dtype=dtype, mode="r",  # type: ignore[call-overload]
                                 offset=buf.offset, shape=tuple(shape), order=order)
            return frombuffer(buf, dtype, shape, order)

        return build

    def load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        # Large payloads are written outside pickle frames, so once the header came straight
        # from the file (no current frame), the payload starts at the file position.
        if self._path is None or n < MIN_MAP_BYTES or self._unframer.current_frame is not None:
            b = bytearray(n)
            self.readinto(b)
            self.append(b)
            return
        offset = self._src.tell()
        self._src.seek(n, os.SEEK_CUR)
        self.append(_Extent(offset, n))

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8  # type: ignore[assignment]
