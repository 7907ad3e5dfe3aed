"""Malicious and careless inputs of issue 32, built from their descriptions: pickles for the
SB3 converter, tar shards for the stream reader. Shared by the regression tests and the fuzzers
(``tools/fuzz``), which start from them."""

from __future__ import annotations

import io
import pickle
import struct
import tarfile

import numpy as np

try:
    from numpy._core import multiarray
except ImportError:  # numpy < 2
    from numpy.core import multiarray  # type: ignore[no-redef]


class _Reduce:
    """Pickles as ``func(*args)`` (+ ``state`` via BUILD when given)."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args,
                                                                   self.state)


class FakeSB3Buffer:
    """Pickles as an object of a class the converter does not know, with ``state`` as its
    attribute dict: what SB3's ReplayBuffer looks like to the restricted unpickler."""

    def __init__(self, state):
        self.__dict__.update(state)


FakeSB3Buffer.__module__ = _MOD = "hostile_sb3_buffers"
FakeSB3Buffer.__qualname__ = FakeSB3Buffer.__name__ = "ReplayBuffer"


def _dumps(obj, protocol=5) -> bytes:
    import sys
    import types

    mod = sys.modules.setdefault("hostile_sb3_buffers",
                                 types.ModuleType("hostile_sb3_buffers"))
    had = getattr(mod, "ReplayBuffer", None)
    mod.ReplayBuffer = FakeSB3Buffer
    try:
        return pickle.dumps(obj, protocol=protocol)
    finally:
        if had is None:
            del mod.ReplayBuffer
        else:
            mod.ReplayBuffer = had


def sb3_state(n=8, n_envs=1, **over):
    """A valid SB3 ReplayBuffer state (``n`` rows), with ``over`` replacing attributes."""
    s = {
        "buffer_size": n, "n_envs": n_envs, "pos": 0, "full": True,
        "optimize_memory_usage": False, "handle_timeout_termination": True,
        "observations": np.arange(n * n_envs * 2, dtype=np.float32).reshape(n, n_envs, 2),
        "next_observations": np.ones((n, n_envs, 2), np.float32),
        "actions": np.zeros((n, n_envs, 1), np.int64),
        "rewards": np.arange(n * n_envs, dtype=np.float32).reshape(n, n_envs),
        "dones": np.zeros((n, n_envs), np.float32),
        "timeouts": np.zeros((n, n_envs), np.float32),
    }
    s.update(over)
    return s


def valid_sb3_pickle(n=8, protocol=5) -> bytes:
    return _dumps(FakeSB3Buffer(sb3_state(n)), protocol)


def s1_object_dtype_scalar() -> bytes:
    """S1: ``dtype('O')`` with its state's flags set to 0, then ``scalar(dtype, 8 bytes)``:
    numpy would read the 8 bytes as a PyObject pointer."""
    forged = _Reduce(np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, 0))
    return _dumps(_Reduce(multiarray.scalar, (forged, b"\x41" * 8)), 2)


def s3_bytearray8_claim(n=2**31) -> bytes:
    """S3: a BYTEARRAY8 opcode claiming ``n`` bytes with none following."""
    return b"\x80\x05\x96" + struct.pack("<Q", n) + b"."


def s3_bytearray_call(n=2**31) -> bytes:
    """S3: ``builtins.bytearray(n)`` in an attribute the converter never reads."""
    return _dumps(FakeSB3Buffer(sb3_state(unused=_Reduce(bytearray, (n,)))))


def s3_set_of_range(n=10**10) -> bytes:
    """S3: ``set(range(n))``."""
    return _dumps(FakeSB3Buffer(sb3_state(unused=_Reduce(set, (range(n),)))))


def s4_zero_stride(n=200_000) -> bytes:
    """S4: ``np.ndarray((n, 1, 2), float32, buffer=8 bytes, strides=(0, 0, 0))`` as the
    observations: one element repeated ``n`` times."""
    obs = _Reduce(np.ndarray, ((n, 1, 2), np.dtype("float32"), b"\0" * 8, 0, (0, 0, 0)))
    z = _Reduce(np.ndarray, ((n, 1), np.dtype("float32"), b"\0" * 4, 0, (0, 0)))
    act = _Reduce(np.ndarray, ((n, 1, 1), np.dtype("int64"), b"\0" * 8, 0, (0, 0, 0)))
    return _dumps(FakeSB3Buffer(sb3_state(n, observations=obs, next_observations=obs,
                                          actions=act, rewards=z, dones=z, timeouts=z)))


