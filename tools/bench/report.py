"""Shared helpers for benchmark scripts: machine description, medians, and
writing one named section of ``docs/benchmarks.md`` without touching the others.

Each script owns one section, delimited by ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``; re-running a script replaces only its own section.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

BENCH_MD = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
_HEADER = (
    "# Benchmarks\n\n"
    "Written by the scripts in `tools/bench/`; each section is replaced when its script runs.\n"
    "Times are medians over repeated runs; ratios compare systems run side by side in the\n"
    "same process on the same data. The machine is shared and noisy: read ratios, not\n"
    "single times.\n"
)


def machine() -> str:
    """One line naming this machine: CPU model, cores, RAM, OS and Python."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram_gib = psutil.virtual_memory().total / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {ram_gib:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )


def stamp() -> str:
    """Machine line plus today's date, for the top of a section."""
    return f"Machine: {machine()}. Date: {_dt.date.today().isoformat()}."


@dataclass
class ChildRun:
    """What :func:`run_sampled` saw of a child process."""

    returncode: int | None  # None: stopped over the limit
    stdout: str
    stderr: str
    peak_rss_bytes: int  # the largest RSS sample


def run_sampled(cmd: Sequence[str], env: dict[str, str], *, interval_s: float = 0.05,
                limit_bytes: int | None = None) -> ChildRun:
    """Run ``cmd`` with its RSS sampled every ``interval_s`` by this process (the same way
    for every program measured); killed as soon as a sample passes ``limit_bytes``."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(list(cmd), stdout=out, stderr=err, text=True, env=env)
        proc, peak, stopped = psutil.Process(p.pid), 0, False
        while p.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if limit_bytes is not None and peak > limit_bytes:
                p.kill()
                stopped = True
                break
            time.sleep(interval_s)
        code = p.wait()
        out.seek(0), err.seek(0)
        return ChildRun(None if stopped else code, out.read(), err.read(), peak)


def median_of(fn: Callable[[], float], runs: int = 3) -> float:
    """Median of ``runs`` calls of ``fn`` (each returns one measurement)."""
    return statistics.median(fn() for _ in range(runs))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def read_section(name: str, path: Path = BENCH_MD) -> str:
    """The body of section ``name`` of ``docs/benchmarks.md`` ("" when it has none)."""
    text = path.read_text() if path.exists() else ""
    found = re.search(rf"<!-- bench:{re.escape(name)} -->(.*?)<!-- /bench:{re.escape(name)} -->",
                      text, re.S)
    return found.group(1) if found else ""


def write_section(name: str, body: str, path: Path = BENCH_MD) -> None:
    """Replace (or append) the section ``name`` of ``docs/benchmarks.md`` with ``body``."""
    text = path.read_text() if path.exists() else _HEADER
    block = f"<!-- bench:{name} -->\n{body.strip()}\n<!-- /bench:{name} -->"
    pattern = re.compile(
        rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
