"""Where ``ReplayBuffer.sample(256)`` spends its time, on the workloads of
``tools/bench/bench_peers.py`` at its sizes, with cpprb side by side where it imports.

For each workload: fill an rlbuffers buffer (uniform, then one with a ``PrioritizedSampler``
whose first half of transitions gets priority 1e-6, as bench_peers does; on the ragged
workload each is also sampled with ``ragged="packed"`` and ``ragged="padded"``: the
"rlbuffers packed" and "rlbuffers padded" rows) and a cpprb buffer;
warm up; then ``--rounds`` interleaved rounds timing ``sample(256)`` of every system in turn
(medians of wall and CPU time reported), then one cProfile run of rlbuffers' sampling split by
the functions it calls (index drawing, column gathers, batch assembly).

``--baseline REV`` adds "before" rows: the same buffers sampled with the sampling functions of
git revision ``REV`` (the functions in :data:`PATCHED`, swapped in for that system's turn of
each round), so before and after are compared in one process on the same data.

Run: ``python -m tools.bench.profile_sample [--workloads abc] [--rounds 7]`` (cpprb must be
importable, e.g. ``pip install --target DIR cpprb`` and ``DIR`` on ``PYTHONPATH``; without it
an in-RAM numpy gather of the same data stands in as the reference).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import cProfile
import gc
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench.bench_peers import CPPRB, RLB, B, Workload, atari, big_float, padded, tokens

#: (module, class, method) of the functions on the sampling path that ``--baseline`` swaps.
PATCHED = [("rlbuffers.sampling.segment_tree", "SegmentTree", "find_prefix"),
           ("rlbuffers.sampling.segment_tree", "SegmentTree", "_descend"),
           ("rlbuffers.sampling.samplers", "PrioritizedSampler", "sample"),
           ("rlbuffers.storage.working", "FixedColumn", "gather"),
           ("rlbuffers.storage.working", "RaggedColumn", "gather"),
           ("rlbuffers.storage.working", "RaggedColumn", "gather_packed"),
           ("rlbuffers.storage.working", "RaggedColumn", "gather_padded"),
           ("rlbuffers.packed", "Packed", "to_list")]


def baseline_methods(rev: str) -> list[tuple[type, str, Callable[..., Any]]]:
    """The methods of :data:`PATCHED` as git revision ``rev`` wrote them (in the module file
    named there, or, where ``rev`` has the class elsewhere, in the file of the module that
    holds it today: ``RaggedColumn`` moved from ``storage/working.py`` to
    ``storage/ragged_column.py``), compiled in the module that holds the class today (so
    their helpers resolve): ``(class, name, function)``; a method ``rev`` did not have is
    left out."""
    root = Path(__file__).resolve().parents[2]
    out = []
    for mod_name, cls_name, meth in PATCHED:
        mod = sys.modules.get(mod_name) or __import__(mod_name, fromlist=["_"])
        cls = getattr(mod, cls_name)  # today's class: its module's names resolve the helpers
        for path in dict.fromkeys(m.replace(".", "/") + ".py"
                                  for m in (mod_name, cls.__module__)):
            src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{path}"],
                                 capture_output=True, text=True).stdout
            cls_node = next((n for n in ast.parse(src).body
                             if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
            if cls_node is not None:
                break
        else:
            raise LookupError(f"{rev}: no class {cls_name} in {mod_name} or {cls.__module__}")
        fn_node = next((n for n in cls_node.body
                        if isinstance(n, ast.FunctionDef) and n.name == meth), None)
        if fn_node is None:  # a method newer than ``rev``: today's stays in place
            continue
        fn_node.decorator_list = []
        code = textwrap.dedent(ast.get_source_segment(src, fn_node) or "")
        scope = dict(vars(sys.modules[cls.__module__]))
        exec(compile("from __future__ import annotations\n" + code, f"{rev}:{path}", "exec"),
             scope)
        out.append((cls, meth, scope[meth]))
    return out


@contextlib.contextmanager
def swapped(methods: list[tuple[type, str, Callable[..., Any]]]) -> Iterator[None]:
    """Run with ``methods`` installed on their classes; the current ones restored after."""
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in methods]
    try:
        for cls, name, fn in methods:
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


@contextlib.contextmanager
def pread_reads(sample: Callable[[], Any]) -> Iterator[None]:
    """Run with the fixed columns of the buffer behind ``sample`` (a bound ``RLB.sample``)
    gathered by ``pread`` threads (:attr:`FixedColumn.random_reads`), restored after."""
    cols = list(sample.__self__.buf._storage.working.columns.values())  # type: ignore[attr-defined]
    was = [getattr(c, "random_reads", None) for c in cols]
    try:
        for c in cols:
            if hasattr(c, "random_reads"):
                c.random_reads = True
        yield
    finally:
        for c, w in zip(cols, was, strict=True):
            if w is not None:
                c.random_reads = w


class NumpyRef:
    """An in-RAM numpy copy of the same data, sampled by fancy indexing (the reference when
    cpprb is missing)."""

    name = "numpy in RAM"

    def __init__(self, wl: Workload, n: int) -> None:
        parts = list(wl.batches(0, n))
        self.cols = {k: (padded([r for p in parts for r in p[k]])[0] if k == "obs" and wl.ragged
                         else np.concatenate([p[k] for p in parts])) for k in parts[0]}
        self.rng = np.random.default_rng(0)
        self.n = n

    def sample(self) -> Any:
        idx = self.rng.integers(0, self.n, B)
        return {k: v[idx] for k, v in self.cols.items()}


def _time(fn: Callable[[], Any], seconds: float) -> tuple[float, float, float, float]:
    """Calls per second of ``fn`` over about ``seconds``; per call: CPU seconds (all threads
    of this process: less sensitive than the wall time to other processes on the machine),
    minor and major page faults (a major fault reads from disk: a page not in page cache)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    t, c, k = time.perf_counter(), time.process_time(), 0
    while k < 5 or time.perf_counter() - t < seconds:
        fn()
        k += 1
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    ru2 = resource.getrusage(resource.RUSAGE_SELF)
    return k / wall, cpu / k, (ru2.ru_minflt - ru.ru_minflt) / k, (ru2.ru_majflt - ru.ru_majflt) / k


