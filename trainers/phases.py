"""Per-phase seconds and peak memory of one loop unit (step, iteration, generation), in its
metrics row and in the log at INFO: ``rollout 3.2 s 1,204 MiB | update 5.1 s 1,870 MiB``.

Peak figures are ``rlbuffers.memory.MemoryMonitor`` phase peaks: the process's RSS sampled
while the phase runs (and, with a CUDA device, ``torch.cuda.max_memory_allocated`` over the
phase); the heap is trimmed when a phase ends, so freed activations do not count in the next
phase's peak. These are *phase peaks*; the process's true peak (what ``/usr/bin/time``
reports) is ``rlbuffers.memory.process.process_peak_rss_bytes``, printed by the run's summary.

Each phase logs a line when it starts (``generate (step 3)...``) and, while it runs, one every
:attr:`Phases.heartbeat_s` seconds (``generate (step 3) 16 s...``), so no phase is silent for
long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlbuffers.memory import MemoryMonitor
from rlbuffers.memory.process import trim_heap

log = logging.getLogger("trainers.phases")
MIB = 2**20


class Count:
    """A "k of n" figure for a :func:`heartbeat` (``add`` from any thread; ``k`` never passes
    ``total``): ``7 of 20 problems done``."""

    def __init__(self, total: int, what: str = "done") -> None:
        self.k, self.total, self.what = 0, int(total), what
        self._lock = threading.Lock()

    def add(self, k: int = 1) -> None:
        with self._lock:
            self.k = min(self.total, self.k + int(k))

    def __str__(self) -> str:
        return f"{self.k} of {self.total} {self.what}"


@contextmanager
def heartbeat(label: str, every_s: float = 8.0, count: Count | None = None) -> Iterator[None]:
    """Log (INFO) ``<label>...`` now and ``<label> <seconds> s...`` every ``every_s`` seconds
    until the block ends (a thread waits on an event: no cost while the block runs); with a
    ``count``, each of those lines says it too: ``<label> 16 s: 7 of 20 problems done...``."""
    t0 = time.perf_counter()
    log.info("%s...", label)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            log.info("%s %.0f s%s...", label, time.perf_counter() - t0,
                     "" if count is None else f": {count}")

    beater = threading.Thread(target=beat, name="heartbeat", daemon=True)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()


class Phases:
    """``with phases("update"):`` records the block's seconds (``seconds_<name>``, summed
    when a phase runs several times) and peak RSS (``peak_rss_<name>_bytes``, the largest;
    ``cuda_peak_<name>_bytes`` with a CUDA monitor) into ``row``."""

    #: Seconds between the "still running" lines of a long phase.
    heartbeat_s: float = 8.0

    def __init__(self, monitor: MemoryMonitor, row: dict[str, Any]) -> None:
        self.monitor, self.row = monitor, row
        self.names: list[str] = []
        self.untimed: set[str] = set()  # phases whose seconds another line gives

    def label(self, name: str) -> str:
        """``generate (step 3)`` (the row's unit when it has one: step, iteration,
        generation)."""
        unit = next((u for u in ("step", "iteration", "generation") if u in self.row), None)
        return f"{name} ({unit} {self.row[unit]})" if unit else name

    @contextmanager
    def __call__(self, name: str, *, timed: bool = True) -> Iterator[None]:
        """``timed=False``: the unit's line (:meth:`log`) gives this phase's peak but not its
        seconds, which a line of its own gives (a commit's: ``trainers.common.commit_line``),
        so a unit never prints two times for one thing."""
        if not timed:
            self.untimed.add(name)
        t0 = time.perf_counter()
        with heartbeat(self.label(name), self.heartbeat_s), self.monitor.phase(name) as pk:
            yield
            trim_heap()
        row = self.row
        row[f"seconds_{name}"] = row.get(f"seconds_{name}", 0.0) + time.perf_counter() - t0
        row[f"peak_rss_{name}_bytes"] = max(row.get(f"peak_rss_{name}_bytes", 0),
                                            pk.peak_rss_bytes)
        if pk.cuda_peak_bytes:
            row[f"cuda_peak_{name}_bytes"] = max(row.get(f"cuda_peak_{name}_bytes", 0),
                                                 pk.cuda_peak_bytes)
        if name not in self.names:
            self.names.append(name)

    def peak_rss_bytes(self) -> int:
        """The largest phase peak of the row so far (0 before any phase)."""
        return max((self.row[f"peak_rss_{n}_bytes"] for n in self.names), default=0)

    def log(self, unit: str, n: int) -> str:
        """Log (INFO) and return the unit's line: each phase's seconds and peak."""
        parts = []
        for name in self.names:
            cuda = self.row.get(f"cuda_peak_{name}_bytes")
            seconds = "" if name in self.untimed else f"{self.row[f'seconds_{name}']:.1f} s "
            parts.append(f"{name} {seconds}"
                         f"{self.row[f'peak_rss_{name}_bytes'] / MIB:,.0f} MiB"
                         + (f" (cuda {cuda / MIB:,.0f} MiB)" if cuda else ""))
        line = f"{unit} {n}: " + " | ".join(parts)
        log.info(line)
        return line
