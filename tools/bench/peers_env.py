"""Create the virtual environment that ``tools/bench/bench_peers.py`` runs in.

The peers (Stable-Baselines3, TorchRL, cpprb) are benchmark-only dependencies, so they go into
their own venv (default ``.cache/peers-venv``, git-ignored), never into the system
site-packages. ``torch==2.13.0`` is installed first and pinned by a constraints file on every
later install, and every install is dry-run first: if the resolver would pull any other torch
the script stops before installing anything.

Run: ``python3 tools/bench/peers_env.py [--venv DIR] [--recreate]``, then
``DIR/bin/python -m tools.bench.bench_peers``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
#: Installed with the constraints file, in this order (rlbuffers itself as editable).
PEERS = [
    "stable-baselines3",
    "torchrl",
    "cpprb",
    "gymnasium",
    "ale-py",
    "opencv-python-headless",  # gymnasium AtariPreprocessing
    "psutil",
]


def run(cmd: list[str]) -> str:
    """Run ``cmd``; echo it, return its stdout, exit on failure with its output."""
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p.stdout


def check_dry_run(py: str, constraints: Path, reqs: list[str]) -> None:
    """Dry-run the install of ``reqs``; exit if it would install any torch."""
    out = run([py, "-m", "pip", "install", "--dry-run", "-c", str(constraints), *reqs])
    would = next((ln for ln in out.splitlines() if ln.startswith("Would install")), "")
    print(would or "nothing new to install", flush=True)
    bad = re.findall(r"\b(torch-[^\s]+|torchvision-[^\s]+|nvidia-[^\s]+)", would)
    if bad:
        sys.exit(f"refusing: installing {reqs} would pull {bad}; torch must stay {TORCH}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--venv", default=str(ROOT / ".cache" / "peers-venv"))
    ap.add_argument("--recreate", action="store_true", help="delete the venv first")
    args = ap.parse_args()
    env = Path(args.venv)
    if args.recreate and env.exists():
        shutil.rmtree(env)
    if not (env / "bin" / "python").exists():
        print(f"creating {env}", flush=True)
        venv.EnvBuilder(with_pip=True).create(env)
    py = str(env / "bin" / "python")
    constraints = env / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    run([py, "-m", "pip", "install", TORCH])
    reqs = ["-e", str(ROOT), *PEERS]
    check_dry_run(py, constraints, reqs)
    run([py, "-m", "pip", "install", "-c", str(constraints), *reqs])
    out = run([py, "-c", "import torch, torchrl, tensordict, stable_baselines3, cpprb, ale_py, "
               "rlbuffers; print(torch.__version__, torchrl.__version__, tensordict.__version__, "
               "stable_baselines3.__version__, cpprb.__version__ if hasattr(cpprb, "
               "'__version__') else '?', ale_py.__version__)"])
    print("versions (torch torchrl tensordict sb3 cpprb ale-py):", out.strip())
    if not out.startswith("2.13.0"):
        sys.exit(f"torch in the venv is not {TORCH}: {out}")
    print(f"ready: {py} -m tools.bench.bench_peers")


if __name__ == "__main__":
    main()