def systems(wl: Workload, scratch: Path) -> dict[str, Callable[[], Any]]:
    """Name -> a ``sample(256)`` callable of each system, filled and warmed."""
    cap = wl.n + wl.n // 50
    low = np.arange(wl.n) < wl.n // 2
    out: dict[str, Callable[[], Any]] = {}
    for per in (False, True):
        d = scratch / f"rlb-{per}"
        d.mkdir()
        s = RLB(wl, cap, d)
        s.build(per=per)
        for b in wl.batches(0, wl.n):
            s.add(b)
        if per:
            s.set_priorities(low, wl.n)
        out[f"rlbuffers {'prioritized' if per else 'uniform'}"] = s.sample
        if wl.ragged:
            out[f"rlbuffers packed {'prioritized' if per else 'uniform'}"] = s.sample_packed
            out[f"rlbuffers padded {'prioritized' if per else 'uniform'}"] = s.sample_padded
    try:
        import cpprb  # noqa: F401
    except ImportError:
        out["numpy in RAM (no cpprb)"] = NumpyRef(wl, wl.n).sample
        return out
    for per in (False, True):
        c = CPPRB(wl, cap, scratch)
        c.build(per=per)
        for b in wl.batches(0, wl.n):
            c.add(b)
        if per:
            c.set_priorities(low, wl.n)
        out[f"cpprb {'prioritized' if per else 'uniform'}"] = c.sample
    return out


def profile(fn: Callable[[], Any], calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by total time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    import io

    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def measure(fns: dict[str, Callable[[], Any]], before: list[tuple[type, str, Any]],
            rounds: int, seconds: float) -> None:
    """Interleaved rounds of every system in turn; prints medians (rate and CPU per call)."""
    res: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            with swapped(before) if name.endswith("(before)") else contextlib.nullcontext(), \
                    pread_reads(fn) if name.endswith("(pread)") else contextlib.nullcontext():
                res[name].append(_time(fn, seconds))
    for name, r in res.items():
        rate, cpu, minor, major = (statistics.median(x) for x in zip(*r, strict=True))
        print(f"{name:34s} median {rate:7,.0f} /s, CPU {cpu * 1e6:7,.0f} us/call, faults/call "
              f"{minor:5.1f} minor {major:5.2f} major  (rounds /s: "
              f"{', '.join(f'{x[0]:,.0f}' for x in r)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workloads", default="abc")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.0, help="per system and round")
    ap.add_argument("--atari", type=int, default=100_000)
    ap.add_argument("--frames", type=int, default=5000)
    ap.add_argument("--big", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--profile", type=int, default=200, help="calls per cProfile (0: none)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--baseline", default=None, help="git revision to compare with (before)")
    ap.add_argument("--pread", action="store_true",
                    help="add rows gathering fixed fields with pread threads (random_reads)")
    args = ap.parse_args()
    makers = {"a": lambda: atari(args.atari, args.frames), "b": lambda: big_float(args.big),
              "c": lambda: tokens(args.tokens)}
    for key in args.workloads:
        root = Path(tempfile.mkdtemp(prefix="rlb-prof-", dir=args.dir))
        try:
            wl = makers[key]()
            t = time.perf_counter()
            fns = systems(wl, root)
            before = baseline_methods(args.baseline) if args.baseline else []
            if args.pread:
                fns = {**fns, **{f"{k} (pread)": v for k, v in fns.items()
                                 if k.startswith("rlbuffers")}}
            if before:
                fns = {**{f"{k} (before)": v for k, v in fns.items()
                          if k.startswith("rlbuffers")}, **fns}
            print(f"## {wl.title}, {wl.n:,} transitions (built in "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
            for fn in fns.values():  # warm: about n rows each, as bench_peers does
                for _ in range(-(-wl.n // B)):
                    fn()
            measure(fns, before, args.rounds, args.seconds)
            if args.profile:
                for name, fn in fns.items():
                    if name.startswith("rlbuffers") and not name.endswith("(before)"):
                        print(f"### cProfile {name}, {args.profile} calls\n"
                              + profile(fn, args.profile, 18), flush=True)
            del fns
            gc.collect()
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
