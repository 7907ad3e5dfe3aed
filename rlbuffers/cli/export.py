"""``rlbuffers export``: a stored buffer as an offline dataset, streamed episode by episode.

``rlbuffers export minari BUFFER DATASET_ID [--env ID] [--data-format F] [--overwrite]
[--keep-partial-first] [--cache-mb N] [--author A] [--algorithm-name N] [--description D]
[--quiet]`` writes a local Minari dataset (:func:`rlbuffers.integrations.minari.to_minari`);
``rlbuffers export parquet BUFFER OUT [--file-mb N] [--overwrite] [--keep-partial-first]
[--cache-mb N] [--quiet]`` Parquet files + ``meta/info.json``
(:func:`rlbuffers.integrations.parquet.to_parquet`). Both read the buffer's last commit
(a read-only snapshot: safe while a writer runs) with a decoded-chunk cache sized for one
ordered read (``--cache-mb`` sets it).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rlbuffers.cli.convert import progress_bar


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``export`` (``minari``, ``parquet``) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "export", help="write a buffer as an offline dataset (minari, parquet)",
        description="Write a stored buffer's last commit as an offline dataset.")
    formats = p.add_subparsers(dest="format", required=True, metavar="FORMAT", title="formats")
    m = formats.add_parser(
        "minari", help="a local Minari dataset that minari.load_dataset reads",
        description="Write the buffer's episodes as a new local Minari dataset (under "
        "MINARI_DATASETS_PATH, default ~/.minari/datasets). Fields: obs, next_obs, action, "
        "reward, terminated (or done), truncated. Episodes end where the buffer's do (end "
        "flags and end_episode()). A wrapped ring's partial first episode is dropped; an "
        "unfinished last episode is written truncated.")
    m.add_argument("buffer", help="the buffer's directory")
    m.add_argument("dataset_id", help="(namespace/)name-v<version>, e.g. rlbuffers/pendulum-v0")
    m.add_argument("--env", default=None, metavar="ID",
                   help="gymnasium env id whose spaces and spec describe the data (default: "
                   "those the buffer recorded, else inferred from the fields)")
    m.add_argument("--data-format", default="hdf5", choices=("hdf5", "arrow", "parquet"),
                   help="Minari's storage format (default hdf5)")
    for flag in ("author", "algorithm-name", "description", "author-email", "code-permalink"):
        m.add_argument(f"--{flag}", default=None, metavar="TEXT",
                       help=f"dataset metadata: {flag.replace('-', ' ')}")
    q = formats.add_parser(
        "parquet", help="Parquet files + meta/info.json (datasets.load_dataset reads them)",
        description="Write the buffer as Parquet files of at most ~--file-mb MB (raw) under "
        "OUT/data/chunk-NNN/ plus OUT/meta/info.json (fields, shapes, dtypes, episode "
        "offsets), the tabular layout LeRobot v3 uses.")
    q.add_argument("buffer", help="the buffer's directory")
    q.add_argument("out", help="directory of the export")
    q.add_argument("--file-mb", type=int, default=100, metavar="N",
                   help="most raw MiB per Parquet file (default 100)")
    for sp, func in ((m, _export_minari), (q, _export_parquet)):
        sp.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export of that name")
        sp.add_argument("--keep-partial-first", action="store_true",
                        help="also write a wrapped ring's partial oldest episode")
        sp.add_argument("--cache-mb", type=int, default=None, metavar="N",
                        help="MiB of decoded chunks the reader keeps (default: what one "
                        "ordered read needs, at most 256)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.set_defaults(func=func)
    return p


def _cache_bytes(args: argparse.Namespace) -> int | None:
    if args.cache_mb is None:
        return None
    if args.cache_mb < 0:
        raise ValueError(f"--cache-mb: expected an integer >= 0, got {args.cache_mb}")
    return int(args.cache_mb) * 2**20


def _export_minari(args: argparse.Namespace) -> int:
    from rlbuffers.integrations.minari import to_minari

    meta = {k: getattr(args, k) for k in ("author", "algorithm_name", "description",
                                          "author_email", "code_permalink")
            if getattr(args, k) is not None}
    cache = _cache_bytes(args)
    progress, close = progress_bar(args.quiet, " steps")
    t0 = time.perf_counter()
    try:
        r = to_minari(args.buffer, args.dataset_id, env=args.env, data_format=args.data_format,
                      overwrite=args.overwrite, metadata=meta or None,
                      drop_partial_first=not args.keep_partial_first, cache_bytes=cache,
                      progress=progress)
    finally:
        close()
    notes = []
    if r.dropped_rows:
        notes.append(f"dropped the wrapped ring's partial first episode ({r.dropped_rows:,} "
                     "rows)")
    if r.unfinished:
        notes.append("the unfinished last episode was written truncated")
    print(f"exported {r.steps:,} steps ({r.episodes:,} episodes) of {args.buffer} as Minari "
          f"dataset {r.dataset_id} ({r.path}) in {time.perf_counter() - t0:.1f} s"
          + "".join(f"\n{n}" for n in notes))
    return 0


def _export_parquet(args: argparse.Namespace) -> int:
    from rlbuffers.integrations.parquet import to_parquet

    if args.file_mb < 1:
        raise ValueError(f"--file-mb: expected an integer >= 1, got {args.file_mb}")
    cache = _cache_bytes(args)
    progress, close = progress_bar(args.quiet, " rows")
    t0 = time.perf_counter()
    try:
        info = to_parquet(args.buffer, args.out, file_bytes=args.file_mb * 2**20,
                          overwrite=args.overwrite,
                          drop_partial_first=not args.keep_partial_first, cache_bytes=cache,
                          progress=progress)
    finally:
        close()
    dropped = info["source"]["dropped_rows"]
    print(f"exported {info['total_frames']:,} rows ({info['total_episodes']:,} episodes) of "
          f"{args.buffer} into {len(info['files'])} Parquet file(s) under {args.out} in "
          f"{time.perf_counter() - t0:.1f} s"
          + (f"\ndropped the wrapped ring's partial first episode ({dropped:,} rows)"
             if dropped else ""))
    return 0
