"""``from_minari``: a Minari dataset (HDF5, Arrow or Parquet episodes) as an rlbuffers buffer,
streamed episode by episode (``rlbuffers convert minari``).

Each episode of ``N`` steps (``observations`` ``N + 1`` rows, the rest ``N``) becomes ``N``
transitions with the fields

- ``obs``, ``next_obs``: ``observations[:-1]`` and ``observations[1:]`` (Dict / Tuple spaces:
  ``obs.<key>`` / ``obs.<i>``, nested with dots: :mod:`~rlbuffers.integrations.minari.spaces`);
- ``action`` (``action.<key>`` likewise), ``reward``, ``terminated``, ``truncated``: the
  dataset's arrays, dtypes kept (Minari stores rewards as float64);
- ``episode`` int64: the Minari episode id (it also separates episodes that end with neither
  flag); ``episode_seed`` uint64: the episode's reset seed, when every episode has one;
- ``info.<key>``, ``next_info.<key>``: each numeric ``infos`` array with ``N + 1`` rows (the
  reset's info and each step's), split as the observations; other infos are dropped and named
  in the metadata (``minari.dropped_infos``).

The dataset's metadata (env spec, spaces, algorithm, authors, code permalink, description,
Minari version, data format) is stored as ``buf.metadata["minari"]``, and
``buf.metadata["converted_from"]`` says what was read. Memory: one episode at a time
(Minari decodes a whole episode per read), whatever the dataset's size.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers.buffer import ReplayBuffer
from rlbuffers.integrations.minari.spaces import flatten
from rlbuffers.spec import FieldSpec
from rlbuffers.storage.compression import DEFAULT_CODEC

__all__ = ["from_minari", "open_dataset"]


def open_dataset(dataset: Any) -> Any:
    """A ``minari.MinariDataset`` from a dataset, a local dataset id (under
    ``MINARI_DATASETS_PATH``, default ``~/.minari/datasets``; nothing is downloaded) or a
    directory (the dataset's, holding ``data/``, or its ``data/`` itself).

    Raises:
        FileNotFoundError: neither a local dataset id nor a dataset directory.
        TypeError: ``dataset`` is not a MinariDataset, str or path.
    """
    import minari

    if isinstance(dataset, minari.MinariDataset):
        return dataset
    if not isinstance(dataset, (str, os.PathLike)):
        raise TypeError(f"dataset: expected a MinariDataset, dataset id or directory, got "
                        f"{type(dataset).__name__}")
    path = Path(dataset)
    for data in (path / "data", path):
        if (data / "metadata.json").is_file():
            return minari.MinariDataset(data)
    try:
        return minari.load_dataset(str(dataset), download=False)
    except (FileNotFoundError, ValueError):
        from minari.storage.datasets_root_dir import get_dataset_path

        raise FileNotFoundError(
            errno.ENOENT, f"dataset: expected a local Minari dataset id or a dataset directory "
            f"(no such directory, and no dataset of that id under {get_dataset_path()}; "
            "nothing is downloaded: 'minari download ID' fetches one)", str(dataset)) from None


def _raw_metadata(ds: Any) -> dict[str, Any]:
    from minari.dataset.minari_storage import MinariStorage

    return dict(MinariStorage.read_raw_metadata(ds.storage.data_path))


def _info_columns(infos: Any, n: int, what: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """``(info.<key> -> [n + 1, ...] arrays kept, names dropped)``."""
    kept: dict[str, np.ndarray] = {}
    dropped: list[str] = []
    for name, arr in flatten(infos or {}, "info", what=what, strict=False):
        if arr.dtype.kind in "biufc" and arr.ndim >= 1 and len(arr) == n + 1:
            kept[name] = arr
        else:
            dropped.append(name)
    return kept, dropped


def episode_columns(ep: Any, seed: int | None) -> tuple[dict[str, Any], list[str]]:
    """One ``minari.EpisodeData`` as transition columns ``{field: [N, *shape]}`` (and the info
    names dropped).

    Raises:
        ValueError: observations not ``N + 1`` rows, or fields of other lengths.
    """
    n, what = len(ep.rewards), f"episode {ep.id}"
    cols: dict[str, Any] = {}
    for name, arr in flatten(ep.observations, "obs", what=f"{what} observations"):
        if len(arr) != n + 1:
            raise ValueError(f"{what}: {name!r} has {len(arr)} rows, expected {n + 1} "
                             f"(steps + 1)")
        cols[name], cols["next_" + name] = arr[:-1], arr[1:]
    cols.update(flatten(ep.actions, "action", what=f"{what} actions"))
    cols["reward"] = np.asarray(ep.rewards)
    cols["terminated"] = np.asarray(ep.terminations, dtype=bool)
    cols["truncated"] = np.asarray(ep.truncations, dtype=bool)
    infos, dropped = _info_columns(ep.infos, n, f"{what} infos")
    for name, arr in infos.items():
        cols[name], cols["next_" + name] = arr[:-1], arr[1:]
    cols["episode"] = np.full(n, ep.id, dtype=np.int64)
    if seed is not None:
        cols["episode_seed"] = np.full(n, seed, dtype=np.uint64)
    for name, arr in cols.items():
        if len(arr) != n:
            raise ValueError(f"{what}: {name!r} has {len(arr)} rows, expected {n} (one per step)")
    return cols, dropped


def _seeds(ds: Any) -> list[int | None]:
    return [None if m.get("seed") is None else int(m["seed"])
            for m in ds.storage.get_episode_metadata(ds.episode_indices)]


def from_minari(dataset: Any, out: str | os.PathLike[str], *, capacity: int | None = None,
                chunk_transitions: int | None = None, codec: str = DEFAULT_CODEC,
                seed: int | None = None, overwrite: bool = False,
                progress: Callable[[int, int], None] | None = None) -> ReplayBuffer:
    """Convert a Minari dataset into a new buffer at ``out`` (committed once, at the end) and
    return it open for reading and writing.

    Args:
        dataset: a ``minari.MinariDataset``, a local dataset id or a dataset directory
            (:func:`open_dataset`).
        out: directory (or fsspec URL) of the new buffer.
        capacity: ring size (default: the dataset's total steps; smaller keeps the last ones).
        chunk_transitions, codec, seed, overwrite: as :meth:`rlbuffers.ReplayBuffer.create`.
        progress: called as ``progress(steps_done, total_steps)`` after each episode.

    Returns:
        the buffer (fields in the module docstring), holding every step in dataset order.

    Raises:
        FileNotFoundError: as :func:`open_dataset` (also TypeError).
        ValueError: an empty dataset, a space this conversion cannot flatten (Text), or an
            episode whose arrays disagree in length.
        FieldError: an episode whose arrays differ in shape or dtype from the first's.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    ds = open_dataset(dataset)
    total = int(ds.total_steps)
    if total < 1 or ds.total_episodes < 1:
        raise ValueError(f"dataset: {ds.id!r} holds no steps")
    seeds = _seeds(ds)
    keep_seeds = all(s is not None for s in seeds)
    episodes = ds.iterate_episodes()
    first = next(iter(episodes))
    cols, dropped = episode_columns(first, seeds[0] if keep_seeds else None)
    fields = {name: FieldSpec(tuple(np.shape(a)[1:]), np.asarray(a).dtype)
              for name, a in cols.items()}
    buf = ReplayBuffer.create(out, capacity=capacity or total, fields=fields,
                              chunk_transitions=chunk_transitions, codec=codec, seed=seed,
                              overwrite=overwrite)
    try:
        done = _write_all(buf, first, cols, episodes, seeds if keep_seeds else None,
                          set(dropped), total, progress)
        meta = _raw_metadata(ds)
        meta["dropped_infos"] = sorted(set(dropped) | done["dropped"])
        buf.save(metadata={
            "minari": meta,
            "converted_from": {"format": "minari", "dataset_id": ds.id,
                               "data_path": str(ds.storage.data_path),
                               "episodes": done["episodes"], "steps": done["steps"],
                               "episode_seeds": keep_seeds}})
    except BaseException:
        buf.close()
        raise
    return buf


def _write_all(buf: ReplayBuffer, first: Any, cols: dict[str, Any], episodes: Any,
               seeds: list[int | None] | None, dropped: set[str], total: int,
               progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    steps, count = 0, 0
    ep = first
    while True:
        buf.extend(cols)
        if not (cols["terminated"][-1] or cols["truncated"][-1]):
            buf.end_episode()  # an episode that ends with neither flag still ends here
        steps, count = steps + len(cols["reward"]), count + 1
        if progress is not None:
            progress(steps, total)
        ep = next(episodes, None)
        if ep is None:
            return {"episodes": count, "steps": steps, "dropped": dropped}
        cols, more = episode_columns(ep, None if seeds is None else seeds[count])
        dropped.update(more)
