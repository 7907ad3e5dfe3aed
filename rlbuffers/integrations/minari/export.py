"""``to_minari``: a buffer's episodes as a new local Minari dataset that ``minari.load_dataset``
reads (``rlbuffers export minari``), streamed episode by episode.

Fields read (the names ``rlbuffers convert minari`` and the reference trainers write): ``obs``
and ``next_obs`` (or ``obs.<key>`` / ``next_obs.<key>`` for Dict and Tuple spaces),
``action`` (or ``action.<key>``), ``reward``, ``terminated`` (else ``done``), ``truncated``
(optional), and when present ``info.<key>`` / ``next_info.<key>`` (the episode's ``infos``)
and ``episode_seed`` (each episode's reset seed). An episode's ``observations`` are its
``obs`` rows plus the ``next_obs`` of its last step.

Episodes are the buffer's own (:class:`~rlbuffers.maintenance.episodes.EpisodeReader`, from
:meth:`~rlbuffers.ReplayBuffer.episode_ids`): one ended with ``end_episode()`` and no flag is
written with neither flag on its last step, and ``convert minari`` ends it there again. A
wrapped ring's oldest episode is **dropped** (its start was overwritten; unless it provably
began at the oldest row), and counted in the report; the newest episode, if unfinished, is
written with ``truncations[-1] = True`` (what Minari's ``DataCollector`` does to an episode
it flushes) and counted as ``unfinished``.

Spaces: those recorded by ``convert minari`` (``metadata["minari"]``), else those of ``env``,
else inferred from the fields (Box over the dtype's range; bool: MultiBinary).
Observations are written without JPEG encoding (lossless).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbuffers.buffer import ReplayBuffer
from rlbuffers.integrations.minari.spaces import infer_space, unflatten
from rlbuffers.maintenance.episodes import EpisodeReader, Piece, concat, scan_cache_bytes

__all__ = ["MinariExport", "to_minari"]

#: metadata keys carried from ``metadata["minari"]`` into the new dataset
CARRIED = ("algorithm_name", "author", "author_email", "code_permalink", "description",
           "requirements", "ref_min_score", "ref_max_score", "num_episodes_average_score")


@dataclass(frozen=True)
class MinariExport:
    """What :func:`to_minari` wrote.

    Attributes:
        dataset_id: the new dataset's id.
        path: its directory.
        episodes: episodes written.
        steps: steps written.
        dropped_rows: rows of the wrapped ring's partial first episode, not written.
        unfinished: 1 if the newest episode was unfinished (written truncated), else 0.
    """

    dataset_id: str
    path: str
    episodes: int
    steps: int
    dropped_rows: int
    unfinished: int


def _prefixed(fields: dict[str, Any], prefix: str) -> list[str]:
    return [n for n in fields if n == prefix or n.startswith(prefix + ".")]


def _spaces(buf: ReplayBuffer, env: Any, observation_space: Any,
            action_space: Any) -> tuple[Any, Any]:
    import gymnasium as gym
    from minari.serialization import deserialize_space

    recorded = (buf.metadata or {}).get("minari") or {}
    made = None
    if env is not None and (observation_space is None or action_space is None):
        made = gym.make(env) if isinstance(env, str) else env
    spaces = []
    for given, key, prefix in ((observation_space, "observation_space", "obs"),
                               (action_space, "action_space", "action")):
        if given is None and made is not None:
            given = getattr(made, key)
        if given is None and isinstance(recorded.get(key), str):
            given = deserialize_space(recorded[key])
        spaces.append(given if given is not None else infer_space(buf.fields, prefix))
    if made is not None and isinstance(env, str):
        made.close()
    return spaces[0], spaces[1]


def _check_fields(fields: dict[str, Any]) -> None:
    obs = _prefixed(fields, "obs")
    nxt = ["next_" + n for n in obs]
    missing = [n for n in (*nxt, *(() if obs else ("obs",))) if n not in fields]
    if not _prefixed(fields, "action"):
        missing.append("action")
    missing += [n for n in ("reward",) if n not in fields]
    if "terminated" not in fields and "done" not in fields:
        missing.append("terminated (or done)")
    if missing:
        raise ValueError(f"buffer: expected the fields obs, next_obs, action, reward, "
                         f"terminated (or done); missing {', '.join(missing)} "
                         f"(has {', '.join(fields)})")


def episode_buffer(piece: Piece, spaces: tuple[Any, Any], info_names: list[str]) -> Any:
    """One episode's rows as a ``minari.data_collector.EpisodeBuffer``."""
    from minari.data_collector import EpisodeBuffer

    rows = piece.rows
    obs_space, act_space = spaces
    obs = {n: np.concatenate([rows[n], rows["next_" + n][-1:]])
           for n in rows if n == "obs" or n.startswith("obs.")}
    ends = rows["terminated"] if "terminated" in rows else rows["done"]
    trunc = (np.asarray(rows["truncated"], dtype=bool).copy() if "truncated" in rows
             else np.zeros(len(rows["reward"]), dtype=bool))
    if not piece.ends:
        trunc[-1] = True
    infos: Any = {}  # what DataCollector writes without record_infos
    if info_names:
        infos = unflatten({n: np.concatenate([rows[n], rows["next_" + n][-1:]])
                           for n in info_names}, "info")
    seed = int(rows["episode_seed"][0]) if "episode_seed" in rows else None
    return EpisodeBuffer(
        seed=seed, observations=unflatten(obs, "obs", obs_space),
        actions=unflatten(rows, "action", act_space), rewards=np.asarray(rows["reward"]),
        terminations=np.asarray(ends, dtype=bool), truncations=trunc, infos=infos)


