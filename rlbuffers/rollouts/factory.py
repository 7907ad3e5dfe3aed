"""``make_pool``: the rollout pool a trainer's settings ask for, chosen in one place."""

from __future__ import annotations

from typing import Any

from rlbuffers.rollouts.pool import RolloutPool

#: The backends :func:`make_pool` knows ('' picks one).
BACKENDS = ("", "inprocess", "ray")


def make_pool(backend: str, workers: int, *, address: str | None = None,
              torch_threads: int = 1) -> RolloutPool:
    """The rollout pool for ``backend`` with ``workers`` workers.

    Args:
        backend: ``"inprocess"`` (:class:`~rlbuffers.rollouts.InProcessPool`), ``"ray"``
            (:class:`~rlbuffers.rollouts.RayPool`; Ray is imported only here), or ``""``:
            Ray when ``workers > 1`` or an ``address`` is given, else in process.
        workers: how many workers (>= 1).
        address: a Ray cluster to join (``"auto"``, ``"ray://host:10001"``); None or ``""``:
            start Ray on this machine. Ignored in process.
        torch_threads: torch's intra-op threads in each Ray worker.

    Raises:
        ValueError: ``backend`` is not one of ``BACKENDS``, or ``workers`` is not an integer
            >= 1 (the argument, what was expected and what was given are named).
        ImportError: ``"ray"`` (or the choice of ``""``) without Ray installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected '', 'inprocess' or 'ray', got {backend!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an integer >= 1, got {workers!r}")
    chosen = backend or ("ray" if workers > 1 or address else "inprocess")
    if chosen == "inprocess":
        from rlbuffers.rollouts.inprocess import InProcessPool

        return InProcessPool(workers)
    from rlbuffers.rollouts.ray_pool import RayPool

    pool: Any = RayPool(workers, address=address or None, torch_threads=torch_threads)
    return pool
