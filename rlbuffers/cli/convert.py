"""``rlbuffers convert``: migrate another library's saved replay buffer into rlbuffers.

``rlbuffers convert sb3 PICKLE OUT [--capacity N] [--chunk-transitions N] [--codec C]
[--seed S] [--overwrite] [--memory-budget SIZE] [--frame-stack-axis AXIS] [--quiet]``
converts the pickle that Stable-Baselines3's ``model.save_replay_buffer`` wrote (see
:mod:`rlbuffers.integrations.sb3.convert`).

``rlbuffers convert minari DATASET OUT [...]`` converts a local Minari dataset (an id or a
directory; :func:`rlbuffers.integrations.minari.from_minari`), and ``rlbuffers convert parquet
DIR OUT [...]`` a Parquet export (:func:`rlbuffers.integrations.parquet.from_parquet`); both
stream, so memory stays bounded.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _parse_bytes(text: str) -> int:
    from rlbuffers.cli.shards import _parse_bytes as parse

    return parse(text)


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``convert`` (with its source subcommands) on an argparse subparsers object.

    Each source subcommand sets ``func``: called with the parsed namespace, it returns the
    exit code (0 done); errors propagate to :func:`rlbuffers.cli.main`, which prints them.
    """
    p = subparsers.add_parser(
        "convert", help="convert another library's saved replay buffer or dataset (sb3, "
        "minari, parquet)",
        description="Convert another library's saved replay buffer into an rlbuffers buffer.")
    sources = p.add_subparsers(dest="source", required=True, metavar="SOURCE",
                               title="sources")
    s = sources.add_parser(
        "sb3",
        help="a Stable-Baselines3 save_replay_buffer pickle (ReplayBuffer / DictReplayBuffer)",
        description="Convert a Stable-Baselines3 replay-buffer pickle. Large arrays are "
        "memory-mapped from the pickle and copied in batches, so RAM stays bounded. "
        "Stable-Baselines3 need not be installed.",
    )
    s.add_argument("pickle", help="the file model.save_replay_buffer() wrote (.pkl, or gzipped)")
    s.add_argument("out", help="directory of the new rlbuffers buffer")
    s.add_argument("--capacity", type=int, default=None, metavar="N",
                   help="ring size in transitions (default: SB3's buffer_size)")
    s.add_argument("--chunk-transitions", type=int, default=None, metavar="N",
                   help="transitions per stored chunk (default: ~4 MiB raw per chunk)")
    s.add_argument("--codec", default=None, metavar="NAME",
                   help="blosc-zstd (default), blosc-lz4, zstd or none")
    s.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed of the new buffer's RNG")
    s.add_argument("--overwrite", action="store_true",
                   help="replace an existing rlbuffers buffer at OUT (only a buffer or an empty "
                   "directory; replaced once the new one is complete)")
    s.add_argument("--memory-budget", type=_parse_bytes, default=None, metavar="SIZE",
                   help="most memory the pickle may make the load hold, e.g. 4GiB "
                   "(default 16GiB; memory-mapped arrays do not count)")
    s.add_argument("--frame-stack-axis", type=int, default=None, metavar="AXIS",
                   help="the observations are stacks of frames along this axis of their "
                   "shape (VecFrameStack: 0 for (4, 84, 84), -1 for (84, 84, 4)): store one "
                   "frame per transition, next_obs derived")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_convert_sb3)
    m = sources.add_parser(
        "minari", help="a local Minari dataset (an id or its directory), episode by episode",
        description="Convert a local Minari dataset (HDF5, Arrow or Parquet episodes) into an "
        "rlbuffers buffer: obs, next_obs, action, reward, terminated, truncated, episode "
        "(Dict/Tuple spaces as obs.<key> fields), its metadata in the buffer's. Nothing is "
        "downloaded.")
    m.add_argument("dataset", help="a Minari dataset id under MINARI_DATASETS_PATH (default "
                   "~/.minari/datasets) or a dataset directory")
    q = sources.add_parser(
        "parquet", help="a Parquet export (rlbuffers export parquet) back into a buffer",
        description="Convert a Parquet export (data/**.parquet + meta/info.json) into an "
        "rlbuffers buffer, a record batch at a time.")
    q.add_argument("path", help="the export's directory")
    for sp, func in ((m, _convert_minari), (q, _convert_parquet)):
        sp.add_argument("out", help="directory of the new rlbuffers buffer")
        sp.add_argument("--capacity", type=int, default=None, metavar="N",
                        help="ring size in transitions (default: all the source's steps)")
        sp.add_argument("--chunk-transitions", type=int, default=None, metavar="N",
                        help="transitions per stored chunk (default: ~4 MiB raw per chunk)")
        sp.add_argument("--codec", default=None, metavar="NAME",
                        help="blosc-zstd (default), blosc-lz4, zstd or none")
        sp.add_argument("--seed", type=int, default=None, metavar="N",
                        help="seed of the new buffer's RNG")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace an existing rlbuffers buffer at OUT")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.set_defaults(func=func)
    return p


