"""The command line starts light: ``rlbuffers --help`` and every command's ``--help`` import
neither torch nor webdataset (nor zarr or numpy), and ``rlbuffers inspect`` of a small buffer
imports neither torch nor webdataset and peaks well under 80 MB RSS.

Each check runs in a fresh interpreter (the test process has imported everything already).
Wall-clock targets (< 0.5 s) are not asserted here: they depend on the machine; the module
set and the peak RSS stand for them.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlbuffers import FieldSpec, ReplayBuffer

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "webdataset")

#: Runs ``main`` on each argv of ``sys.argv[1]`` (JSON) in turn and prints, as JSON, which of
#: the watched modules were imported after each, and the peak RSS in MB.
CHILD = """
import contextlib, io, json, resource, sys
from rlbuffers.cli import main
watched = ("torch", "webdataset", "zarr", "numpy", "tqdm")
out = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out.append({"argv": argv, "code": code,
                "imported": [m for m in watched if m in sys.modules]})
try:  # this program's peak (ru_maxrss would include the parent's at fork + exec)
    with open("/proc/self/status") as f:
        peak_mb = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
except OSError:
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"runs": out, "peak_mb": peak_mb}))
"""


def _run(*argvs):
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argvs)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def small_buffer(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup") / "buffer"
    buf = ReplayBuffer.create(path, capacity=1000, fields={
        "obs": FieldSpec((17,), "float32"), "action": FieldSpec((6,), "float32"),
        "reward": FieldSpec((), "float32"), "terminated": FieldSpec((), "bool")})
    n = 500
    buf.extend({"obs": np.ones((n, 17)), "action": np.ones((n, 6)), "reward": np.arange(n),
                "terminated": np.arange(n) % 100 == 99})
    buf.save()
    buf.close()
    return str(path)


def test_help_imports_nothing_heavy():
    r = _run(["--help"], ["inspect", "--help"], ["verify", "--help"], ["shards", "--help"],
             ["shards", "write", "--help"], ["convert", "sb3", "--help"],
             ["convert", "minari", "--help"], ["convert", "parquet", "--help"],
             ["export", "--help"], ["export", "minari", "--help"],
             ["export", "parquet", "--help"])
    for run in r["runs"]:
        assert run["code"] == 0, run
        # parsing arguments needs none of the data libraries
        assert run["imported"] == [], run


def test_inspect_imports_neither_torch_nor_webdataset(small_buffer):
    r = _run(["inspect", small_buffer], ["inspect", small_buffer, "--json", "--verify"])
    for run in r["runs"]:
        assert run["code"] == 0, run
        assert not set(HEAVY) & set(run["imported"]), run
        assert "zarr" in run["imported"]  # it did read the buffer
    # torch alone is ~300 MB; an inspect of a small buffer needs ~50 MB
    assert r["peak_mb"] < 80, r


def test_console_script_inspect(small_buffer):
    """The module entry point, as ``rlbuffers inspect`` runs it."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['rlbuffers', 'inspect', {small_buffer!r}]\n"
            "try:\n    runpy.run_module('rlbuffers.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            f"print('heavy:', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "500 / 1,000 transitions" in res.stdout
    assert "heavy: []" in res.stderr


def test_lazy_package_names_still_import():
    code = ("import sys, rlbuffers, rlbuffers.stream\n"
            "assert 'zarr' not in sys.modules and 'torch' not in sys.modules\n"
            "from rlbuffers import FieldSpec, ReplayBuffer, UniformSampler\n"
            "from rlbuffers.stream import StreamConfig, pack_bfd\n"
            "missing = [n for n in rlbuffers.__all__ if not hasattr(rlbuffers, n)]\n"
            "missing += [n for n in rlbuffers.stream.__all__ if not hasattr(rlbuffers.stream, n)]\n"
            "assert not missing, missing\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
