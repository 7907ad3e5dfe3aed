"""Peak memory of a command as an outside sampler sees it: the resident set (RSS) of the whole
process tree (the command and every descendant, summed), read from ``/proc`` every
``--interval`` seconds (20 ms by default) by this process, never by the program measured.

The command's output (stdout and stderr, merged) is passed through and each line is stamped
with the time it arrived, so ``--phase NAME=REGEX`` splits the run into phases: phase NAME
starts at the first output line matching REGEX (in the order they occur) and lasts until the
next phase starts; the time before the first marked line is phase ``start``. The report gives
the peak of each phase and of the whole run.

Run::

    python -m tools.memsample [--interval 0.02] [--out samples.json] [--log run.log] \\
        [--phase 'init=Loading'] [--phase 'iteration=generate'] [--stop-at REGEX] \\
        -- COMMAND ARGS...

``--stop-at REGEX`` kills the process tree (SIGKILL) at the first output line matching REGEX
after every ``--phase`` has started (e.g. to measure an initialisation only); ``--log`` writes
the command's output there as it comes (stamped with seconds since the start).

It prints one JSON object (``peak_bytes``, ``peak_mb`` (10^6 bytes), ``peak_mib``,
``phases`` {name: {"start_s", "peak_bytes", "peak_mb"}}, ``samples``, ``interval_s``,
``seconds``, ``returncode``) on its last line, and with ``--out`` writes the same plus the
timeline (``[t_s, rss_bytes]`` pairs) and the stamped lines. RSS counts pages shared between
processes once per process (as ``ps`` and the issue's sampler do); a child's memory is
counted while it lives. Exit status: the command's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

MB, MIB = 10**6, 2**20


def tree_rss(pid: int) -> int:
    """RSS in bytes of ``pid`` and all its descendants (summed; processes that exit while
    being read count 0)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (children first read, then all killed)."""
    import signal

    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def sample(cmd: Sequence[str], *, interval: float = 0.02,
           phases: Sequence[tuple[str, str]] = (), echo: bool = True, stop_at: str = "",
           log: Any = None) -> dict[str, Any]:
    """Run ``cmd`` sampling its process tree's RSS every ``interval`` seconds; ``phases``:
    ``(name, regex)`` pairs, a phase starting at the first output line matching its regex;
    ``stop_at``: a regex whose first matching line (once every phase started) kills the tree;
    ``log``: a text file the stamped output goes to as it comes. Returns the report (see the
    module docstring) with ``timeline`` and ``lines`` (``stopped``: killed by ``stop_at``)."""
    t0 = time.monotonic()
    p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, errors="replace", bufsize=1)
    lines: list[tuple[float, str]] = []
    marks: list[tuple[str, float]] = [("start", 0.0)]
    pending = [(name, re.compile(rx)) for name, rx in phases]
    stop = re.compile(stop_at) if stop_at else None
    stopped = threading.Event()

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            now = time.monotonic() - t0
            lines.append((now, line.rstrip("\n")))
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if log is not None:
                log.write(f"{now:9.2f} {line}")
                log.flush()
            if pending and pending[0][1].search(line):
                marks.append((pending.pop(0)[0], now))
            elif not pending and stop is not None and stop.search(line) and not stopped.is_set():
                stopped.set()
                timeline.append((time.monotonic() - t0, tree_rss(p.pid)))
                kill_tree(p.pid)

    timeline: list[tuple[float, int]] = []
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while p.poll() is None:
        timeline.append((time.monotonic() - t0, tree_rss(p.pid)))
        time.sleep(interval)
    reader.join(timeout=10)
    if not reader.is_alive() and p.stdout is not None:
        p.stdout.close()  # the reader is done with it (an unclosed pipe warns in the caller)
    seconds = time.monotonic() - t0
    out: dict[str, Any] = {"returncode": p.returncode, "stopped": stopped.is_set(),
                           "interval_s": interval,
                           "seconds": round(seconds, 3), "samples": len(timeline)}
    peak = max((r for _, r in timeline), default=0)
    out.update(peak_bytes=peak, peak_mb=round(peak / MB, 1), peak_mib=round(peak / MIB, 1))
    out["phases"] = {}
    for i, (name, start) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else float("inf")
        ph = max((r for t, r in timeline if start <= t < end), default=0)
        out["phases"][name] = {"start_s": round(start, 3), "peak_bytes": ph,
                               "peak_mb": round(ph / MB, 1)}
    out["timeline"] = [(round(t, 3), r) for t, r in timeline]
    out["lines"] = [(round(t, 3), s) for t, s in lines]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    ap.add_argument("--out", default="", help="JSON file for the report with the timeline")
    ap.add_argument("--phase", action="append", default=[], metavar="NAME=REGEX",
                    help="a phase starting at the first output line matching REGEX")
    ap.add_argument("--quiet", action="store_true", help="do not echo the command's output")
    ap.add_argument("--log", default="", help="file for the command's stamped output")
    ap.add_argument("--stop-at", default="", metavar="REGEX",
                    help="kill the command at the first line matching REGEX (after the phases)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("cmd: expected a command after --, got none")
    if a.interval <= 0:
        ap.error(f"--interval: expected > 0 seconds, got {a.interval}")
    phases = []
    for spec in a.phase:
        name, sep, rx = spec.partition("=")
        if not sep or not name:
            ap.error(f"--phase: expected NAME=REGEX, got {spec!r}")
        phases.append((name, rx))
    with open(a.log or os.devnull, "w") as log:
        report = sample(cmd, interval=a.interval, phases=phases, echo=not a.quiet,
                        stop_at=a.stop_at, log=log if a.log else None)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f)
    print(json.dumps({k: v for k, v in report.items() if k not in ("timeline", "lines")}))
    return 0 if report["stopped"] else int(report["returncode"] or 0)


if __name__ == "__main__":
    sys.exit(main())
