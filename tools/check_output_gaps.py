"""Run a trainer and fail when its output goes silent: two consecutive output lines (stdout and
stderr together; a progress bar's redraw, ended by a carriage return, counts as a line) more
than ``--max-gap`` seconds apart.

    python tools/check_output_gaps.py                     # a tiny GRPO run (tests/tiny_lm.py)
    python tools/check_output_gaps.py --max-gap 10 -- python -m trainers.grpo --steps 2 ...

Prints the longest gaps with the line that ended each; exit code 1 when one is over the limit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_lines(cmd: list[str], timeout_s: float = 600.0, env: dict[str, str] | None = None,
                cwd: Path = REPO) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd`` (stderr merged into stdout) and return its exit code and its output lines,
    each with the seconds since the start when it was read (``\\r`` and ``\\n`` end a line).
    ``env``: the whole environment (default: this one, with this checkout on PYTHONPATH).

    Raises:
        subprocess.TimeoutExpired: the command ran longer than ``timeout_s``.
    """
    t0 = time.perf_counter()
    if env is None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=cwd)
    assert proc.stdout is not None
    lines: list[tuple[float, str]] = []
    part = b""
    with proc, proc.stdout:
        while True:
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                raise subprocess.TimeoutExpired(cmd, timeout_s)
            byte = proc.stdout.read(1)
            if not byte:
                break
            if byte in (b"\n", b"\r"):
                if part.strip():
                    lines.append((time.perf_counter() - t0, part.decode(errors="replace")))
                part = b""
            else:
                part += byte
        if part.strip():
            lines.append((time.perf_counter() - t0, part.decode(errors="replace")))
        return proc.wait(), lines


def gaps(lines: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """``(seconds of silence before the line, line)`` for each line, the first measured from
    the start, longest first."""
    out, last = [], 0.0
    for t, line in lines:
        out.append((t - last, line))
        last = t
    return sorted(out, key=lambda g: -g[0])


def tiny_grpo_command(run_dir: Path) -> list[str]:
    """A 2-step GRPO run of the tiny random model (``tests/tiny_lm.py``) in ``run_dir``."""
    sys.path.insert(0, str(REPO))
    from tests.tiny_lm import make_tiny_lm_dir

    model = make_tiny_lm_dir(run_dir.parent / "tiny-lm")
    return [sys.executable, "-m", "trainers.grpo", "--model", str(model), "--run-dir",
            str(run_dir), "--task", "basic_arithmetic", "--train-size", "40",
            "--prompts-per-step", "2", "--group-size", "3", "--max-completion-tokens", "12",
            "--max-prompt-tokens", "120", "--pack-tokens", "200", "--memory-budget", "none",
            "--train-threads", "1", "--steps", "2", "--eval-size", "4", "--device", "cpu"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-gap", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--show", type=int, default=5, help="longest gaps printed (default 5)")
    p.add_argument("cmd", nargs="*", help="the command (default: a tiny GRPO run)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = args.cmd or tiny_grpo_command(Path(tmp) / "run")
        rc, lines = timed_lines(cmd)
    worst = gaps(lines)
    for gap, line in worst[:args.show]:
        print(f"{gap:6.1f} s before: {line[:120]}")
    if rc != 0:
        print(f"the command failed (exit code {rc})")
        return 1
    over = [g for g in worst if g[0] > args.max_gap]
    if over:
        print(f"{len(over)} gap(s) over {args.max_gap} s")
        return 1
    print(f"{len(lines)} lines, no gap over {args.max_gap} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
