"""Peak memory of a block of code: process RSS (sampling thread, plus the kernel's
high-water mark when the block raised it) and, for a CUDA device, ``max_memory_allocated``."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rlbuffers.memory.process import peak_rss_bytes, rss_bytes

_open_lock = threading.Lock()
#: PeakMemory blocks open now. A block on a CUDA device entering resets that device's
#: ``max_memory_allocated``; it first lifts every open block's carried CUDA peak to the mark
#: so far, so nested blocks all stay exact.
_open: list[PeakMemory] = []


def _cuda_device(device: Any) -> Any:
    """The torch CUDA device named by ``device``, or None (torch is never imported here)."""
    torch = sys.modules.get("torch")
    if torch is None or device is None or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    return dev if dev.type == "cuda" else None


def sample_open_blocks() -> None:
    """Take one RSS sample now in every open :class:`PeakMemory` block (as each block's
    ``sample()``): code that knows it is at its high point (a benchmark's or a test's step
    holding a known allocation) makes the blocks' peaks exact under an earlier process peak,
    where the kernel's high-water mark does not move."""
    with _open_lock:
        blocks = list(_open)
    for block in blocks:
        block.sample()


class PeakMemory:
    """Context manager measuring the peak memory of its block, in bytes.

    RSS is sampled every ``sample_interval_s`` by a thread, and the kernel's high-water mark
    (``VmHWM``) is read on entry and on exit: when the block raised it, its new value (the
    process's peak so far, reached inside the block) is the block's peak, exact between
    samples. The mark is never reset (``/proc/self/clear_refs``), so the process's peak seen
    from outside (``/usr/bin/time``, ``wait4``'s ``ru_maxrss``, a parent reading ``VmHWM``)
    stays true; a block whose RSS stays under an earlier peak of the process is measured by
    its samples only. Nested (or concurrent) blocks measure independently. CUDA's
    ``max_memory_allocated`` is reset on entry (in-process counters only); a block that resets
    it first carries the peak so far into the blocks already open.

    Args:
        device: a CUDA device (``"cuda:0"``, ``torch.device``) whose
            ``max_memory_allocated`` is also tracked; None or a CPU device: RSS only.
        sample_interval_s: seconds between RSS samples (> 0).
        on_sample: called with each RSS sample (bytes), from the sampling thread.

    Attributes (after the block):
        start_rss_bytes, peak_rss_bytes, peak_extra_rss_bytes: RSS at entry, its peak, and
            the difference.
        cuda_start_bytes, cuda_peak_bytes, cuda_peak_extra_bytes: the same for
            ``torch.cuda.memory_allocated`` (0 without a CUDA device).

    Raises:
        ValueError: ``sample_interval_s`` <= 0.
    """

    def __init__(self, *, device: Any = None, sample_interval_s: float = 0.005,
                 on_sample: Callable[[int], None] | None = None) -> None:
        if not sample_interval_s > 0:
            raise ValueError(f"sample_interval_s: expected > 0, got {sample_interval_s!r}")
        self.device = _cuda_device(device)
        self.sample_interval_s = float(sample_interval_s)
        self.on_sample = on_sample
        self.start_rss_bytes = self.peak_rss_bytes = self.peak_extra_rss_bytes = 0
        self.cuda_start_bytes = self.cuda_peak_bytes = self.cuda_peak_extra_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm_start = 0
        self._cuda_carry = 0

    @property
    def peak_extra_bytes(self) -> int:
        """Peak extra bytes on the tracked device: CUDA allocated if a CUDA device, else RSS."""
        return self.cuda_peak_extra_bytes if self.device is not None else \
            self.peak_extra_rss_bytes

    def sample(self) -> None:
        """Take one RSS sample now (the thread takes one every ``sample_interval_s``): a
        caller that knows its block is at a high point can record it exactly."""
        rss = rss_bytes()
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        if self.on_sample is not None:
            self.on_sample(rss)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            self.sample()

    def _reset_marks(self) -> None:
        """Read the RSS high-water mark; carry the CUDA peaks so far into the open blocks,
        then reset this device's CUDA peak counter."""
        with _open_lock:
            self._hwm_start = peak_rss_bytes()
            if self.device is not None:
                torch = sys.modules["torch"]
                key = str(self.device)
                so_far = torch.cuda.max_memory_allocated(self.device)
                for other in _open:
                    if other.device is not None and str(other.device) == key:
                        other._cuda_carry = max(other._cuda_carry, so_far)
                torch.cuda.synchronize(self.device)
                self.cuda_start_bytes = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            _open.append(self)

    def __enter__(self) -> PeakMemory:
        self._cuda_carry = 0
        self._reset_marks()
        self.start_rss_bytes = self.peak_rss_bytes = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="PeakMemory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        with _open_lock:
            _open.remove(self)
            hwm = peak_rss_bytes()
            if hwm > self._hwm_start:  # the process's peak rose inside the block: exact
                self.peak_rss_bytes = max(self.peak_rss_bytes, hwm)
            if self.device is not None:
                torch = sys.modules["torch"]
                torch.cuda.synchronize(self.device)
                self.cuda_peak_bytes = max(torch.cuda.max_memory_allocated(self.device),
                                           self._cuda_carry)
        self.peak_extra_rss_bytes = max(0, self.peak_rss_bytes - self.start_rss_bytes)
        self.cuda_peak_extra_bytes = max(0, self.cuda_peak_bytes - self.cuda_start_bytes)
