"""ERL's offline data (``--offline-data PATH``, ``--offline-fraction F``): a dataset mixed into
every TD3 batch with :func:`rlbuffers.mix` (``F = 0.5``: RLPD's symmetric sampling, Ball et al.
2023, "Efficient Online Reinforcement Learning with Offline Data").

``PATH`` is an rlbuffers buffer directory, opened read-only (a snapshot reader: any number of
runs can share it), or a local Minari dataset (an id under ``MINARI_DATASETS_PATH``, or its
directory), converted once into ``run_dir/offline`` with
:func:`rlbuffers.integrations.minari.from_minari` (the ``offline`` extra) and read from there,
also on ``--resume``. Each TD3 batch takes ``obs``, ``action``, ``reward``, ``next_obs`` and
``terminated`` from both buffers (in the online buffer's float32). The mixture's state (batches
drawn, its generator) is part of the trainer state of every checkpoint, so a resumed run draws
the same batches as an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlbuffers import Mixture, NotABufferError, ReplayBuffer, mix
from trainers.config import ConfigError

#: the fields a TD3 batch takes from both buffers
FIELDS = ("obs", "action", "reward", "next_obs", "terminated")
#: ``run_dir/OFFLINE_DIR``: a Minari dataset converted for this run
OFFLINE_DIR = "offline"


def _buffer(path: Path) -> ReplayBuffer | None:
    """The buffer at ``path`` opened read-only, or None if there is none."""
    try:
        return ReplayBuffer.open(path, mode="r")
    except NotABufferError:
        return None


def _shapes(obs: tuple[int, ...], act: tuple[int, ...], want: tuple[int, int],
            data: str) -> None:
    if obs != (want[0],) or act != (want[1],):
        raise ConfigError(f"--offline-data: expected observations ({want[0]},) and actions "
                          f"({want[1]},) as the env's, got {obs} and {act} in {data!r}")


def check_offline(data: str, obs_dim: int, act_dim: int) -> str:
    """What ``data`` names, checked before the run directory is made: ``"buffer"`` or
    ``"minari"``.

    Raises:
        ConfigError: neither a buffer nor a local Minari dataset, a Minari dataset without the
            ``offline`` extra, or observations / actions shaped unlike the env's (one line
            naming ``--offline-data``).
    """
    buf = _buffer(Path(data))
    if buf is not None:
        with buf:
            fields = buf.fields
            missing = [f for f in FIELDS if f not in fields]
            if missing:
                raise ConfigError(f"--offline-data: {data!r} lacks the fields "
                                  f"{', '.join(missing)} (expected {', '.join(FIELDS)})")
            _shapes(tuple(fields["obs"].shape), tuple(fields["action"].shape),
                    (obs_dim, act_dim), data)
        return "buffer"
    try:
        from rlbuffers.integrations.minari import open_dataset
    except ImportError as e:
        raise ConfigError(f"--offline-data: {data!r} is not an rlbuffers buffer, and reading "
                          f"it as a Minari dataset needs the offline extra ({e})") from None
    try:
        ds = open_dataset(data)
    except (FileNotFoundError, TypeError):
        raise ConfigError(f"--offline-data: expected an rlbuffers buffer directory or a local "
                          f"Minari dataset (id or directory), got {data!r}") from None
    _shapes(tuple(ds.observation_space.shape or ()), tuple(ds.action_space.shape or ()),
            (obs_dim, act_dim), data)
    return "minari"


def open_offline(data: str, kind: str, run_dir: str | Path) -> ReplayBuffer:
    """The offline buffer, read-only: ``data`` itself (a buffer), or its conversion into
    ``run_dir/offline`` (made now, or by an earlier start of this run)."""
    if kind == "buffer":
        return ReplayBuffer.open(data, mode="r")
    local = Path(run_dir) / OFFLINE_DIR
    buf = _buffer(local)
    if buf is not None and "converted_from" in (buf.metadata or {}):
        return buf
    if buf is not None:  # a conversion interrupted before its commit: replaced
        buf.close()
    from rlbuffers.integrations.minari import from_minari

    from_minari(data, local, overwrite=True).close()
    return ReplayBuffer.open(local, mode="r")


def make_mixture(offline: ReplayBuffer, online: ReplayBuffer, fraction: float, seed: int,
                 state: dict[str, Any] | None) -> Mixture:
    """The TD3 batches' mixture of ``offline`` and ``online``, resumed from ``state`` (a
    :meth:`rlbuffers.Mixture.state_dict` kept in the trainer state) when given."""
    mixture = mix(offline, online, fraction, seed=seed, fields=FIELDS)
    if state is not None:
        mixture.load_state_dict(state)
    return mixture
