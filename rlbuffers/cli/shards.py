"""``rlbuffers shards ...``: write webdataset shards from files, and list them.

``add_shards_parser(subparsers)`` registers the ``shards`` command on an argparse parser;
``python -m rlbuffers.cli.shards shards ...`` runs it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence


def _parse_bytes(text: str) -> int:
    """``"64MiB"``, ``"1GB"``, ``"1048576"`` -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    t = text.strip().lower()
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], mult
            break
    else:
        scale = 1
    try:
        return int(float(t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 268435456 or 256MiB, got {text!r}") from None


def _records_per_sample(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1, got {text!r}") from None


def _write(args: argparse.Namespace) -> int:
    from rlbuffers.stream.errors import ShardError
    from rlbuffers.stream.shards import read_manifest, write_shards

    try:
        paths = write_shards(args.out, files=args.inputs, max_shard_bytes=args.max_shard_bytes,
                             max_shard_samples=args.max_shard_samples,
                             records_per_sample=args.records_per_sample, prefix=args.prefix,
                             progress=not args.no_progress)
    except (ShardError, ValueError, OSError) as exn:
        print(f"rlbuffers: error: {exn}", file=sys.stderr)
        return 2
    manifest = read_manifest(args.out)
    print(f"wrote {manifest['samples']} samples into {len(paths)} shards in {args.out}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    from rlbuffers.stream.errors import ShardError
    from rlbuffers.stream.shards import read_manifest

    try:
        manifest = read_manifest(args.dir)
    except ShardError as exn:
        print(f"rlbuffers: error: {exn}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=1))
    else:
        for shard in manifest["shards"]:
            print(f"{shard['name']}\t{shard['samples']}")
        print(f"total\t{manifest['samples']}")
    return 0


def add_shards_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``shards write`` and ``shards ls`` on ``subparsers`` (from
    ``parser.add_subparsers()``); each sets ``func(args) -> int`` (the exit code)."""
    shards = subparsers.add_parser(
        "shards", help="write and list webdataset tar shards",
        description="Write text or JSON-lines files as webdataset tar shards for the "
        "streaming token pipeline (rlbuffers.stream), and list them.")
    sub = shards.add_subparsers(dest="shards_command", required=True, metavar="COMMAND",
                                title="commands")
    w = sub.add_parser("write", help="write .jsonl / .txt files as tar shards")
    w.add_argument("inputs", nargs="+", help=".jsonl/.ndjson (one sample per line) or "
                   ".txt/.md files (one sample per file)")
    w.add_argument("--out", required=True, metavar="DIR", help="output directory")
    w.add_argument("--max-shard-bytes", type=_parse_bytes, default=256 * 2**20,
                   metavar="SIZE",
                   help="largest shard file in bytes, e.g. 256MiB (default)")
    w.add_argument("--max-shard-samples", type=int, default=2**31, metavar="N",
                   help="most samples per shard")
    w.add_argument("--records-per-sample", type=_records_per_sample, default="auto",
                   metavar="N|auto",
                   help="records stored together in one jsonl tar member (faster reading of "
                        "short records); 1: one tar sample per record; auto (default): short "
                        "records grouped into ~16 KiB members, long ones alone")
    w.add_argument("--prefix", default="shard", metavar="NAME", help="shard file name prefix")
    w.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    w.set_defaults(func=_write)
    ls = sub.add_parser("ls", help="list the shards of a directory and their sample counts")
    ls.add_argument("dir", help="directory written by 'rlbuffers shards write'")
    ls.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ls.set_defaults(func=_ls)
    return shards


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m rlbuffers.cli.shards shards ...``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="rlbuffers")
    add_shards_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
