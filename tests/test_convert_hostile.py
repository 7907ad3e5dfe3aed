"""Hostile and careless input to ``rlbuffers convert sb3`` (issue 32): pickles that crashed
the process, allocated what they claimed, forged arrays or recursed for ever are refused with
a ``ConvertError`` whose cause is an ``UnsafePickleError``; ``--overwrite`` replaces only a
buffer, and only once the new one is complete."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlbuffers import BufferExistsError, ReplayBuffer
from rlbuffers.cli import main as cli_main
from rlbuffers.errors import UnsafePickleError
from rlbuffers.integrations.sb3.convert import ConvertError, convert_sb3
from rlbuffers.integrations.sb3.inert_pickle import MappingUnpickler
from tests import hostile_inputs as h

ROOT = Path(__file__).resolve().parents[1]

# Loads each pickle in a child under a 1.5 GiB address-space limit: a segfault shows as the
# child's exit status, an allocation of what a pickle claims as MemoryError.
_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**29, 3 * 2**29))
from rlbuffers.integrations.sb3.convert import load_sb3_pickle
path = sys.argv[1]
try:
    b = load_sb3_pickle(path)
    out = ["loaded", None, str(getattr(b.observations, "shape", None))]
except Exception as e:
    out = [type(e).__name__, type(e.__cause__).__name__, f"{e} | {e.__cause__}"]
print(json.dumps(out))
"""


def _load_in_child(path: Path) -> tuple[int, list[str] | None]:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                              "OPENBLAS_NUM_THREADS": "1"})
    return r.returncode, json.loads(r.stdout) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def child_results(tmp_path_factory) -> dict[str, tuple[int, list[str] | None]]:
    d = tmp_path_factory.mktemp("hostile")
    out = {}
    cases = dict(h.hostile_pickles())
    cases["S3-bytearray8-gzip"] = gzip.compress(h.s3_bytearray8_claim())
    cases["valid"] = h.valid_sb3_pickle()
    for name, data in cases.items():
        (d / name).write_bytes(data)
        out[name] = _load_in_child(d / name)
    return out


def _refused(result: tuple[int, list[str] | None], words: str) -> None:
    rc, got = result
    assert rc == 0, f"the child died with status {rc}"
    assert got is not None and got[:2] == ["ConvertError", "UnsafePickleError"], got
    assert words in got[2], got[2]


def test_child_loads_a_valid_pickle_under_the_same_limit(child_results):
    assert child_results["valid"] == (0, ["loaded", None, "(8, 1, 2)"])


def test_s1_forged_object_dtype_scalar_does_not_segfault(child_results):
    assert len(h.s1_object_dtype_scalar()) < 1000
    _refused(child_results["S1"], "object dtypes are refused")


def test_s1_dtype_state_with_forged_flags_is_refused():
    # a plain float64 dtype whose pickled state claims other flags than numpy's
    forged = h._Reduce(np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 8))
    with pytest.raises(UnsafePickleError, match="forged"):
        MappingUnpickler(io.BytesIO(pickle.dumps(forged, 2)), None).load()


@pytest.mark.parametrize("name, words", [
    ("S3-bytearray8", "claims 2,147,483,648 bytes, only 1 are left"),
    ("S3-bytearray", "bytearray(2147483648) is refused"),
    ("S3-set-range", "set(range(0, 10000000000)) is refused"),
])
def test_s3_small_pickles_do_not_allocate_what_they_claim(child_results, name, words):
    _refused(child_results[name], words)


def test_s3_claim_in_a_gzip_stream_is_read_piecewise(child_results):
    rc, got = child_results["S3-bytearray8-gzip"]
    assert rc == 0 and got is not None and got[0] == "ConvertError", got
    assert "truncated" in got[2] or "exhausted" in got[2], got


def test_s3_memory_budget_bounds_a_whole_load():
    data = pickle.dumps({"a": bytes(4096), "b": bytes(4096)}, 4)
    up = MappingUnpickler(io.BytesIO(data), None, memory_budget=6000)
    with pytest.raises(UnsafePickleError, match="memory budget of 6,000 bytes"):
        up.load()
    up = MappingUnpickler(io.BytesIO(pickle.dumps(list(range(100)), 4)), None, max_objects=50)
    with pytest.raises(UnsafePickleError, match="more than 50 objects"):
        up.load()


