"""The ``rlbuffers`` command line.

- ``rlbuffers inspect PATH [--json] [--verify] [--commit N]``: describe a stored buffer.
- ``rlbuffers verify PATH [--repair]``: check (and rewrite) damaged chunks.
- ``rlbuffers shards ...``: write and list webdataset shards (:mod:`rlbuffers.stream`).
- ``rlbuffers convert ...``: migrate another library's saved replay buffer or dataset.
- ``rlbuffers export ...``: write a buffer as an offline dataset (Minari, Parquet).

Each command imports what it needs when it runs, so ``--help`` and ``inspect`` start without
torch or webdataset. Errors print ``rlbuffers: error: ...`` and exit 2 (``--debug``: the
traceback instead); ``inspect --verify`` exits 1 when it finds corrupt chunks.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from rlbuffers.errors import RLBuffersError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching (``allow_abbrev=False``): a shortened or misspelt
    flag is an error, never silently taken for another; subcommands' parsers inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    from rlbuffers import __version__

    parser = _Parser(prog="rlbuffers",
                                     description="Inspect, verify and convert replay buffers "
                                                 "stored on disk; write token shards.",
                                     epilog="Run 'rlbuffers COMMAND --help' for a command's "
                                            "options.")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the Python traceback")
    parser.add_argument("--version", action="version", version=f"rlbuffers {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    from rlbuffers.cli.convert import add_convert_parser
    from rlbuffers.cli.export import add_export_parser
    from rlbuffers.cli.inspect import add_inspect_parser
    from rlbuffers.cli.shards import add_shards_parser
    from rlbuffers.cli.verify import add_verify_parser

    add_inspect_parser(sub)
    add_shards_parser(sub)
    add_convert_parser(sub)
    add_export_parser(sub)
    add_verify_parser(sub)
    _debug_everywhere(sub)
    return parser


def _debug_everywhere(sub: Any) -> None:
    """Accept ``--debug`` after a command too (``rlbuffers inspect PATH --debug``)."""
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the Python traceback")
        for action in p._actions:  # nested commands: shards write, convert sb3
            if isinstance(action, argparse._SubParsersAction):
                _debug_everywhere(action)


def _where(args: argparse.Namespace) -> str:
    """`` (while working on PATH)``: the path the command works on, to name in an I/O error
    that names none; empty when the command has no path."""
    for key in ("path", "out", "dir", "pickle", "buffer", "dataset"):
        if getattr(args, key, None):
            return f" (while working on {getattr(args, key)})"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlbuffers`` console script; returns the exit code (0 done, 1
    corrupt chunks found, 2 error)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("rlbuffers: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure is one line (or a traceback with --debug)
        if args.debug:
            traceback.print_exc()
        elif isinstance(e, RLBuffersError):  # their messages name the buffer or the field
            print(f"rlbuffers: error: {e}", file=sys.stderr)
        elif isinstance(e, OSError):  # permission, disk full, network: not corruption
            where = "" if e.filename else _where(args)
            print(f"rlbuffers: error: I/O error: {e}{where}", file=sys.stderr)
        elif isinstance(e, (ValueError, TypeError, KeyError)):
            print(f"rlbuffers: error: {e}", file=sys.stderr)
        else:
            print(f"rlbuffers: error: {type(e).__name__}: {e} (--debug shows where)",
                  file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
