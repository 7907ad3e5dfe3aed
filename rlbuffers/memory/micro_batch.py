"""Gradient accumulation over micro-batches that shrink on out-of-memory and grow back.

One logical batch is split into micro-batches; each micro-batch's mean loss is
backpropagated scaled by ``len(micro) / N``, so the accumulated gradient is the full batch's.
On out-of-memory (real, or a soft budget exceeded) the micro-batch is halved and the *same*
logical batch is redone from its first micro-batch with zeroed gradients: no item is dropped
or counted twice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlbuffers.memory.budget import StepCost
from rlbuffers.memory.errors import MemoryBudgetError
from rlbuffers.memory.oom import SoftLimitExceeded, free_memory, is_out_of_memory
from rlbuffers.memory.peak import PeakMemory

log = logging.getLogger(__name__)

MicroBatchGiveUp = MemoryBudgetError  # the error raised when micro-batch 1 runs out of memory


@dataclass(frozen=True)
class MicroBatchStats:
    """What one :meth:`AdaptiveMicroBatch.run` did.

    Attributes:
        micro_batch: items per micro-batch of the attempt that succeeded (the largest one in
            token mode).
        max_tokens: token budget of that attempt (None in count mode).
        micro_steps: micro-batches run in that attempt.
        retries: attempts that ran out of memory and were redone.
        seconds: wall time of the whole call, retries included.
        loss: the logical batch's mean loss (item-weighted mean of micro-batch losses).
        peak_extra_bytes: largest measured peak over the start of the attempt (0 when no
            ``budget_bytes``, which is what turns measuring on).
    """

    micro_batch: int
    max_tokens: int | None
    micro_steps: int
    retries: int
    seconds: float
    loss: float
    peak_extra_bytes: int


def _batch_size(batch: Mapping[str, torch.Tensor]) -> int:
    if not batch:
        raise ValueError("batch: expected a non-empty mapping of tensors, got an empty one")
    sizes = {k: v.shape[0] if v.dim() else None for k, v in batch.items()}
    n = next(iter(sizes.values()))
    for key, size in sizes.items():
        if size != n or size is None:
            raise ValueError(f"batch[{key!r}]: expected leading dimension {n} (as "
                             f"{next(iter(sizes))!r}), got {size}")
    if not n:
        raise ValueError("batch: expected at least one item, got 0")
    return int(n)


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}: expected an int >= 1 or None, got {value!r}")


def _split_count(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def split_tokens(tokens: list[int], max_tokens: int) -> list[slice]:
    """Slices of consecutive items whose tokens (``tokens[i]`` per item) add up to at most
    ``max_tokens``; an item larger than that stands alone. Covers every item, in order."""
    out, start, total = [], 0, 0
    for i, t in enumerate(tokens):
        if i > start and total + t > max_tokens:
            out.append(slice(start, i))
            start, total = i, 0
        total += t
    out.append(slice(start, len(tokens)))
    return out


class AdaptiveMicroBatch:
    """Runs logical batches as micro-batches with gradient accumulation and OOM fallback.

    Args:
        module: the trained module; its parameters' ``.grad`` are set to None before each
            attempt (``run`` owns the gradients of one logical batch).
        max_micro_batch: first (and largest) micro-batch size; None: planned from
            ``budget_bytes`` and ``cost``, else the whole batch.
        budget_bytes: soft limit on the peak extra memory of an attempt (bytes above the
            memory in use when the attempt starts: CUDA allocated memory when ``module`` is
            on a CUDA device, else process RSS). Micro-batches predicted (``cost``) or
            measured (:class:`PeakMemory`) over it count as out-of-memory.
        grow_after: after this many clean ``run`` s, try a micro-batch twice as large.
        max_tokens: token-budget mode: micro-batches hold at most this many tokens (counted
            as the non-zeros of ``batch[tokens_key]``, per item) instead of a fixed count.
        cost: predicted peak per micro-batch (see :func:`probe_activation_bytes`).
        tokens_key: the batch entry whose non-zeros count an item's tokens.

    Raises:
        ValueError: sizes < 1, a negative budget, or ``grow_after`` < 1.
    """

    def __init__(self, module: torch.nn.Module, *, max_micro_batch: int | None = None,
                 budget_bytes: int | None = None, grow_after: int = 50,
                 max_tokens: int | None = None, cost: StepCost | None = None,
                 tokens_key: str = "attention_mask") -> None:
        _check_positive("max_micro_batch", max_micro_batch)
        _check_positive("max_tokens", max_tokens)
        _check_positive("grow_after", grow_after)
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes: expected >= 0 or None, got {budget_bytes}")
        self.module = module
        self.budget_bytes = budget_bytes
        self.grow_after = int(grow_after)
        self.cost = cost
        self.tokens_key = tokens_key
        self.max_micro_batch = max_micro_batch
        self.micro_batch: int | None = max_micro_batch or self._planned_size()
        self.token_ceiling = max_tokens
        self.max_tokens = max_tokens
        self.clean_runs = 0
        self.retries = 0

    def _planned_size(self) -> int | None:
        if self.budget_bytes is None or self.cost is None or not self.cost.bytes_per_item:
            return None
        room = self.budget_bytes - self.cost.fixed_bytes
        return max(1, room // self.cost.bytes_per_item)

    def _device(self) -> torch.device | None:
        p = next(self.module.parameters(), None)
        return p.device if p is not None and p.device.type == "cuda" else None

    def _zero_grads(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def _slices(self, n: int, tokens: list[int] | None) -> list[slice]:
        if tokens is not None and self.max_tokens is not None:
            return split_tokens(tokens, self.max_tokens)
        if self.micro_batch is None:
            self.micro_batch = n if self.max_micro_batch is None else \
                min(n, self.max_micro_batch)
        # A smaller logical batch runs whole but does not lower the size kept for later ones.
        return _split_count(n, min(self.micro_batch, n))

    def _check_predicted(self, slices: list[slice], tokens: list[int] | None) -> None:
        if self.cost is None or self.budget_bytes is None:
            return
        for sl in slices:
            toks = sum(tokens[sl]) if tokens is not None else 0
            need = self.cost.predict(sl.stop - sl.start, toks)
            if need > self.budget_bytes:
                raise SoftLimitExceeded(f"micro-batch of {sl.stop - sl.start} items predicted "
                                        f"at {need} bytes, over budget_bytes "
                                        f"{self.budget_bytes}")

    def _attempt(self, batch: Mapping[str, torch.Tensor], slices: list[slice],
                 step_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                 n: int) -> tuple[float, int]:
        """Run every micro-batch once; returns (mean loss, peak extra bytes)."""
        self._zero_grads()
        measure = self.budget_bytes is not None
        device = self._device()
        loss_sum, base, peak_extra = 0.0, None, 0
        for sl in slices:
            micro = {k: v[sl] for k, v in batch.items()}
            ctx = PeakMemory(device=device) if measure else contextlib.nullcontext()
            with ctx as pk:
                loss = step_fn(micro)
                (loss * ((sl.stop - sl.start) / n)).backward()
            loss_sum += float(loss.detach()) * (sl.stop - sl.start)
            del loss, micro
            if pk is not None:
                start = pk.cuda_start_bytes if device is not None else pk.start_rss_bytes
                base = start if base is None else base
                top = pk.cuda_peak_bytes if device is not None else pk.peak_rss_bytes
                peak_extra = max(peak_extra, top - base)
                if self.budget_bytes is not None and peak_extra > self.budget_bytes:
                    raise SoftLimitExceeded(f"micro-batch of {sl.stop - sl.start} items "
                                            f"peaked at {peak_extra} extra bytes, over "
                                            f"budget_bytes {self.budget_bytes}")
        return loss_sum / n, peak_extra

    def _tokens(self, batch: Mapping[str, torch.Tensor], n: int) -> list[int] | None:
        if self.max_tokens is None:
            return None
        if self.tokens_key not in batch:
            raise ValueError(f"batch: expected a {self.tokens_key!r} entry (tokens_key) in "
                             f"token mode, got keys {sorted(batch)}")
        return batch[self.tokens_key].reshape(n, -1).ne(0).sum(1).tolist()

    def _shrink(self, slices: list[slice], reason: str) -> None:
        """Halve the size after an out-of-memory, or give up at one item."""
        largest = max(sl.stop - sl.start for sl in slices)
        if largest <= 1:
            raise MemoryBudgetError(f"out of memory at micro-batch 1: nothing left to halve "
                                    f"({reason})")
        if self.max_tokens is not None:
            old, self.max_tokens = self.max_tokens, max(1, self.max_tokens // 2)
            log.warning("out of memory (%s): max_tokens %d -> %d, redoing the batch", reason,
                        old, self.max_tokens)
        else:
            old, self.micro_batch = largest, max(1, largest // 2)
            log.warning("out of memory (%s): micro-batch %d -> %d, redoing the batch",
                        reason, old, self.micro_batch)
        self.retries += 1
        self.clean_runs = 0

    def _grow(self, n: int) -> None:
        self.clean_runs += 1
        if self.clean_runs < self.grow_after:
            return
        self.clean_runs = 0
        if self.max_tokens is not None:
            ceiling = self.token_ceiling or self.max_tokens
            self.max_tokens = min(ceiling, self.max_tokens * 2)
        elif self.micro_batch is not None:
            ceiling = self.max_micro_batch or n
            self.micro_batch = min(ceiling, self.micro_batch * 2)

    def run(self, batch: Mapping[str, torch.Tensor],
            step_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> MicroBatchStats:
        """Accumulate the gradient of one logical batch over micro-batches.

        Args:
            batch: ``{name: tensor[N, ...]}``, every tensor with the same leading size N.
            step_fn: ``micro -> loss``: the mean loss over the micro-batch's items (a
                0-dim tensor); ``run`` calls ``backward`` on it, scaled by ``len/N``.

        Returns:
            :class:`MicroBatchStats`.

        Raises:
            ValueError: an empty batch, or tensors whose leading sizes differ (named).
            MemoryBudgetError: a one-item micro-batch ran out of memory.
            Exception: whatever ``step_fn`` raises that is not an out-of-memory error.
        """
        t0 = time.perf_counter()
        n = _batch_size(batch)
        tokens = self._tokens(batch, n)
        retries = 0
        while True:
            slices = self._slices(n, tokens)
            failure = None
            try:
                self._check_predicted(slices, tokens)
                loss, peak = self._attempt(batch, slices, step_fn, n)
            except Exception as e:  # re-raised below unless out of memory
                if not is_out_of_memory(e):
                    raise
                failure = f"{type(e).__name__}: {str(e)[:200]}"
            if failure is None:
                break
            self._zero_grads()
            free_memory()
            self._shrink(slices, failure)
            retries += 1
        self._grow(n)
        largest = max(sl.stop - sl.start for sl in slices)
        return MicroBatchStats(largest, self.max_tokens, len(slices), retries,
                               time.perf_counter() - t0, loss, peak)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): sizes, counters and settings."""
        return {"micro_batch": self.micro_batch, "max_tokens": self.max_tokens,
                "token_ceiling": self.token_ceiling, "clean_runs": self.clean_runs,
                "retries": self.retries, "grow_after": self.grow_after,
                "max_micro_batch": self.max_micro_batch, "budget_bytes": self.budget_bytes,
                "cost": None if self.cost is None else asdict(self.cost)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore sizes and counters from :meth:`state_dict` (settings given to the
        constructor are kept)."""
        self.micro_batch = state["micro_batch"]
        self.max_tokens = state["max_tokens"]
        self.token_ceiling = state["token_ceiling"]
        self.clean_runs = int(state["clean_runs"])
        self.retries = int(state["retries"])
