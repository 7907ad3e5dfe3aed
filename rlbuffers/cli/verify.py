"""``rlbuffers verify PATH [--repair] [--working-dir DIR] [--json]``: check every chunk of the
last commit (checksum, presence, size); with ``--repair``, rewrite damaged chunks from the
writer's working tier where it still holds their rows (see :mod:`rlbuffers.maintenance.repair`).

It also lists, one line each, what ``readers/`` holds that is not a reader's lease (a FIFO, a
directory, a symlink, a socket, a lease file whose JSON names no commit): the writer ignores
those; ``--repair`` removes them.

Exit codes: 0 nothing damaged (or everything repaired), 1 damaged chunks remain (entries in
``readers/`` that are not leases do not change the exit code).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rlbuffers.cli.options import json_option


def add_verify_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``verify`` on an argparse subparsers object (sets ``func``)."""
    p = subparsers.add_parser(
        "verify", help="check every committed chunk; --repair rewrites damaged ones",
        description="Check every chunk of the last commit (crc32c checksum, presence, size). "
        "With --repair, damaged chunks are rewritten, as a new commit, from the writer's "
        "working tier where it still holds their rows; do not run it while a writer has the "
        "buffer open. Entries of PATH/readers/ that are not readers' leases (FIFOs, "
        "directories, symlinks, leases naming no commit) are listed; --repair removes them.")
    p.add_argument("path", help="buffer directory or URL")
    p.add_argument("--repair", action="store_true", help="rewrite damaged chunks if possible")
    p.add_argument("--working-dir", default=None, metavar="DIR", help="the writer's working tier "
                   "(default: PATH/.working, or the cache directory for a URL)")
    p.add_argument("--storage-options", metavar="JSON", default=None,
                   help="fsspec options for a URL")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_verify)
    return p


def _verify(args: argparse.Namespace) -> int:
    options = json_option(args.storage_options, "--storage-options")
    if args.repair:
        from rlbuffers.maintenance.repair import repair

        report = repair(args.path, working_dir=args.working_dir, storage_options=options)
    else:
        from rlbuffers.core.opening import open_checked
        from rlbuffers.storage.lease import foreign_entries
        from rlbuffers.storage.location import make_location

        loc = make_location(args.path, options)
        tier = open_checked(loc)
        report = {"commit": tier.manifest.commit, "repaired": [],
                  "unrepairable": [{"field": f, "chunk": c, "reason": r, "why": "not asked"}
                                   for f, c, r in tier.verify()],
                  "foreign": [{"path": p, "what": w} for p, w in foreign_entries(loc)]}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report["repaired"]:
            print(f"repaired  field {r['field']!r} chunk {r['chunk']} ({r['reason']})")
        for r in report.get("foreign", []):
            print(f"not a lease {args.path}/{r['path']}: {r['what']} (ignored by the "
                  "writer; verify --repair removes it)")
        for r in report.get("removed", []):
            print(f"removed   {args.path}/{r['path']}: {r['what']}")
        for r in report["unrepairable"]:
            print(f"damaged   field {r['field']!r} chunk {r['chunk']}: {r['reason']}"
                  + (f"; not repaired: {r['why']}" if args.repair else ""))
        if not report["unrepairable"]:
            print(f"commit {report['commit']}: every chunk OK")
    return 1 if report["unrepairable"] else 0
