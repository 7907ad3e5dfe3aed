"""``rlbuffers inspect PATH [--json] [--verify] [--commit N]``: describe a stored buffer's last
commit (or a kept older one): fields, sizes, compression, NaN/inf counts, sampler, reward
statistics. Reads one commit (a snapshot), so it is safe while a writer runs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from rlbuffers.cli.options import json_option

__all__ = ["add_inspect_parser", "render"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _stats(s: dict[str, Any] | None) -> str:
    if not s:
        return "none"
    if not s["count"]:
        return "no finite values (n=0)"
    return (
        f"mean {s['mean']:.4g}  std {s['std']:.4g}  min {s['min']:.4g}  "
        f"max {s['max']:.4g}  (n={s['count']})"
    )


def _nonfinite(s: dict[str, Any] | None) -> str:
    if not s or not (s.get("nan") or s.get("inf")):
        return ""
    return f"  non-finite: {s['nan']:,} NaN, {s['inf']:,} inf"


def _columns(rows: list[list[str]], right: set[int]) -> list[str]:
    """Rows of cells as lines whose columns never run together: each column as wide as its
    widest cell, two spaces between columns, numbers (``right``) aligned right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]


def render(r: dict[str, Any]) -> str:
    """Human-readable text of an :func:`~rlbuffers.maintenance.inspection.inspect_path` report."""
    lines = [
        f"buffer      {r['path']}",
        f"size        {r['size']:,} / {r['capacity']:,} transitions "
        f"({r['total_added']:,} added, {r['episodes']:,} episodes ended)",
        f"commit      {r['commit']} at {r['committed_at']}",
        f"chunks      {min(r['chunk_transitions'], r['capacity']):,} transitions per base "
        f"chunk; stored {_size(r['stored_bytes'])}",
        "",
    ]
    table = [["field", "shape", "dtype", "codec", "stored", "raw", "ratio", "chunk", "NaN",
              "inf"]]
    for name, f in r["fields"].items():
        nan, inf = f.get("nan"), f.get("inf")
        shape = str(tuple(f["shape"]))
        if "stored_shape" in f:  # a frame stack stored one frame per transition
            shape += f" stack_axis={f['stack_axis']}, stores {tuple(f['stored_shape'])}"
            shape += "".join(f", {n} = next" for n in f["next_of"])
        table.append([name, shape, f["dtype"], f["codec"],
                      _size(f["stored_bytes"]), _size(f["raw_bytes"]),
                      f"{f['ratio']:.2f}x" if f["ratio"] else "-",
                      f"{min(f['chunk_transitions'], r['capacity']):,}",
                      "-" if nan is None else f"{nan:,}", "-" if inf is None else f"{inf:,}"])
    lines += _columns(table, right={4, 5, 6, 7, 8, 9})
    sampler = {k: v for k, v in r["sampler"].items() if k != "priorities"}
    lines += ["", "sampler     " + ", ".join(f"{k}={v}" for k, v in sampler.items())]
    if "priorities" in r["sampler"]:
        lines.append("priorities  " + _stats(r["sampler"]["priorities"]))
    if "reward" in r:
        lines.append("reward      " + _stats(r["reward"]) + _nonfinite(r["reward"]))
    if r["metadata"]:  # one line per key, long values summarised (--json shows them whole)
        from rlbuffers.maintenance.inspection import brief

        meta = _strict(r["metadata"])
        lines += [("metadata    " if i == 0 else " " * 12) + f"{json.dumps(str(k))}: {brief(v)}"
                  for i, (k, v) in enumerate(sorted(meta.items()))]
    if "corrupt" in r:
        if r["corrupt"]:
            lines.append(f"verify      {len(r['corrupt'])} corrupt chunk(s):")
            lines += [
                f"  field {c['field']!r} chunk {c['chunk']}: {c['reason']}" for c in r["corrupt"]
            ]
        else:
            lines.append("verify      all chunk checksums OK")
    return "\n".join(lines)


def _strict(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (strict JSON has no NaN/Infinity;
    the reports count them separately)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def _inspect(args: argparse.Namespace) -> int:
    from rlbuffers.maintenance.inspection import inspect_path

    options = json_option(args.storage_options, "--storage-options")
    commit = args.commit
    if args.generation is not None:
        print("rlbuffers: warning: --generation is deprecated and will be removed in the next "
              "release; use --commit", file=sys.stderr)
        if commit is not None:
            raise ValueError("--commit: given twice, as --commit and as the deprecated "
                             "--generation; give --commit only")
        commit = args.generation
    report = inspect_path(args.path, verify=args.verify, storage_options=options,
                          commit=commit)
    if args.json:
        print(json.dumps(_strict(report), indent=1, allow_nan=False))
    else:
        print(render(report))
    return 1 if report.get("corrupt") else 0


def add_inspect_parser(sub: Any) -> None:
    """Add the ``inspect`` command to the ``rlbuffers`` subparsers ``sub``."""
    p = sub.add_parser("inspect", help="describe a stored replay buffer",
                       description="Describe the buffer's last commit (or a kept older one): "
                       "fields, sizes, compression, NaN/inf counts, sampler, reward "
                       "statistics. Reads one commit, so it is safe while a writer runs.")
    p.add_argument("path", help="buffer directory or URL (s3://bucket/buffer, ...)")
    p.add_argument("--storage-options", metavar="JSON", default=None,
                   help='fsspec options for a URL, e.g. \'{"endpoint_url": "http://..."}\' '
                        "(credentials may also come from the usual environment variables)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON, every metadata value whole (the text "
                        "report summarises long ones)")
    p.add_argument("--commit", type=int, default=None, metavar="N",
                   help="report the kept older commit number N instead of the last")
    p.add_argument("--generation", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every chunk's crc32c; exit 1 and list corrupt chunks if any",
    )
    p.set_defaults(func=_inspect)
