"""Random SIGKILL campaign (not CI): a writer (``tests/crash_writer.py``: extend, sample,
update priorities, foreground and background saves, in a loop) is killed ``--kills`` times at
random moments; after each kill the buffer is opened as a reader, as a writer, and from a fresh
working directory (persistent tier alone), and every row is checked against the transition ids
of the commit it shows. Where each kill landed is recorded: before the writer had opened the
buffer, inside a save (an uncommitted ``versions/g<N>`` left behind), or elsewhere.

Run: ``python -m tools.bench.bench_kills [--kills 100]``. Writes the ``kills`` section of
docs/benchmarks.md. The deterministic counterpart (a crash at each filesystem operation of a
save) is ``tests/test_fault_injection.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rlbuffers import ReplayBuffer
from rlbuffers.maintenance.inspection import inspect_path
from rlbuffers.storage.manifest import COMMIT_KEY
from tests.crash_writer import CAPACITY, batch
from tools.bench.report import stamp, table, write_section

ROOT = Path(__file__).resolve().parents[2]


def check(buf: ReplayBuffer) -> None:
    """Every row of ``buf`` is the transition its commit says (ids, frames, tokens)."""
    total = buf.total_added
    if buf.metadata.get("total", 0) != total:
        raise AssertionError(f"manifest total {buf.metadata} != total_added {total}")
    ids = np.arange(max(0, total - CAPACITY), total)
    if not len(ids):
        return
    rows, want = buf[:], batch(0, total)
    np.testing.assert_array_equal(rows["value"], ids)
    np.testing.assert_array_equal(rows["frame"], want["frame"][ids])
    for got, i in zip(rows["tokens"], ids, strict=True):
        np.testing.assert_array_equal(got, want["tokens"][i])


def one_kill(path: Path, k: int, rng: np.random.Generator, scratch: Path) -> str:
    """Start the writer, kill it at a random moment, check the buffer; returns where it
    landed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.crash_writer", str(path), str(k)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out = proc.stdout.readline()  # "start"
    if k % 2 == 0:
        out += proc.stdout.readline()  # "ready": kill inside the loop
        time.sleep(float(rng.uniform(0.05, 1.5)))
    else:
        time.sleep(float(rng.uniform(0.0, 0.8)))
    proc.send_signal(signal.SIGKILL)
    out += proc.communicate()[0]
    if not (path / "manifest.json").exists():
        return "before create"
    head = json.loads((path / "manifest.json").read_text())[COMMIT_KEY]
    versions = path / "versions"
    mid_save = versions.exists() and any(int(d.name[1:]) > head for d in versions.iterdir())
    if inspect_path(path, verify=True)["corrupt"]:
        raise AssertionError(f"kill {k}: corrupt chunks")
    with ReplayBuffer.open(path, mode="r") as ro:
        check(ro)
    with ReplayBuffer.open(path) as rw:
        check(rw)
    fresh = scratch / f"fresh{k}"
    with ReplayBuffer.open(path, working_dir=fresh) as again:
        check(again)
    shutil.rmtree(fresh)
    if "ready" not in out:
        return "before open finished"
    return "inside a save" if mid_save else "elsewhere in the loop"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--no-write", action="store_true", help="print, don't write the docs")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    landed: dict[str, int] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "buf"
        for k in range(args.kills):
            where = one_kill(path, k, rng, Path(tmp))
            landed[where] = landed.get(where, 0) + 1
            print(f"kill {k + 1}/{args.kills}: {where}", flush=True)
        with ReplayBuffer.open(path, mode="r") as ro:
            final = (ro.commit, ro.total_added)
    seconds = time.perf_counter() - t0
    rows = [[where, n] for where, n in sorted(landed.items())]
    body = (
        "## Random SIGKILL campaign (`tools/bench/bench_kills.py`)\n\n"
        f"{stamp()} `python -m tools.bench.bench_kills --kills {args.kills}`, {seconds:.0f} s. "
        "A writer extends, samples, updates priorities and saves (half of the saves in the "
        "background) in a loop and is killed at a random moment, "
        f"{args.kills} times; after each kill the buffer is verified (`inspect --verify`) and "
        "opened as a reader, as a writer and from an empty working directory, and every row is "
        "checked against the transition ids of the commit it shows.\n\n"
        + table(["where the kill landed", "kills"], rows)
        + f"\n\nCorrupt or mixed reopenings: 0 of {args.kills}. Last commit: "
        f"{final[0]}, {final[1]:,} transitions added.\n"
    )
    print(body)
    if not args.no_write:
        write_section("kills", body)


if __name__ == "__main__":
    main()
