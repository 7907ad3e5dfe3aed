"""Print one of the README's quick-start commands, so CI and tools/check_install.sh run exactly
what a new user copies.

    python3 tools/readme_command.py 1   # set up and run the main job
    python3 tools/readme_command.py 2   # set up and run the tests
    python3 tools/readme_command.py 2 --installs   # only its `pip install` steps, one per line

A quick-start command is the first ```bash block after a README line that starts with
"**N." (N = 1, 2). Exits with 2 and a message naming N when the README has no such block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_command(n: int, readme: Path = README) -> str:
    """The README's quick-start command number `n` (one line, as a user would paste it)."""
    lines = readme.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"**{n}.")), None)
    if start is None:
        raise LookupError(f"README has no quick-start step '**{n}.'")
    try:
        fence = next(i for i in range(start, len(lines)) if lines[i].strip() == "```bash")
        end = next(i for i in range(fence + 1, len(lines)) if lines[i].strip() == "```")
    except StopIteration:
        raise LookupError(f"README step {n} has no ```bash block") from None
    command = " ".join(line.strip() for line in lines[fence + 1:end] if line.strip())
    if not command:
        raise LookupError(f"README step {n} has an empty ```bash block")
    return command


def install_steps(command: str) -> list[str]:
    """The `python3 -m pip install ...` steps of a `&&`-chained command, in order."""
    return [part.strip() for part in command.split("&&")
            if part.strip().startswith("python3 -m pip install")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, help="README command number (1, 2 or 3)")
    parser.add_argument("--installs", action="store_true", help="print only the pip installs")
    args = parser.parse_args(argv)
    try:
        command = quick_start_command(args.n)
    except LookupError as e:
        print(f"readme_command: {e}", file=sys.stderr)
        return 2
    print("\n".join(install_steps(command)) if args.installs else command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
