"""Time the README's commands as a newcomer meets them: a fresh clone of this checkout's HEAD,
a fresh virtual environment, a cold pip cache and a cold model cache (``RLBUFFERS_CACHE``), then
quick-start command 1 (ERL) and the GRPO, guidance and CRSP commands in the README's order, in
one shell per command inside the clone (each later command reuses the venv, as a reader who
pastes them one after another does).

    python3 tools/time_readme.py [--out runs/readme_times] [--only erl grpo]

For each command: wall seconds, exit code, the longest silence between two output lines (a
progress bar's redraw counts as a line), the system's 1-minute load average at start and end
and its mean and maximum over the command (sampled every 5 s: the machine may be shared, so
say so beside the figures), and the transcript in ``OUT/NAME.log``.
Writes ``OUT/times.json`` and prints a table. Command 2 (the test suite) is what CI times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from check_output_gaps import gaps, timed_lines  # noqa: E402

#: which README command is which: a substring only that command's line holds
MARKERS = {
    "erl": "python3 -m trainers.erl",
    "grpo": "python3 -m trainers.grpo --run-dir runs/grpo",
    "guidance": "python3 -m trainers.guidance --run-dir runs/guidance",
    "crsp": "python3 -m trainers.crsp --run-dir runs/crsp ",
}


def readme_commands(readme: Path) -> dict[str, str]:
    """The one-line command of each ``MARKERS`` entry, from the README's ```bash blocks.

    Raises:
        LookupError: a marker matches no line, or more than one.
    """
    lines, blocks, inside = readme.read_text().splitlines(), [], False
    for line in lines:
        if line.strip().startswith("```"):
            inside = line.strip() == "```bash" and not inside
            continue
        if inside and line.strip():
            blocks.append(line.strip())
    out = {}
    for name, marker in MARKERS.items():
        hits = [b for b in blocks if marker in b and not b.startswith("torchrun")]
        if len(hits) != 1:
            raise LookupError(f"README: expected one command holding {marker!r}, "
                              f"found {len(hits)}")
        out[name] = hits[0]
    return out


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds, in a thread, until :meth:`stop`."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples = [os.getloadavg()[0]]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._done.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> tuple[float, float]:
        """(mean, max) of the samples, the last one taken now."""
        self._done.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        return sum(self.samples) / len(self.samples), max(self.samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "readme_times")
    ap.add_argument("--only", nargs="*", choices=list(MARKERS), default=list(MARKERS))
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commands = readme_commands(REPO / "README.md")
    work = Path(tempfile.mkdtemp(prefix="readme-times-"))
    clone, venv = work / "rlbuffers", work / "venv"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{os.environ['PATH']}",
           "PIP_CACHE_DIR": str(work / "pip-cache"), "RLBUFFERS_CACHE": str(work / "model-cache"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    rows = []
    for name in args.only:
        load0 = os.getloadavg()[0]
        sampler = LoadSampler()
        start = time.monotonic()
        code, lines = timed_lines(["bash", "-c", commands[name]], timeout_s=args.timeout_s,
                                  env=env, cwd=clone)
        wall = time.monotonic() - start
        load_mean, load_max = sampler.stop()
        tail = (wall - lines[-1][0], "(exit)") if lines else (wall, "(exit)")
        gap, after = max([*gaps(lines)[:1], tail])
        (args.out / f"{name}.log").write_text(
            "".join(f"[{t:7.1f}s] {line}\n" for t, line in lines))
        rows.append({"command": name, "exit_code": code, "wall_s": round(wall, 1),
                     "longest_silence_s": round(gap, 1), "silence_ended_by": after[:120],
                     "load_start": round(load0, 2), "load_end": round(os.getloadavg()[0], 2),
                     "load_mean": round(load_mean, 2), "load_max": round(load_max, 2),
                     "lines": len(lines)})
        print(f"{name:9s} exit {code}  {wall / 60:5.1f} min  longest silence {gap:5.1f} s  "
              f"load {load0:.1f} -> {os.getloadavg()[0]:.1f} (mean {load_mean:.1f}, "
              f"max {load_max:.1f})", flush=True)
    report = {"head": head, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "commands": {r["command"]: commands[r["command"]] for r in rows}, "rows": rows}
    (args.out / "times.json").write_text(json.dumps(report, indent=1))
    print(f"transcripts and times.json in {args.out}")
    return max((r["exit_code"] != 0 for r in rows), default=0)


if __name__ == "__main__":
    sys.exit(main())
