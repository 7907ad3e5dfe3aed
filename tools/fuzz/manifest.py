"""Fuzz the manifest reader: tampered ``manifest.json`` / ``history/g<N>.json`` files, read by
every entry point (``ReplayBuffer.open`` as reader and writer, a save, ``inspect --verify``,
``repair``). A finding is an exception that is not one of rlbuffers' own (``RLBuffersError``),
a file written, changed or deleted outside the buffer's directory, or a run longer than
``HANG_SECONDS``.

    python -m tools.fuzz.manifest --minutes 10

prints how many inputs were tried and every finding (the mutation and the traceback). The test
suite runs the same check for a bounded number of examples (``tests/test_manifest_fuzz.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from rlbuffers.errors import RLBuffersError
from rlbuffers.maintenance.inspection import inspect_path
from rlbuffers.maintenance.repair import repair

#: One input taking longer than this is a finding (seconds).
HANG_SECONDS = 20
FIELDS = {"obs": FieldSpec((3,), "float32"), "tokens": FieldSpec((None, 2), "int16"),
          "done": FieldSpec((), "bool")}


class Hang(Exception):
    """An input ran past ``HANG_SECONDS``."""


def make_template(root: Path) -> Path:
    """A small saved buffer with three commits (kept: 2), ragged and fixed fields."""
    path = root / "template"
    with ReplayBuffer.create(path, capacity=20, fields=FIELDS, chunk_transitions=4,
                             sampler=PrioritizedSampler(), seed=0) as buf:
        for k in range(3):
            n = 7
            buf.extend({"obs": np.full((n, 3), k, np.float32),
                        "tokens": [np.full((i % 3, 2), i, np.int16) for i in range(n)],
                        "done": np.arange(n) % 3 == 2})
            buf.save(metadata={"k": k})
    return path


def _paths(x: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path into a JSON value."""
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["../../victim", "/tmp/x", "<f16", "<M8[s]", "|V4", "3", "", "_x", ".w",
                       "PCG64", "uniform", "prioritized", "zstd", 2**63, -(2**63), 10**15,
                       1e15, -1, 0]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=3),
    max_leaves=6)


@st.composite
def mutations(draw: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    """A plan: which file, which edits (set / delete a key path, or raw bytes), and whether
    to drop the working tier (forcing a rebuild from the manifest)."""
    paths = [p for p in _paths(manifest) if p]
    edits = draw(st.lists(st.tuples(st.sampled_from(["set", "delete", "bump"]),
                                    st.sampled_from(paths), JSON), min_size=1, max_size=3))
    raw = draw(st.none() | st.binary(max_size=64)) if draw(st.integers(0, 19)) == 0 else None
    return {"file": draw(st.sampled_from(["manifest.json", "manifest.json", "history/g2.json"])),
            "edits": edits, "raw": raw, "drop_working": draw(st.booleans())}


def _apply(data: Any, edits: list[tuple[str, tuple[Any, ...], Any]]) -> Any:
    for op, path, value in edits:
        parent = data
        try:
            for k in path[:-1]:
                parent = parent[k]
            old = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if op == "delete":
            del parent[path[-1]]
        elif op == "bump" and isinstance(old, int) and not isinstance(old, bool):
            parent[path[-1]] = old + (value if isinstance(value, int) else 1)
        else:
            parent[path[-1]] = value
    return data


def _files(root: Path, skip: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and skip not in p.parents}


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def hang(*_: Any) -> None:
        raise Hang(f"ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _exercise(path: Path) -> None:
    """Every entry point that reads a manifest; rlbuffers' own errors are expected."""
    def quietly(fn: Any) -> None:
        try:
            fn()
        except RLBuffersError:
            pass

    def read() -> None:
        with ReplayBuffer.open(path, mode="r") as ro:
            if len(ro):
                ro[:]
                ro.sample(2)

    def write() -> None:
        with ReplayBuffer.open(path) as rw:
            if len(rw):
                rw[:]
                rw.sample(2)
            rw.save()

    for fn in (read, lambda: inspect_path(path, verify=True), lambda: repair(path), write,
               read):
        quietly(fn)


def check_one(template: Path, sandbox: Path, plan: dict[str, Any]) -> str | None:
    """Run one mutation in ``sandbox``; a description of the finding, or None."""
    shutil.rmtree(sandbox, ignore_errors=True)
    sandbox.mkdir(parents=True)
    (sandbox / "victim.npy").write_bytes(b"precious")
    (sandbox / "victim").mkdir()
    path = sandbox / "a" / "b" / "buf"
    shutil.copytree(template, path)
    target = path / plan["file"]
    if plan["raw"] is not None:
        target.write_bytes(plan["raw"])
    else:
        target.write_text(json.dumps(_apply(json.loads(target.read_text()), plan["edits"])))
    if plan["drop_working"]:
        shutil.rmtree(path / ".working")
    outside = _files(sandbox, path)
    try:
        with _deadline(HANG_SECONDS):
            _exercise(path)
    except BaseException as e:  # noqa: BLE001 - every escape is the finding
        if isinstance(e, KeyboardInterrupt):
            raise
        return f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    if _files(sandbox, path) != outside:
        return "a file outside the buffer directory was written, changed or deleted"
    return None


def run(minutes: float, root: Path) -> tuple[int, list[tuple[dict[str, Any], str]]]:
    """Fuzz for ``minutes`` in batches of ``BATCH`` inputs (each batch a new hypothesis seed;
    findings are recorded, not raised, so nothing is shrunk); returns (inputs tried,
    findings)."""
    template = make_template(root)
    manifest = json.loads((template / "manifest.json").read_text())
    findings: list[tuple[dict[str, Any], str]] = []
    tried = 0
    stop = time.monotonic() + 60 * minutes

    @settings(max_examples=BATCH, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(plan=mutations(manifest))
    def fuzz(plan: dict[str, Any]) -> None:
        nonlocal tried
        if time.monotonic() > stop:
            return
        tried += 1
        found = check_one(template, root / "sandbox", plan)
        if found is not None:
            findings.append((plan, found))
            print(f"FINDING {len(findings)}: {plan!r:.400}\n{found}", flush=True)

    batch = 0
    while time.monotonic() < stop:
        seed(batch)(fuzz)()
        batch += 1
    return tried, findings


#: Inputs per hypothesis run of :func:`run`.
BATCH = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlbuffers-fuzz-") as tmp:
        tried, findings = run(args.minutes, Path(tmp))
    print(f"manifest fuzzer: {tried} inputs tried in {args.minutes:g} min, "
          f"{len(findings)} finding(s)")


if __name__ == "__main__":
    main()