def progress_bar(quiet: bool, unit: str) -> tuple[Any, Any]:
    """``(progress(done, total) callback, close())``: a tqdm bar on stderr, started by the
    first call (none with ``quiet``)."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and not quiet:
            from tqdm import tqdm

            bar = tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr)
        if bar is not None:
            bar.update(done - bar.n)

    return progress, lambda: bar is not None and bar.close()


def _convert_offline(args: argparse.Namespace, convert: Any, source: str) -> int:
    from rlbuffers.maintenance.inspection import inspect_path
    from rlbuffers.storage.compression import CODECS, DEFAULT_CODEC

    codec = args.codec or DEFAULT_CODEC
    if codec not in CODECS:
        raise ValueError(f"--codec: expected one of {', '.join(CODECS)}, got {codec!r}")
    progress, close = progress_bar(args.quiet, " steps")
    t0 = time.perf_counter()
    try:
        buf = convert(source, args.out, capacity=args.capacity,
                      chunk_transitions=args.chunk_transitions, codec=codec, seed=args.seed,
                      overwrite=args.overwrite, progress=progress)
    finally:
        close()
    n, episodes, fields = len(buf), buf.episodes, ", ".join(buf.fields)
    buf.close()
    report = inspect_path(args.out)
    raw = sum(f["raw_bytes"] for f in report["fields"].values())
    print(f"converted {n:,} transitions ({episodes:,} episodes) from {source} into {args.out} "
          f"in {time.perf_counter() - t0:.1f} s\nfields: {fields}\nstored "
          f"{report['stored_bytes'] / 2**20:.1f} MiB (raw {raw / 2**20:.1f} MiB)")
    return 0


def _convert_minari(args: argparse.Namespace) -> int:
    from rlbuffers.integrations.minari import from_minari

    return _convert_offline(args, from_minari, args.dataset)


def _convert_parquet(args: argparse.Namespace) -> int:
    from rlbuffers.integrations.parquet import from_parquet

    return _convert_offline(args, from_parquet, args.path)


def _convert_sb3(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rlbuffers.integrations.sb3.convert import convert_sb3
    from rlbuffers.maintenance.inspection import inspect_path
    from rlbuffers.storage.compression import CODECS, DEFAULT_CODEC

    codec = args.codec or DEFAULT_CODEC
    if codec not in CODECS:  # before reading a large pickle
        raise ValueError(f"--codec: expected one of {', '.join(CODECS)}, got {codec!r}")
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and not args.quiet:  # not before the pickle is known to be readable
            bar = tqdm(unit=" transitions", unit_scale=True, file=sys.stderr)
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    t0 = time.perf_counter()
    try:
        buf = convert_sb3(
            args.pickle, args.out, capacity=args.capacity,
            chunk_transitions=args.chunk_transitions, codec=codec,
            seed=args.seed,
            overwrite=args.overwrite, progress=progress,
            frame_stack_axis=args.frame_stack_axis,
            **({} if args.memory_budget is None else {"memory_budget": args.memory_budget}),
        )
    finally:
        if bar is not None:
            bar.close()
    src = buf.metadata["converted_from"]
    n, fields = len(buf), ", ".join(buf.fields)
    buf.close()
    report = inspect_path(args.out)
    raw = sum(f["raw_bytes"] for f in report["fields"].values())
    print(
        f"converted {n:,} transitions ({src['class'].rsplit('.', 1)[-1]}, n_envs "
        f"{src['n_envs']}, pos {src['pos']}, full {src['full']}) into {args.out} in "
        f"{time.perf_counter() - t0:.1f} s\nfields: {fields}\nstored "
        f"{report['stored_bytes'] / 2**20:.1f} MiB (raw {raw / 2**20:.1f} MiB)"
    )
    return 0
