"""Real Atari at scale: SB3's DQN on Pong with a ZarrReplayBuffer of 1,000,000 transitions in a
2 GiB memory cgroup, saved every 100k steps, ``kill -9``'d mid-run and resumed; side by side
with SB3's own ``ReplayBuffer`` (``optimize_memory_usage=True``) under the same cap.

Every DQN process is a child (``tools/bench/atari_dqn.py``) inside a fresh memory cgroup
(``MemoryCap`` of ``bench_larger_than_ram``); this parent samples the child's anonymous
memory (``RssAnon`` in ``/proc/<pid>/status``) every 0.2 s and sends the ``kill -9``.
Steps, in order:

1. Resume check (small scale, ``--check-capacity``): a run committed every 2,000 steps draws
   its next batches after the commit of step 6,000; the same run ``kill -9``'d past step 6,000
   and resumed draws them again: batches and policy parameters must be equal.
2. The main run: fill ``--transitions`` with SB3's own random-action loop (``learning_starts``
   = the fill), then ``--train-steps`` env steps of training (``train_freq`` 4), committing
   every ``--commit-every``; killed after the commit at half the fill plus a tenth of an
   interval, resumed with ``rlbuffers.integrations.sb3.resume`` to the end.
3. SB3's buffer at ``--transitions`` under the same cap (every row written), then smaller
   capacities until one fits (filled, plus 50 gradient steps).
4. DQN gradient steps/s with SB3's buffer and ours at ``--both-capacity`` (same transitions,
   same process, interleaved rounds, medians).

Run: ``python -m tools.bench.bench_atari [--transitions 1000000] [--cap-gb 2] [--frame-stack]``
(``--transitions 20000 --commit-every 4000 --train-steps 2000 --both-capacity 10000`` is a
few minutes). Writes the ``atari`` section of docs/benchmarks.md.
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

from tools.bench.bench_larger_than_ram import MemoryCap
from tools.bench.report import stamp, table, write_section

ROOT = Path(__file__).resolve().parents[2]
STACK_BYTES = 4 * 84 * 84  # one stacked observation, uint8 [4, 84, 84]


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (``st_blocks``: sparse files count what they use)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum((Path(d) / f).stat().st_blocks * 512
               for d, _, files in os.walk(path) for f in files)


def run_child(cap_bytes: int, mode: str, args: dict, kill_at: int | None = None) -> dict:
    """Run ``atari_dqn MODE`` in a fresh memory cgroup; ``kill -9`` it once a progress event
    reaches step ``kill_at``. Returns exit code, events, peak RssAnon (bytes) and the cap's
    stats."""
    cap = MemoryCap(cap_bytes)
    log = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    events: list[dict] = []
    peak, killed_at = 0, None
    try:
        p = subprocess.Popen([sys.executable, "-m", "tools.bench.atari_dqn", mode,
                              json.dumps(args), "--log", str(log)],
                             preexec_fn=cap.preexec, cwd=ROOT)
        with open(log) as f:
            while True:
                rc = p.poll()
                try:
                    peak = max(peak, _rss_anon(p.pid))
                except (OSError, ValueError):
                    pass
                for line in f.readlines():
                    ev = json.loads(line)
                    events.append(ev)
                    print(mode, ev, flush=True)
                    if (kill_at is not None and killed_at is None and ev["event"] == "progress"
                            and ev["step"] >= kill_at):
                        os.kill(p.pid, signal.SIGKILL)
                        killed_at = ev["step"]
                if rc is not None:
                    break
                time.sleep(0.2)
            events += [json.loads(line) for line in f.readlines()]
        return {"rc": p.wait(), "events": events, "rss_anon_peak": peak, "killed_at": killed_at,
                **cap.stats(), "how": cap.how}
    finally:
        log.unlink(missing_ok=True)
        cap.close()


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _last(events: list[dict], kind: str) -> dict:
    found = [e for e in events if e["event"] == kind]
    return found[-1] if found else {}


def resume_check(a, workdir: Path, cap: int) -> dict:
    """Step 1: batches after resume == batches of the uninterrupted run (small scale)."""
    base = {"seed": 0, "buffer_size": a.check_capacity, "learning_starts": 4000,
            "commit_every": 2000, "progress_every": 500, "total": 8000,
            "frame_stack": a.frame_stack, "chunk_transitions": a.chunk_transitions}
    runs = {}
    for name in ("record", "kill"):
        d = workdir / f"check-{name}"
        d.mkdir()
        runs[name] = {**base, "path": str(d / "buffer"), "draw_out": str(d / "drawn.npz")}
    r = run_child(cap, "train", {**runs["record"], "draw_at": 6000})
    assert r["rc"] == 0, r
    k = run_child(cap, "train", runs["kill"], kill_at=6500)
    assert k["rc"] == -signal.SIGKILL, k
    res = run_child(cap, "resume", runs["kill"])
    assert res["rc"] == 0, res
    expected = dict(np.load(runs["record"]["draw_out"]))
    got = dict(np.load(runs["kill"]["draw_out"]))
    equal = expected.keys() == got.keys() and all(
        np.array_equal(expected[k_], got[k_]) for k_ in expected)
    return {"equal": bool(equal), "killed_at": k["killed_at"],
            "resumed_at": _last(res["events"], "resumed").get("step"), "arrays": len(expected)}


def main_run(a, workdir: Path, cap: int) -> dict:
    """Step 2: fill, kill -9 after the middle commit, resume, train; figures."""
    d = workdir / "main"
    d.mkdir()
    args = {"seed": 0, "buffer_size": a.capacity or a.transitions,
            "learning_starts": a.transitions,
            "commit_every": a.commit_every, "progress_every": max(a.commit_every // 20, 100),
            "total": a.transitions + a.train_steps, "path": str(d / "buffer"),
            "frame_stack": a.frame_stack, "chunk_transitions": a.chunk_transitions}
    half = a.transitions // 2 // a.commit_every * a.commit_every
    t = time.perf_counter()
    first = run_child(cap, "train", args, kill_at=half + a.commit_every // 10)
    second = run_child(cap, "resume", args)
    wall = time.perf_counter() - t
    if second["rc"] != 0:
        raise SystemExit(f"the resumed run failed: {second}")
    buffer = d / "buffer"
    working = disk_bytes(buffer / ".working")
    commits = [e for e in first["events"] + second["events"] if e["event"] == "commit"]
    fill = [e for e in first["events"] if e["event"] == "progress"]
    done = _last(second["events"], "done")
    return {"first": first, "second": second, "wall_s": wall, "commits": commits,
            "working_bytes": working, "persistent_bytes": disk_bytes(buffer) - working,
            "fill_steps_per_s": (fill[-1]["step"] - fill[0]["step"])
            / (fill[-1]["t"] - fill[0]["t"]) if len(fill) > 1 else float("nan"),
            "grad_steps": done.get("grad_steps", 0), "train_s": done.get("train_s", 0.0),
            "resumed_at": _last(second["events"], "resumed").get("step"),
            "resume_s": _last(second["events"], "resumed").get("resume_s")}


def sb3_capacity(a, workdir: Path, cap: int) -> dict:
    """Step 3: SB3's buffer at --transitions, then smaller, until one fits."""
    base = {"seed": 0, "learning_starts": 0, "distinct": 1000, "grad_steps": 50}
    tries = []
    size = a.transitions
    for _ in range(a.sb3_tries):
        r = run_child(cap, "sb3_fill", {**base, "buffer_size": size})
        rows = _last(r["events"], "progress").get("step", 0)
        error = _last(r["events"], "error").get("error", "")
        outcome = ("fits" if r["rc"] == 0 else "oom" if r["rc"] == -signal.SIGKILL
                   else "no_alloc" if error.startswith("MemoryError") else None)
        if outcome is None:
            raise SystemExit(f"the SB3 buffer child failed (not for memory): {r}")
        tries.append({"capacity": size, "rc": r["rc"], "outcome": outcome, "error": error,
                      "rows_written": rows, "rss_anon_peak": r["rss_anon_peak"],
                      "cg_peak_mb": r.get("cg_peak_mb"), "oom_kills": r.get("cg_oom_kills")})
        if outcome == "fits":
            break
        # next: 90% of the rows written before the OOM kill, or of what the cap could hold
        # (numpy's zeros failed: the kernel refused the mapping), in steps of 5,000
        rows = rows if outcome == "oom" else min(size, cap // STACK_BYTES)
        size = max(5000, int(rows * 0.9) // 5000 * 5000)
    return {"tries": tries}


def both(a, workdir: Path, cap: int) -> dict:
    """Step 4: gradient steps/s, SB3's buffer vs ours, same capacity and transitions."""
    r = run_child(cap, "throughput", {
        "seed": 0, "buffer_size": a.both_capacity, "learning_starts": 0,
        "rounds": a.rounds, "grad_steps": a.grad_steps, "path": str(workdir / "both" / "buffer"),
        "frame_stack": a.frame_stack, "chunk_transitions": a.chunk_transitions})
    if r["rc"] != 0:
        raise SystemExit(f"the side-by-side child failed: {r}")
    return {**_last(r["events"], "done"), "rss_anon_peak": r["rss_anon_peak"]}


def _mb(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def report(a, check, main, sb3, side) -> str:
    n = a.transitions
    naive = n * STACK_BYTES
    commits = main["commits"]
    interval_commits = [c for c in commits if c["step"] % a.commit_every == 0
                        and c["interval_s"] > 0 and c is not commits[0]]
    worst = max((c["save_s"] / c["interval_s"] for c in interval_commits), default=float("nan"))
    median_save = float(np.median([c["save_s"] for c in commits])) if commits else float("nan")
    first, second = main["first"], main["second"]
    rows = [
        ["buffer_size / transitions filled (SB3's random-action loop) / env steps of training",
         f"{a.capacity or n:,} / {n:,} / {a.train_steps:,}"],
        ["memory cap", f"{a.cap_gb:g} GiB via {first['how']}"],
        ["fill rate (env steps/s, DQN's own loop incl. add)", f"{main['fill_steps_per_s']:,.0f}"],
        ["kill -9 at step / resumed from the commit of step",
         f"{first['killed_at']:,} / {main['resumed_at']:,} (resume {main['resume_s']:.1f} s)"],
        ["run completed under the cap (exit codes: killed run, resumed run; OOM kills)",
         f"{first['rc']}, {second['rc']}; "
         f"{first.get('cg_oom_kills', '-')}, {second.get('cg_oom_kills', '-')}"],
        ["working tier on disk", f"{main['working_bytes'] / 1e9:.2f} GB "
         f"({main['working_bytes'] / naive:.2f} of the naive stacked obs layout's "
         f"{naive / 1e9:.1f} GB)"],
        ["persistent tier on disk (compressed commits)",
         f"{main['persistent_bytes'] / 1e9:.2f} GB"],
        ["peak RssAnon of the DQN process (sampled every 0.2 s): filling+killed / resumed",
         f"{_mb(first['rss_anon_peak'])} / {_mb(second['rss_anon_peak'])}"],
        ["cgroup peak usage incl. page cache (memory.max_usage): killed / resumed",
         f"{first.get('cg_peak_mb', float('nan')):,.0f} / "
         f"{second.get('cg_peak_mb', float('nan')):,.0f} MiB"],
        [f"commit (model zip + buffer save) every {a.commit_every:,} steps: median s; "
         "worst share of its interval",
         f"{median_save:.1f} s; {100 * worst:.1f}% ({len(commits)} commits)"],
        ["DQN gradient steps/s in the training window (time inside model.train)",
         f"{main['grad_steps'] / max(main['train_s'], 1e-9):.1f} "
         f"({main['grad_steps']:,} steps)"],
        [f"resume after kill -9 samples the same batches (check at {a.check_capacity:,} "
         "capacity, kill after the commit of step 6,000)",
         f"{check['equal']} ({check['arrays']} arrays: 5 batches of 32 + policy parameters)"],
    ]
    outcome = {"fits": lambda t: "fits: filled, 50 gradient steps done",
               "oom": lambda t: f"killed by the cgroup's OOM killer (exit {t['rc']}, OOM kills "
                                f"{t['oom_kills']}) after {t['rows_written']:,} rows",
               "no_alloc": lambda t: f"cannot be allocated: `{t['error']}` in SB3's "
                                     "`ReplayBuffer.__init__` (np.zeros)"}
    sb3_rows = [[f"{t['capacity']:,}", outcome[t["outcome"]](t), _mb(t["rss_anon_peak"])]
                for t in sb3["tries"]]
    ratio = side["ours"] / side["sb3"]
    commit_rows = [[f"{c['step']:,}", f"{c['save_s']:.2f}", f"{c['interval_s']:.1f}",
                    f"{100 * c['save_s'] / c['interval_s']:.1f}%"] for c in commits]
    return (
        "## Atari: SB3's DQN on real Pong with a 1M-transition ZarrReplayBuffer under a cap\n\n"
        f"{stamp()} `python -m tools.bench.bench_atari --transitions {n} --cap-gb {a.cap_gb:g} "
        f"{f'--capacity {a.capacity} ' if a.capacity else ''}"
        f"--commit-every {a.commit_every} --train-steps {a.train_steps} --both-capacity "
        f"{a.both_capacity}{' --frame-stack' if a.frame_stack else ''}"
        f"{f' --chunk-transitions {a.chunk_transitions}' if a.chunk_transitions else ''}`. "
        f"`{ENV}` with SB3's "
        "`AtariWrapper` + `VecFrameStack(4)` + `VecTransposeImage`, DQN `CnnPolicy` (rl-zoo "
        "Atari hyperparameters, `optimize_memory_usage=True`, torch 1 thread, CPU). "
        f"ZarrReplayBuffer {'with' if a.frame_stack else 'without'} frame-stack "
        "deduplication. Each DQN process runs in its own memory cgroup.\n\n"
        + table(["what", "measured"], rows)
        + "\n\nCommits (each: model zip + incremental buffer save; interval: wall time since "
        "the previous commit):\n\n"
        + table(["step", "save s", "interval s", "share"], commit_rows)
        + f"\n\nSB3's own `ReplayBuffer` (`optimize_memory_usage=True`) under the same "
        f"{a.cap_gb:g} GiB cap, every row written (real Pong steps), then 50 gradient steps:\n\n"
        + table(["capacity", "outcome", "peak RssAnon"], sb3_rows)
        + f"\n\nDQN update throughput at a capacity both hold ({a.both_capacity:,}, same "
        f"transitions, one process under the cap, {a.rounds} interleaved rounds of "
        f"{a.grad_steps} gradient steps, medians): SB3's buffer {side['sb3']:.1f} steps/s, "
        f"ZarrReplayBuffer {side['ours']:.1f} steps/s: **{ratio:.2f}x**.\n"
    )


ENV = "PongNoFrameskip-v4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transitions", type=int, default=1_000_000)
    ap.add_argument("--capacity", type=int, default=None,
                    help="buffer_size of the main run (default: --transitions)")
    ap.add_argument("--train-steps", type=int, default=40_000, help="env steps of training")
    ap.add_argument("--commit-every", type=int, default=100_000)
    ap.add_argument("--cap-gb", type=float, default=2.0)
    ap.add_argument("--check-capacity", type=int, default=5000,
                    help="buffer_size of the resume check (its run has 8,000 steps)")
    ap.add_argument("--both-capacity", type=int, default=40_000,
                    help="capacity of the SB3-vs-ours throughput comparison")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--grad-steps", type=int, default=200)
    ap.add_argument("--sb3-tries", type=int, default=4)
    ap.add_argument("--frame-stack", action="store_true",
                    help="ZarrReplayBuffer(frame_stack_axis=0): one frame stored per transition")
    ap.add_argument("--chunk-transitions", type=int, default=None,
                    help="ZarrReplayBuffer chunk_transitions (with --frame-stack at 1M: 64; the "
                         "default chunks the frame column ~1M rows, 7 GB, see docs/scale.md)")
    ap.add_argument("--skip", default="",
                    help="comma-separated steps not to run: check,main,sb3,both")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--results", default=None,
                    help="JSON file of step results: steps found there are not run again, "
                         "each step run is added (a long run in pieces)")
    a = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rlb-atari-", dir=a.dir))
    cap = int(a.cap_gb * 2**30)
    skip = set(a.skip.split(","))
    results_path = Path(a.results) if a.results else None
    results = json.loads(results_path.read_text()) if results_path and results_path.exists() \
        else {}
    steps = {"check": resume_check, "main": main_run, "sb3": sb3_capacity, "both": both}
    try:
        for name, step in steps.items():
            if name in results or name in skip:
                continue
            results[name] = step(a, workdir, cap)
            print(name, {k: v for k, v in results[name].items()
                         if k not in ("first", "second")}, flush=True)
            if results_path:  # merged: another invocation may have added steps meanwhile
                saved = json.loads(results_path.read_text()) if results_path.exists() else {}
                results_path.write_text(json.dumps({**saved, name: results[name]}))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    missing = [n for n in steps if n not in results]
    if missing:
        print(f"not reported: steps {missing} have no results yet")
        return
    body = report(a, results["check"], results["main"], results["sb3"], results["both"])
    write_section("atari", body)
    print(body)


if __name__ == "__main__":
    main()
