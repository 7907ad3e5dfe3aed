"""The DataLoader-worker path of :class:`~rlbuffers.stream.StreamLoader`: each worker runs one
slot through a *slot runner* the loader hands over (its pipeline through the loader's quota
runner) and sends ``(slot, item, state)``; and workers exit when the process that started them
dies. This module knows nothing of the loader: it takes the runner, a plain callable.

Orphaned workers: after a SIGKILL of the consumer, a torch DataLoader worker can block for ever
in ``multiprocessing`` queue finalisation (its feeder thread waits to flush a full pipe that
nobody reads). Each worker therefore asks Linux to kill it when its parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``), and elsewhere watches ``os.getppid()`` from a daemon
thread. Caveat of the Linux mechanism: "parent" is the *thread* that forked the worker, i.e.
the one that started iterating the loader; iterate it from a thread that outlives the loop.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

SlotRunner = Callable[[int], Iterator[tuple[Any, dict[str, Any]]]]
"""``run(slot)``: yields ``(item, state)`` for one slot of this epoch, ``state`` the slot's
pipeline state after ``item`` (picklable, e.g. a bound method of a picklable object)."""

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
"""How often the fallback thread (non-Linux) checks whether the parent is still alive."""


def _watch_parent(parent_pid: int) -> None:
    event = threading.Event()
    while not event.wait(PARENT_POLL_S):
        if os.getppid() != parent_pid:
            os._exit(1)


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when ``parent_pid`` (its parent) dies: SIGKILL via
    ``prctl(PR_SET_PDEATHSIG)`` on Linux, else a daemon thread polling ``os.getppid()``
    every ``PARENT_POLL_S`` seconds. Exits at once if the parent is already gone."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="rlbuffers-parent-watch").start()
    if os.getppid() != parent_pid:  # died before the signal was armed
        os._exit(1)


def _worker_init(parent_pid: int, worker_id: int) -> None:
    die_with_parent(parent_pid)


class _WorkerDataset:
    """Runs one slot inside a DataLoader worker; yields (slot, item, state). Combined with
    ``torch.utils.data.IterableDataset`` by :func:`_worker_dataset_class` (torch is imported
    only when workers are used)."""

    def __init__(self, run_slot: SlotRunner, num_slots: int, offset: int) -> None:
        self.run_slot = run_slot
        self.num_slots = num_slots
        self.offset = offset

    def __iter__(self) -> Iterator[tuple[int, Any, dict[str, Any]]]:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0  # None: iterated outside a worker
        slot = (worker + self.offset) % self.num_slots
        for item, state in self.run_slot(slot):
            yield slot, item, state


@functools.cache
def _worker_dataset_class() -> type:
    import torch.utils.data

    return type("StreamWorkerDataset", (_WorkerDataset, torch.utils.data.IterableDataset), {})


def _identity(x: Any) -> Any:
    return x


def worker_loader(run_slot: SlotRunner, offset: int, num_workers: int) -> Any:
    """A ``torch.utils.data.DataLoader`` over ``num_workers`` forked workers, worker ``i``
    running ``run_slot((i + offset) % num_workers)``; yields ``(slot, item, state)``.

    The workers are always forked (where the platform can fork), whatever the process-wide
    start method is: another library may set it to ``spawn`` on import (TorchRL does), and a
    spawned worker would need the loader's whole pipeline pickled."""
    import multiprocessing

    import torch.utils.data

    dataset = _worker_dataset_class()(run_slot, num_workers, offset)
    context = (multiprocessing.get_context("fork")
               if "fork" in multiprocessing.get_all_start_methods() else None)
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=num_workers, collate_fn=_identity,
        worker_init_fn=functools.partial(_worker_init, os.getpid()),
        multiprocessing_context=context)