def to_minari(buffer: ReplayBuffer | str | os.PathLike[str], dataset_id: str, *,
              env: Any = None, observation_space: Any = None, action_space: Any = None,
              data_format: str = "hdf5", overwrite: bool = False,
              metadata: dict[str, Any] | None = None, drop_partial_first: bool = True,
              cache_bytes: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> MinariExport:
    """Write the buffer's episodes, oldest first, as the local Minari dataset ``dataset_id``
    (under ``MINARI_DATASETS_PATH``, default ``~/.minari/datasets``).

    Args:
        buffer: an open buffer, or its path (opened read-only: the last commit).
        dataset_id: ``(namespace/)name-v<version>``, as Minari requires.
        env: a gymnasium env id or ``Env`` whose spaces and spec describe the data (optional).
        observation_space, action_space: override the spaces (see the module docstring).
        data_format: ``"hdf5"`` (default), ``"arrow"`` or ``"parquet"``: Minari's storages.
        overwrite: replace a local dataset of that id.
        metadata: dataset metadata (``algorithm_name``, ``author``, ``author_email``,
            ``code_permalink``, ``description``...); default: what ``convert minari`` kept.
        drop_partial_first: drop a wrapped ring's partial oldest episode (True), or write it.
        cache_bytes: the decoded-chunk cache of the reader opened for a path (None: what one
            ordered read needs, :func:`~rlbuffers.maintenance.episodes.scan_cache_bytes`,
            at most 256 MiB); an open buffer reads through its own.
        progress: called as ``progress(steps_done, buffer_size)`` after each episode.

    Returns:
        a :class:`MinariExport`.

    Raises:
        ValueError: a malformed ``dataset_id``, an unknown ``data_format``, a negative
            ``cache_bytes``, missing fields, an empty buffer, or no episode left.
        FileExistsError: the dataset exists and ``overwrite`` is False.
    """
    if data_format not in ("hdf5", "arrow", "parquet"):
        raise ValueError(f"data_format: expected 'hdf5', 'arrow' or 'parquet', got "
                         f"{data_format!r}")
    _check_id(dataset_id)
    own = not isinstance(buffer, ReplayBuffer)
    buf = buffer if isinstance(buffer, ReplayBuffer) else ReplayBuffer.open(
        buffer, mode="r", cache_bytes=scan_cache_bytes(buffer) if cache_bytes is None
        else cache_bytes)
    try:
        _check_fields(buf.fields)
        if len(buf) == 0:
            raise ValueError(f"buffer: {buf.path} holds no transitions")
        target = _target(dataset_id, overwrite)
        spaces = _spaces(buf, env, observation_space, action_space)
        reader = EpisodeReader(buf, drop_partial_first=drop_partial_first)
        info = [n for n in _prefixed(buf.fields, "info") if "next_" + n in buf.fields]
        counts = {"episodes": 0, "steps": 0, "unfinished": 0}

        def episodes() -> Iterator[Any]:
            for piece in _episodes(reader):
                yield episode_buffer(piece, spaces, info)
                counts["episodes"] += 1
                counts["steps"] += len(piece.rows["reward"])  # next_* hold one row
                counts["unfinished"] += not piece.ends
                if progress is not None:
                    progress(reader.rows + reader.dropped_rows, len(buf))

        try:
            _create(dataset_id, episodes(), spaces, data_format,
                    _dataset_metadata(buf, env, metadata))
            if counts["episodes"] == 0:
                raise ValueError(f"buffer: {buf.path}: no episode left after dropping the "
                                 f"wrapped ring's partial first episode "
                                 f"({reader.dropped_rows} rows)")
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        return MinariExport(dataset_id, str(target), counts["episodes"], counts["steps"],
                            reader.dropped_rows, counts["unfinished"])
    finally:
        if own:
            buf.close()


def _episodes(reader: EpisodeReader) -> Iterator[Piece]:
    """Whole episodes, holding of each ``next_*`` field only the last row of each piece (all
    that an episode's ``observations`` and ``infos`` need): half the memory of an episode of
    observations."""
    parts: list[dict[str, Any]] = []
    first: Piece | None = None
    for piece in reader.pieces():
        first = first or piece
        parts.append({k: v[-1:] if k.startswith("next_") else v for k, v in piece.rows.items()})
        if piece.ends:
            yield Piece(concat(parts), first.episode, first.start, True)
            parts, first = [], None
    if first is not None:
        yield Piece(concat(parts), first.episode, first.start, False)


def _check_id(dataset_id: str) -> None:
    from minari.dataset.minari_dataset import parse_dataset_id

    try:
        parse_dataset_id(dataset_id)
    except (ValueError, TypeError):
        raise ValueError(f"dataset_id: expected (namespace/)name-v<version>, e.g. "
                         f"'rlbuffers/pendulum-v0', got {dataset_id!r}") from None


def _target(dataset_id: str, overwrite: bool) -> Any:
    """The dataset's directory, checked free (or emptied with ``overwrite``)."""
    from minari.storage.datasets_root_dir import get_dataset_path

    target = get_dataset_path(dataset_id)
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"dataset_id: a local Minari dataset {dataset_id!r} exists "
                                  f"at {target} (overwrite=True replaces it)")
        shutil.rmtree(target)
    return target


