"""A restricted unpickler that runs no code from the pickle and maps large arrays from it.

Numpy arrays, dtypes and plain containers (``builtins`` types, ``OrderedDict``) are rebuilt
for real; every other class or function the pickle names becomes an inert stand-in
(:class:`~rlbuffers.integrations.sb3.inert_objects.InertObject`) recording its arguments and
state, so no code named by the pickle runs and its libraries need not be installed. Protocol-5
raw byte runs (``BYTEARRAY8``) of at least :data:`MIN_MAP_BYTES` are memory-mapped read-only
(``np.memmap``), not read: loading a 100 GB pickle costs a few MB of RAM. Used by
:mod:`rlbuffers.integrations.sb3.pickle_reader`.

Hostile input: what a pickle may build is checked before it is built, and anything else
raises :class:`~rlbuffers.errors.UnsafePickleError`:

- dtypes: no object dtypes (nor structured dtypes holding one); a dtype's pickled state must
  give the flags and size numpy computes for it (a forged one could read bytes as pointers);
- arrays: only through numpy's own pickle paths (``_reconstruct`` + state, ``_frombuffer``),
  never ``ndarray(...)``: no array without data (uninitialised memory), no strides of the
  pickle's choosing; data length = ``shape x itemsize``; scalars exactly ``itemsize`` bytes;
- sizes: every length an opcode claims is checked against the bytes left in the file (or the
  frame) before allocating; a stream of unknown length (gzip) is read piece by piece;
- amplification: ``bytes(n)``, ``bytearray(n)``, ``set(range(n))`` and the like are charged
  to a memory budget (``memory_budget`` bytes, counting every byte read into memory) and an
  object budget (``max_objects``) before they run;
- nesting: at most ``max_depth`` open ``MARK`` s, tuples (frozensets) nested at most
  ``max_depth`` deep (hashing deeper recurses in C); lists and dicts built through the memo
  may nest deeper: walk the result recursively only with a guard (``repr`` and ``==`` have).
"""

from __future__ import annotations

import _compat_pickle
import builtins
import io
import os
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from rlbuffers.errors import UnsafePickleError
from rlbuffers.integrations.sb3 import inert_objects as inert
from rlbuffers.integrations.sb3.pickle_dtypes import (
    _KINDS,
    _check_dtype_state,
    _count,
    _dtypes_in,
    _kinds,
    _shape,
    check_dtype,
)

#: Arrays at least this large (bytes) are memory-mapped from the pickle instead of read.
MIN_MAP_BYTES = 2**20
#: Default memory budget of one load (bytes read into memory + what constructors allocate).
MEMORY_BUDGET = 16 * 2**30
#: Default most objects one load may create (opcodes plus elements built by constructors).
MAX_OBJECTS = 2**26
#: Default most nested ``MARK`` s (open tuples, lists, dicts being built).
MAX_DEPTH = 1000
#: Pieces in which a stream of unknown length is read (bytes).
_READ_PIECE = 2**24


@dataclass(frozen=True)
class _Extent:
    """A run of raw bytes left in the pickle file (offset and length in bytes)."""

    offset: int
    nbytes: int


class MappingUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be overridden
    """``MappingUnpickler(file, path).load()``: the pickle's object, with numpy arrays, dtypes
    and plain containers rebuilt, every other class an ``InertObject``, and protocol-5
    raw byte runs of at least :data:`MIN_MAP_BYTES` memory-mapped from ``path`` (None: read
    into memory); :attr:`mapped_bytes` counts the mapped bytes.

    Args:
        memory_budget: bytes the load may hold in memory (bytes read, not mapped, plus what
            constructors such as ``bytearray(n)`` allocate).
        max_objects: objects the load may create (one per opcode, one per element a
            constructor such as ``set(range(n))`` builds).
        max_depth: nested ``MARK`` s, and nested tuples or frozensets.

    Raises (from :meth:`load`):
        UnsafePickleError: see the module docstring. Others (``UnpicklingError``,
        ``EOFError``, ``KeyError`` ...): a corrupt or truncated pickle.
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    # Set by the pure-Python unpickler's __init__ / load; declared here for type checkers.
    read: Callable[[int], bytes]
    readinto: Callable[[bytearray], int]
    append: Callable[[Any], None]
    stack: list[Any]
    metastack: list[Any]
    _unframer: Any
    _file_read: Callable[[int], bytes]
    _file_readline: Callable[[], bytes]
    proto: int
    fix_imports: bool

    def __init__(self, file: IO[bytes], path: Path | None, *,
                 memory_budget: int = MEMORY_BUDGET, max_objects: int = MAX_OBJECTS,
                 max_depth: int = MAX_DEPTH) -> None:
        super().__init__(file)
        self._src, self._path = file, path
        self._size = self._known_size(file, path)
        self.memory_budget, self.max_objects, self.max_depth = (memory_budget, max_objects,
                                                                max_depth)
        self.used_bytes = 0
        self.objects = 0
        self._raw_read, self._raw_readline = file.read, file.readline
        self._file_read, self._file_readline = self._bounded_read, self._bounded_readline
        multiarray, numeric = inert.numpy_multiarray()
        self._np_scalar, self._np_reconstruct = multiarray.scalar, multiarray._reconstruct
        self._np_frombuffer = numeric._frombuffer  # type: ignore[attr-defined]
        self._allowed: dict[tuple[str, str], Any] = {
            ("numpy", "dtype"): self._dtype, ("numpy", "ndarray"): inert.NDARRAY,
            **self._plain()}
        for pkg in ("numpy.core", "numpy._core"):
            self._allowed[(f"{pkg}.multiarray", "_reconstruct")] = self._reconstruct
            self._allowed[(f"{pkg}.multiarray", "scalar")] = self._scalar
            self._allowed[(f"{pkg}.numeric", "_frombuffer")] = self._frombuffer
        self._stubs: dict[tuple[str, str], type] = {}
        self._dtypes_used: set[int] = set()
        self._dtypes_built: set[int] = set()
        self._keep: list[Any] = []
        self._depths: dict[int, tuple[Any, int]] = {}
        self.mapped_bytes = 0

    @staticmethod
    def _known_size(file: IO[bytes], path: Path | None) -> int | None:
        if path is not None:
            return os.path.getsize(path)
        if isinstance(file, io.BytesIO):
            return len(file.getbuffer())
        return None

    # -- budgets --------------------------------------------------------------------------
    def charge(self, nbytes: int = 0, objects: int = 0, what: str = "the pickle") -> None:
        """Count ``nbytes`` and ``objects`` against the budgets, before they are allocated.

        Raises:
            UnsafePickleError: a budget would be exceeded.
        """
        self.used_bytes += nbytes
        self.objects += objects
        if self.used_bytes > self.memory_budget:
            raise UnsafePickleError(f"{what}: needs more than the memory budget of "
                                    f"{self.memory_budget:,} bytes ({self.used_bytes:,} "
                                    "asked so far)")
        if self.objects > self.max_objects:
            raise UnsafePickleError(f"{what}: creates more than {self.max_objects:,} objects")

    def _remaining(self) -> int | None:
        """Bytes left in the file after its position (None: unknown, e.g. gzip)."""
        if self._size is None:
            return None
        return self._size - self._src.tell()

    def _bounded_read(self, n: int) -> bytes:
        """``file.read(n)`` with ``n`` checked against the bytes left (read piecewise when
        that is unknown) and charged to the memory budget."""
        left = self._remaining()
        if left is not None and n > left:
            raise UnsafePickleError(f"an opcode claims {n:,} bytes at byte {self._src.tell():,}"
                                    f", only {left:,} are left in the file (corrupt or forged)")
        self.charge(n, 0, "reading the pickle")
        if left is not None or n <= _READ_PIECE:
            return self._raw_read(n)
        parts, got = [], 0
        while got < n:
            part = self._raw_read(min(_READ_PIECE, n - got))
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def _bounded_readline(self) -> bytes:
        line = self._raw_readline(max(self.memory_budget - self.used_bytes, 0) + 1)
        self.charge(len(line), 0, "reading the pickle")
        return line

    # -- what the pickle may call ----------------------------------------------------------
    def _plain(self) -> dict[tuple[str, str], Any]:
        """Plain classes rebuilt for real; those that can allocate in proportion to an
        argument (``bytes(n)``, ``set(range(n))``) are charged first."""
        table: dict[tuple[str, str], Any] = {
            ("builtins", n): getattr(builtins, n)
            for n in ("slice", "complex", "object", "int", "float", "bool", "str", "range")}
        for name in ("set", "frozenset", "tuple", "list", "dict", "bytes", "bytearray"):
            table[("builtins", name)] = self._sized(getattr(builtins, name), f"builtins.{name}")
        table[("collections", "OrderedDict")] = self._sized(OrderedDict,
                                                            "collections.OrderedDict")
        table[("_codecs", "encode")] = inert.latin1_encode  # bytes in protocol-2 pickles
        table[("copyreg", "_reconstructor")] = inert.stub_reconstructor  # objects in protocol-0/1
        return table

    def _sized(self, cls: type, name: str) -> Callable[..., Any]:
        def build(*args: Any) -> Any:
            if len(args) > 3:
                raise UnsafePickleError(f"{name}: expected at most 3 arguments, got {len(args)}")
            if args:
                a = args[0]
                if isinstance(a, (int, range)):  # bytearray(2**31), set(range(10**10)): no
                    raise UnsafePickleError(  # pickler writes these, they only allocate
                        f"{name}({a!r:.40}) is refused: a pickle passes the elements")
                if isinstance(a, (str, bytes, bytearray, tuple, list, set, frozenset, dict)):
                    n = len(a)
                    self.charge(8 * n, n, f"{name} of {n:,} elements")
                elif not isinstance(a, inert.InertObject):  # arrays, scalars: not what pickles do
                    raise UnsafePickleError(f"{name}: expected a plain container argument, "
                                            f"got {type(a).__name__}")
            return cls(*args)

        build.__name__ = build.__qualname__ = name
        return build

    def _dtype(self, *args: Any) -> np.dtype:
        if not args or not isinstance(args[0], str) or len(args[0]) > 64:
            raise UnsafePickleError(f"numpy.dtype: expected a type string, got {args!r:.80}")
        return check_dtype(np.dtype(*args), f"numpy.dtype{args!r:.60}")

    def _scalar(self, dtype: Any, obj: Any = None) -> Any:
        d = check_dtype(dtype, "numpy scalar dtype")
        if not isinstance(obj, bytes) or len(obj) != d.itemsize:
            got = f"{len(obj)} bytes" if isinstance(obj, bytes) else type(obj).__name__
            raise UnsafePickleError(f"numpy scalar of {d}: expected {d.itemsize} bytes, "
                                    f"got {got}")
        return self._np_scalar(d, obj)

    def _reconstruct(self, cls: Any, shape: Any, typecode: Any) -> np.ndarray:
        # numpy pickles ndarray(...) as _reconstruct(ndarray, (0,), b'b') + its state.
        if cls is not inert.NDARRAY or _count(_shape(shape, "_reconstruct shape")) > 1024:
            raise UnsafePickleError(f"numpy _reconstruct: expected (numpy.ndarray, (0,), b'b')"
                                    f", got ({cls!r:.40}, {shape!r:.40}, {typecode!r:.20})")
        check_dtype(np.dtype(typecode), "_reconstruct typecode")
        return self._np_reconstruct(np.ndarray, shape, typecode)

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: str = "C") -> np.ndarray:
        d = check_dtype(dtype, "numpy array dtype")
        shape = _shape(shape, "numpy array shape")
        if order not in ("C", "F"):
            raise UnsafePickleError(f"numpy array order: expected 'C' or 'F', got {order!r:.20}")
        nbytes = _count(shape) * d.itemsize
        have = buf.nbytes if isinstance(buf, _Extent) else len(buf) if isinstance(
            buf, (bytes, bytearray)) else None
        if have != nbytes:
            raise UnsafePickleError(f"numpy array {shape} {d}: expected {nbytes:,} bytes of "
                                    f"data, got {have if have is not None else type(buf)}")
        if isinstance(buf, _Extent):
            self.mapped_bytes += buf.nbytes
            return np.memmap(self._path, dtype=d, mode="r",  # type: ignore[call-overload]
                             offset=buf.offset, shape=shape, order=order)
        return self._np_frombuffer(buf, d, shape, order)

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
            if len(self._stubs) >= 10_000 or not module.isprintable() or len(module) > 500 \
                    or not name.isprintable() or len(name) > 500:
                raise UnsafePickleError(f"global {module[:80]!r}.{name[:80]!r}: refused (too "
                                        "many, too long or unprintable names)")
            self._stubs[key] = type(name, (inert.InertObject,), {"__module__": module,
                                                      "_origin": f"{module}.{name}"})
        return self._stubs[key]

    # -- opcodes ---------------------------------------------------------------------------
    def load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        frame = self._unframer.current_frame
        if frame is not None:
            left = len(frame.getbuffer()) - frame.tell()
            if n > left and left:  # a payload inside a frame must fit in the frame
                raise UnsafePickleError(f"BYTEARRAY8 claims {n:,} bytes, only {left:,} are "
                                        "left in its frame (corrupt or forged)")
            if not left:
                self._unframer.current_frame = frame = None
        # Large payloads are written outside pickle frames, so once the header came straight
        # from the file (no current frame), the payload starts at the file position.
        if self._path is None or n < MIN_MAP_BYTES or frame is not None:
            self.append(bytearray(self.read(n)))  # read() checks n against the bytes left
            return
        left_in_file = self._remaining()
        if left_in_file is not None and n > left_in_file:
            raise UnsafePickleError(f"BYTEARRAY8 claims {n:,} bytes, only {left_in_file:,} "
                                    "are left in the file (corrupt or forged)")
        offset = self._src.tell()
        self._src.seek(n, os.SEEK_CUR)
        self.append(_Extent(offset, n))

    def load_reduce(self) -> None:
        self.charge(0, 1)
        super().load_reduce()  # type: ignore[misc]
        self._nested()  # tuple(...) and frozenset(...) calls

    def _instantiate(self, klass: Any, args: Any) -> None:
        if not (isinstance(klass, type) and issubclass(klass, inert.InertObject)):
            raise UnsafePickleError(f"INST/OBJ of {klass!r:.60}: only for classes the pickle "
                                    "names (kept inert)")
        super()._instantiate(klass, args)  # type: ignore[misc]

    def load_newobj(self) -> None:
        self._check_new(self.stack[-2])
        super().load_newobj()  # type: ignore[misc]

    def load_newobj_ex(self) -> None:
        self._check_new(self.stack[-3])
        super().load_newobj_ex()  # type: ignore[misc]

    @staticmethod
    def _check_new(cls: Any) -> None:
        if not (cls is object or isinstance(cls, type) and issubclass(cls, inert.InertObject)):
            raise UnsafePickleError(f"NEWOBJ of {cls!r:.60}: only for classes the pickle "
                                    "names (kept inert)")

    def load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, np.dtype):
            # A dtype state names other dtypes (fields, subarray base): each must be complete
            # (never rebuilt later) and none may lead back here, or numpy recurses for ever.
            if _kinds(inst) - set(_KINDS):
                raise UnsafePickleError(f"numpy dtype state on {inst!r:.40}: refused")
            _check_dtype_state(self.stack[-1])
            inner = _dtypes_in(self.stack[-1])
            if id(inst) in self._dtypes_used or id(inst) in self._dtypes_built or any(
                    d is inst for d in inner):
                raise UnsafePickleError(f"numpy dtype state: {inst!r:.40} is rebuilt after use "
                                        "or refers to itself (a dtype cycle)")
            self._dtypes_used.update(id(d) for d in inner)
            self._keep.extend(inner)  # ids stay unique while they are kept
            super().load_build()  # type: ignore[misc]
            self._dtypes_built.add(id(inst))
            self._keep.append(inst)
            check_dtype(inst, "numpy dtype state")
        elif isinstance(inst, np.ndarray):
            self._check_array_state(self.stack[-1])
            super().load_build()  # type: ignore[misc]
        elif isinstance(inst, (np.generic, range, slice)):
            raise UnsafePickleError(f"BUILD on a {type(inst).__name__} is refused")
        else:
            super().load_build()  # type: ignore[misc]

    def _check_array_state(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) in (4, 5)
                and (len(state) == 4 or type(state[0]) is int and state[0] == 1)
                and type(state[-2]) is bool):
            raise UnsafePickleError(f"numpy array state: expected (1, shape, dtype, fortran, "
                                    f"data), got {state!r:.120}")
        shape = _shape(state[-4], "numpy array shape")
        d = check_dtype(state[-3], "numpy array dtype")
        data = state[-1]
        nbytes = _count(shape) * d.itemsize
        if not isinstance(data, (bytes, bytearray)) or len(data) != nbytes:
            got = f"{len(data):,} bytes" if isinstance(data, (bytes, bytearray)) else \
                type(data).__name__
            raise UnsafePickleError(f"numpy array {shape} {d}: expected {nbytes:,} bytes of "
                                    f"data, got {got}")
        self.charge(nbytes, 1, f"numpy array {shape} {d}")

    def _nested(self) -> None:
        """Record the nesting depth of the tuple or frozenset just pushed; refuse it beyond
        ``max_depth`` (hashing a deeply nested tuple, as a dict key does, recurses in C
        without a limit: a 1 MB pickle of 10**6 nested tuples crashes the standard
        unpickler)."""
        obj = self.stack[-1]
        if not isinstance(obj, (tuple, frozenset)) or not obj:
            return
        depths = self._depths  # depth >= 2 only; leaves count 1
        depth = 1 + max((depths[id(x)][1] if id(x) in depths else 1 for x in obj
                         if isinstance(x, (tuple, frozenset)) and x), default=0)
        if depth > self.max_depth:
            raise UnsafePickleError(f"the pickle nests tuples more than {self.max_depth} deep")
        if depth > 1:
            depths[id(obj)] = (obj, depth)  # the object is kept, so its id stays its own

    def load_tuple(self) -> None:
        super().load_tuple()  # type: ignore[misc]
        self._nested()

    def load_tuple1(self) -> None:
        super().load_tuple1()  # type: ignore[misc]
        self._nested()

    def load_tuple2(self) -> None:
        super().load_tuple2()  # type: ignore[misc]
        self._nested()

    def load_tuple3(self) -> None:
        super().load_tuple3()  # type: ignore[misc]
        self._nested()

    def load_frozenset(self) -> None:
        super().load_frozenset()  # type: ignore[misc]
        self._nested()

    def load_mark(self) -> None:
        if len(self.metastack) >= self.max_depth:
            raise UnsafePickleError(f"the pickle nests more than {self.max_depth} levels")
        super().load_mark()  # type: ignore[misc]

    def load_frame(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        left = self._remaining()
        if left is not None and n > left:
            raise UnsafePickleError(f"FRAME claims {n:,} bytes, only {left:,} are left in the "
                                    "file (corrupt or forged)")
        self._unframer.load_frame(n)

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8  # type: ignore[assignment]
    dispatch[pickle.REDUCE[0]] = load_reduce  # type: ignore[assignment]
    dispatch[pickle.NEWOBJ[0]] = load_newobj  # type: ignore[assignment]
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex  # type: ignore[assignment]
    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]
    dispatch[pickle.MARK[0]] = load_mark  # type: ignore[assignment]
    dispatch[pickle.TUPLE[0]] = load_tuple  # type: ignore[assignment]
    dispatch[pickle.TUPLE1[0]] = load_tuple1  # type: ignore[assignment]
    dispatch[pickle.TUPLE2[0]] = load_tuple2  # type: ignore[assignment]
    dispatch[pickle.TUPLE3[0]] = load_tuple3  # type: ignore[assignment]
    dispatch[pickle.FROZENSET[0]] = load_frozenset  # type: ignore[assignment]
    dispatch[pickle.FRAME[0]] = load_frame  # type: ignore[assignment]


def _counted(op: Callable[[Any], None]) -> Callable[[Any], None]:
    def counted(self: MappingUnpickler) -> None:
        self.objects += 1
        if self.objects > self.max_objects:
            raise UnsafePickleError(f"the pickle creates more than {self.max_objects:,} objects")
        op(self)

    return counted


MappingUnpickler.dispatch = {k: _counted(v) for k, v in MappingUnpickler.dispatch.items()}