def s5_no_buffer(n=64) -> bytes:
    """S5: ``np.ndarray(shape)`` with no buffer: uninitialised memory as observations."""
    obs = _Reduce(np.ndarray, ((n, 1, 2), np.dtype("float32")))
    return _dumps(FakeSB3Buffer(sb3_state(n, observations=obs)))


def u4_self_reference() -> bytes:
    """U4: a buffer whose observations dict holds itself and whose rewards list holds itself."""
    state = sb3_state()
    obs = {}
    obs["pixels"] = obs
    rewards: list = []
    rewards.append(rewards)
    state.update(observations=obs, next_observations=obs, rewards=rewards,
                 timeouts=None)
    buf = FakeSB3Buffer(state)
    buf.self = buf
    return _dumps(buf)


def u4_dtype_cycle() -> bytes:
    """U4: ``dtype('V8')`` whose pickled state makes its one field the dtype itself."""
    return (b"\x80\x02cnumpy\ndtype\nq\x00X\x02\x00\x00\x00V8q\x01\x89\x88\x87q\x02Rq\x03"
            b"(K\x03X\x01\x00\x00\x00|NX\x01\x00\x00\x00a\x85}X\x01\x00\x00\x00ah\x03K\x00"
            b"\x86sK\x08K\x01K\x00tb.")


def u4_deep_tuple(depth=1_000_000) -> bytes:
    """U4: a dict keyed by a tuple nested ``depth`` deep (1 MB): hashing it recurses in C."""
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"Ns."


def fuzz_dtype_states() -> dict[str, bytes]:
    """Dtype states the pickle fuzzer found crashing numpy's ``dtype.__setstate__``: a
    timedelta dtype without its unit, and states of the wrong length."""
    return {
        "fuzz-m8-state": _dumps(_Reduce(np.dtype, ("m8", False, True),
                                        (3, "<", None, None, None, -1, -1, 0)), 2),
        "fuzz-short-state": _dumps(_Reduce(np.dtype, ("f4", False, True),
                                           (3, "<", None, -1, -1, 0)), 2),
        "fuzz-void-state": _dumps(_Reduce(np.dtype, ("V8", False, True),
                                          (3, "|", None, ("a",), 1, 0)), 2),
    }


def hostile_pickles() -> dict[str, bytes]:
    """Every malicious pickle above, by finding (small ones only)."""
    return {"S1": s1_object_dtype_scalar(), "S3-bytearray8": s3_bytearray8_claim(),
            "S3-bytearray": s3_bytearray_call(), "S3-set-range": s3_set_of_range(),
            "S4": s4_zero_stride(), "S5": s5_no_buffer(), "U4": u4_self_reference(),
            "U4-dtype": u4_dtype_cycle(), "U4-deep-tuple": u4_deep_tuple(),
            **fuzz_dtype_states()}


# -- tar shards -----------------------------------------------------------------------------
def _tar(members: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]], fmt) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for m in members:
            info, data = m if isinstance(m, tuple) else (m, b"")
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _header(name: str, size: int, kind: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.GNU_FORMAT)


def c1_pax_zero_length() -> bytes:
    """C1: a pax extended header whose record says length 0, then a member and the end."""
    pax = b"0 path=x\n"
    blocks = _header("././@PaxHeader", len(pax), tarfile.XHDTYPE)
    blocks += pax + bytes(-len(pax) % 512)
    blocks += _header("a.txt", 1, tarfile.REGTYPE) + b"x" + bytes(511)
    return blocks + bytes(1024)


def valid_tar(records: int = 3) -> bytes:
    """A small shard (GNU and pax members): what the fuzzers mutate."""
    members = []
    for i in range(records):
        info = tarfile.TarInfo(f"{i:06d}.json")
        data = b'{"text": "hello %d"}' % i
        info.size = len(data)
        members.append((info, data))
    return _tar(members, tarfile.PAX_FORMAT)
