"""The ``rlbuffers`` command line.

- ``rlbuffers inspect PATH [--json] [--verify]``: describe a stored replay buffer.
- ``rlbuffers shards ...``: write and list webdataset shards (:mod:`rlbuffers.stream`).
- ``rlbuffers convert ...``: migrate another library's saved replay buffer.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rlbuffers.errors import RLBuffersError
from rlbuffers.inspection import inspect_path


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _stats(s: dict[str, float] | None) -> str:
    if not s:
        return "none"
    return (
        f"mean {s['mean']:.4g}  std {s['std']:.4g}  min {s['min']:.4g}  "
        f"max {s['max']:.4g}  (n={s['count']})"
    )


def render(r: dict[str, Any]) -> str:
    """Human-readable text of an :func:`~rlbuffers.inspect.inspect_path` report."""
    lines = [
        f"buffer      {r['path']}",
        f"size        {r['size']:,} / {r['capacity']:,} transitions "
        f"({r['total_added']:,} added, {r['episodes']:,} episodes ended)",
        f"last commit generation {r['generation']} at {r['committed_at']}",
        f"chunks      {r['chunk_transitions']:,} transitions per base chunk; "
        f"stored {_size(r['stored_bytes'])}",
        "",
        f"{'field':<16}{'shape':<18}{'dtype':<9}{'codec':<12}{'stored':>11}{'raw':>11}{'ratio':>8}"
        f"{'chunk':>9}",
    ]
    for name, f in r["fields"].items():
        shape = str(tuple(f["shape"]))
        ratio = f"{f['ratio']:.2f}x" if f["ratio"] else "-"
        lines.append(
            f"{name:<16}{shape:<18}{f['dtype']:<9}{f['codec']:<12}"
            f"{_size(f['stored_bytes']):>11}{_size(f['raw_bytes']):>11}{ratio:>8}"
            f"{f['chunk_transitions']:>9,}"
        )
    sampler = {k: v for k, v in r["sampler"].items() if k != "priorities"}
    lines += ["", "sampler     " + ", ".join(f"{k}={v}" for k, v in sampler.items())]
    if "priorities" in r["sampler"]:
        lines.append("priorities  " + _stats(r["sampler"]["priorities"]))
    if "reward" in r:
        lines.append("reward      " + _stats(r["reward"]))
    if r["metadata"]:
        lines.append("metadata    " + json.dumps(r["metadata"], sort_keys=True))
    if "corrupt" in r:
        if r["corrupt"]:
            lines.append(f"verify      {len(r['corrupt'])} corrupt chunk(s):")
            lines += [
                f"  field {c['field']!r} chunk {c['chunk']}: {c['reason']}" for c in r["corrupt"]
            ]
        else:
            lines.append("verify      all chunk checksums OK")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    options = json.loads(args.storage_options) if args.storage_options else None
    report = inspect_path(args.path, verify=args.verify, storage_options=options,
                          generation=args.generation)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 1 if report.get("corrupt") else 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="rlbuffers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a stored replay buffer")
    p.add_argument("path", help="buffer directory or URL (s3://bucket/buffer, ...)")
    p.add_argument("--storage-options", metavar="JSON", default=None,
                   help='fsspec options for a URL, e.g. \'{"endpoint_url": "http://..."}\' '
                        "(credentials may also come from the usual environment variables)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--generation", type=int, default=None,
                   help="report a kept older commit instead of the last")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every chunk's crc32c; exit 1 and list corrupt chunks if any",
    )
    p.set_defaults(func=_inspect)
    from rlbuffers.convert_cli import add_convert_parser
    from rlbuffers.stream.cli import add_shards_parser
    from rlbuffers.verify_cli import add_verify_parser

    add_shards_parser(sub)
    add_convert_parser(sub)
    add_verify_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlbuffers`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RLBuffersError as e:
        print(f"rlbuffers: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # permission, network, disk: not corruption (that is exit code 1)
        print(f"rlbuffers: I/O error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
