"""Peak memory of a block of code: process RSS (sampling thread, plus the kernel's
high-water mark where it can be reset) and, for a CUDA device, ``max_memory_allocated``."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from rlbuffers.memory.process import peak_rss_bytes, reset_peak_rss, rss_bytes

_open_lock = threading.Lock()
#: PeakMemory blocks open now. A block entering resets the high-water marks; it first lifts
#: every open block's carried peak to the marks so far, so nested blocks all stay exact.
_open: list[PeakMemory] = []


def _cuda_device(device: Any) -> Any:
    """The torch CUDA device named by ``device``, or None (torch is never imported here)."""
    torch = sys.modules.get("torch")
    if torch is None or device is None or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    return dev if dev.type == "cuda" else None


class PeakMemory:
    """Context manager measuring the peak memory of its block, in bytes.

    RSS is sampled every ``sample_interval_s`` by a thread; where Linux allows it, the
    kernel's high-water mark (``VmHWM``) is reset on entry and read on exit, which catches
    peaks between samples. Nested (or concurrent) blocks stay exact: a block that resets the
    marks first carries the peak so far into the blocks already open.

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
        self._hwm = False
        self._rss_carry = self._cuda_carry = 0

    @property
    def peak_extra_bytes(self) -> int:
        """Peak extra bytes on the tracked device: CUDA allocated if a CUDA device, else RSS."""
        return self.cuda_peak_extra_bytes if self.device is not None else \
            self.peak_extra_rss_bytes

    def _sample(self) -> None:
        rss = rss_bytes()
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        if self.on_sample is not None:
            self.on_sample(rss)

    def _run(self) -> None:
        while not self._stop.wait(self.sample_interval_s):
            self._sample()

    def _reset_marks(self) -> None:
        """Carry the peaks so far into the open blocks, then reset the high-water marks."""
        with _open_lock:
            rss_so_far = peak_rss_bytes()
            cuda_so_far = {}
            for other in _open:
                other._rss_carry = max(other._rss_carry, rss_so_far)
                if other.device is not None:
                    torch = sys.modules["torch"]
                    key = str(other.device)
                    if key not in cuda_so_far:
                        cuda_so_far[key] = torch.cuda.max_memory_allocated(other.device)
                    other._cuda_carry = max(other._cuda_carry, cuda_so_far[key])
            self._hwm = reset_peak_rss()
            if self.device is not None:
                torch = sys.modules["torch"]
                torch.cuda.synchronize(self.device)
                self.cuda_start_bytes = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            _open.append(self)

    def __enter__(self) -> PeakMemory:
        self._rss_carry = self._cuda_carry = 0
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
        self._sample()
        with _open_lock:
            _open.remove(self)
            if self._hwm:
                self.peak_rss_bytes = max(self.peak_rss_bytes, peak_rss_bytes(),
                                          self._rss_carry)
            if self.device is not None:
                torch = sys.modules["torch"]
                torch.cuda.synchronize(self.device)
                self.cuda_peak_bytes = max(torch.cuda.max_memory_allocated(self.device),
                                           self._cuda_carry)
        self.peak_extra_rss_bytes = max(0, self.peak_rss_bytes - self.start_rss_bytes)
        self.cuda_peak_extra_bytes = max(0, self.cuda_peak_bytes - self.cuda_start_bytes)