def _dataset_metadata(buf: ReplayBuffer, env: Any, metadata: dict[str, Any] | None
                      ) -> dict[str, Any]:
    import gymnasium as gym

    recorded = (buf.metadata or {}).get("minari") or {}
    meta = {k: recorded[k] for k in CARRIED if k in recorded}
    for k in ("env_spec", "eval_env_spec"):
        if isinstance(recorded.get(k), str):
            meta[k] = recorded[k]
    if env is not None:
        spec = gym.spec(env) if isinstance(env, str) else env.spec
        if spec is not None:
            meta["env_spec"] = spec.to_json()
    if metadata:
        meta.update(metadata)
    for k in ("author", "author_email"):  # Minari keeps sets of names
        if k in meta:
            meta[k] = {meta[k]} if isinstance(meta[k], str) else set(meta[k])
    return meta


def _create(dataset_id: str, episodes: Iterator[Any], spaces: tuple[Any, Any],
            data_format: str, meta: dict[str, Any]) -> None:
    """``minari.create_dataset_from_buffers`` fed one episode at a time (it iterates its
    ``buffer`` once), then the metadata it has no argument for (the env spec, recorded as
    JSON, so the env need not be installed)."""
    import minari

    late: dict[str, Any] = {k: meta.pop(k) for k in ("env_spec", "eval_env_spec", "requirements",
                                     "ref_min_score", "ref_max_score",
                                     "num_episodes_average_score") if k in meta}
    named = {k: meta.pop(k) for k in ("algorithm_name", "author", "author_email",
                                      "code_permalink", "description") if k in meta}
    with warnings.catch_warnings():  # its advice to name an author etc. when one is missing
        warnings.filterwarnings("ignore", category=UserWarning, module=r"minari\.")
        ds = minari.create_dataset_from_buffers(
            dataset_id, buffer=episodes, observation_space=spaces[0],  # type: ignore[arg-type]
            action_space=spaces[1], data_format=data_format, jpeg_encoding=False, **named)
    extra = {**late, **meta}
    if extra:
        ds.storage.update_metadata(extra)