def test_s4_zero_stride_array_is_refused(child_results, tmp_path):
    _refused(child_results["S4"], "numpy.ndarray(...) called directly is refused")
    (tmp_path / "s4.pkl").write_bytes(h.s4_zero_stride())
    with pytest.raises(ConvertError):
        convert_sb3(tmp_path / "s4.pkl", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_s5_array_without_buffer_is_refused(child_results):
    _refused(child_results["S5"], "numpy.ndarray(...) called directly is refused")


@pytest.mark.parametrize("shape, dtype", [
    ((4, 1, 2), np.dtype([("a", "<f4"), ("b", "u1", (3,))])),
    ((3, 2), np.dtype("<f8")), ((5,), np.dtype("bool")), ((2, 2), np.dtype(">i4")),
])
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_and_scalars_still_round_trip(shape, dtype, protocol):
    a = np.arange(int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype)
    a = a.reshape(shape)
    obj = {"a": a, "s": a.ravel()[0], "f": np.float32(1.5), "t": np.asfortranarray(a)}
    data = pickle.dumps(obj, protocol)
    got, ref = MappingUnpickler(io.BytesIO(data), None).load(), pickle.loads(data)
    for k in ("a", "t"):  # as the standard unpickler rebuilds them (bytes and all)
        assert got[k].dtype == ref[k].dtype and got[k].shape == shape
        assert got[k].tobytes() == ref[k].tobytes() and got[k].strides == ref[k].strides
    assert got["s"] == ref["s"] and got["f"] == np.float32(1.5)


@pytest.mark.parametrize("name", ["fuzz-m8-state", "fuzz-short-state", "fuzz-void-state"])
def test_dtype_states_that_crashed_numpy_are_refused(child_results, name):
    _refused(child_results[name], "dtype")


def test_u4_self_referencing_pickles_end_in_convert_error(child_results):
    _refused(child_results["U4-dtype"], "refers to itself")
    _refused(child_results["U4-deep-tuple"], "nests tuples more than 1000 deep")
    nested = pickle.dumps({((((1,),),),): [[[[2]]]]}, 4)  # shallow nesting still loads
    assert MappingUnpickler(io.BytesIO(nested), None).load() == {((((1,),),),): [[[[2]]]]}
    rc, got = child_results["U4"]
    assert rc == 0 and got is not None and got[0] == "ConvertError", got


def test_pickle_state_cannot_plant_methods_the_unpickler_calls():
    # BUILD {"__setstate__": set} then BUILD again: the second would call set(state)
    class Planted:
        def __reduce__(self):
            return (h.FakeSB3Buffer, ({},), {"__setstate__": 1, "append": 2})
    got = MappingUnpickler(io.BytesIO(h._dumps(Planted())), None).load()
    assert "__setstate__" not in vars(got) and "append" not in vars(got)


# -- D3: --overwrite ---------------------------------------------------------------------------
def _pickle(tmp_path: Path, data: bytes, name: str = "rb.pkl") -> Path:
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def test_d3_overwrite_never_deletes_a_directory_that_is_not_a_buffer(tmp_path):
    out = tmp_path / "project"
    (out / "src").mkdir(parents=True)
    (out / "src" / "main.py").write_text("print('mine')\n")
    pkl = _pickle(tmp_path, h.valid_sb3_pickle())
    with pytest.raises(BufferExistsError, match="replaces only an rlbuffers buffer.*src"):
        convert_sb3(pkl, out, overwrite=True)
    assert (out / "src" / "main.py").read_text() == "print('mine')\n"
    assert cli_main(["convert", "sb3", str(pkl), str(out), "--overwrite", "--quiet"]) == 2
    assert (out / "src" / "main.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "rb.pkl"]


def test_d3_failed_overwrite_keeps_the_old_buffer(tmp_path):
    out = tmp_path / "buf"
    convert_sb3(_pickle(tmp_path, h.valid_sb3_pickle(8)), out).close()
    bad = _pickle(tmp_path, h.s4_zero_stride(), "bad.pkl")
    with pytest.raises(ConvertError):
        convert_sb3(bad, out, overwrite=True)
    with pytest.raises(ValueError):  # create itself fails (capacity), after the pickle loaded
        convert_sb3(_pickle(tmp_path, h.valid_sb3_pickle(4), "ok.pkl"), out, overwrite=True,
                    capacity=-1)
    with ReplayBuffer.open(out, mode="r") as rb:
        assert len(rb) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pkl", "buf", "ok.pkl", "rb.pkl"]


def test_d3_overwrite_replaces_a_buffer_once_the_new_one_is_complete(tmp_path):
    out = tmp_path / "buf"
    convert_sb3(_pickle(tmp_path, h.valid_sb3_pickle(8)), out).close()
    seen = []

    def progress(done, total):  # the old buffer is still in place while the new one is built
        with ReplayBuffer.open(out, mode="r") as rb:
            seen.append(len(rb))

    rb = convert_sb3(_pickle(tmp_path, h.valid_sb3_pickle(5), "five.pkl"), out,
                     overwrite=True, progress=progress)
    assert len(rb) == 5 and seen == [8]
    rb.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buf", "five.pkl", "rb.pkl"]
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_sb3(tmp_path / "five.pkl", empty).close()  # an empty directory is fine
    with pytest.raises(BufferExistsError, match="not empty"):
        convert_sb3(tmp_path / "five.pkl", empty)
    with pytest.raises(ValueError, match="expected a local directory"):
        convert_sb3(tmp_path / "five.pkl", "s3://bucket/buf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buf", "empty", "five.pkl", "rb.pkl"]
