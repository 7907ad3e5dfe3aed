"""Memory budgets and plans: what a model costs to train, what a step costs per item, how
large a micro-batch fits, and how much memory this machine offers. All sizes in bytes.

These replace hand-written tiers ("if more than 40 GB then batch 16") with a measured cost:
``peak(step of n items) ~ fixed_bytes + n * (bytes_per_item + tokens_per_item *
bytes_per_token)``, fitted by :func:`probe_activation_bytes`.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlbuffers.memory.errors import MemoryBudgetError
from rlbuffers.memory.limits import available_bytes
from rlbuffers.memory.oom import free_memory
from rlbuffers.memory.peak import PeakMemory

log = logging.getLogger(__name__)

#: Optimizer state tensors per trainable parameter (each the parameter's size and dtype).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "rmsprop": 1,
                    "adagrad": 1, "none": 0}


@dataclass(frozen=True)
class TrainingBytes:
    """Bytes that training a model holds besides activations.

    Attributes:
        weights, gradients, optimizer_state: bytes of each; ``total`` their sum.
        trainable_params: number of trainable parameters.
    """

    weights: int
    gradients: int
    optimizer_state: int
    trainable_params: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state


def estimate_training_bytes(model: torch.nn.Module, *, optimizer: str = "adamw",
                            trainable: Collection[str] | None = None,
                            dtype: torch.dtype | None = None) -> TrainingBytes:
    """Weights, gradients and optimizer state of training ``model``, from its parameters.

    Args:
        model: the module (parameters shared between submodules are counted once).
        optimizer: a key of :data:`OPTIMIZER_STATES` (``"adamw"``: 2 states per parameter).
        trainable: names (as in ``named_parameters()``) of the trained parameters; None:
            those with ``requires_grad``.
        dtype: element type of weights, gradients and states; None: each parameter's own.

    Raises:
        ValueError: an unknown optimizer or a trainable name the model does not have.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, "
                         f"got {optimizer!r}")
    params = dict(model.named_parameters())
    if trainable is not None:
        unknown = sorted(set(trainable) - set(params))
        if unknown:
            raise ValueError(f"trainable: names not in the model: {unknown[:5]}")
    weights = grads = n_train = 0
    for name, p in params.items():
        size = p.numel() * (p.element_size() if dtype is None else
                            torch.empty((), dtype=dtype).element_size())
        weights += size
        if (p.requires_grad if trainable is None else name in trainable):
            grads += size
            n_train += p.numel()
    return TrainingBytes(weights, grads, grads * OPTIMIZER_STATES[optimizer], n_train)


@dataclass(frozen=True)
class StepCost:
    """Predicted peak extra bytes of one training step: ``fixed_bytes + items *
    bytes_per_item + tokens * bytes_per_token``.

    Raises:
        ValueError: a negative field.
    """

    fixed_bytes: int = 0
    bytes_per_item: int = 0
    bytes_per_token: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise ValueError(f"{name}: expected >= 0, got {value}")

    def predict(self, items: int, tokens: int = 0) -> int:
        """Predicted peak extra bytes of a step over ``items`` items holding ``tokens``."""
        return self.fixed_bytes + items * self.bytes_per_item + tokens * self.bytes_per_token

    def state_dict(self) -> dict[str, int]:
        return asdict(self)


def _measure(step_fn: Callable[[Any], Any], batch: Any, device: Any) -> int:
    free_memory()
    with PeakMemory(device=device) as peak:
        step_fn(batch)
    return peak.peak_extra_bytes


def probe_activation_bytes(step_fn: Callable[[Any], Any], make_batch: Callable[[int], Any], *,
                           sizes: tuple[int, int] = (1, 2), tokens_per_item: int | None = None,
                           device: Any = None) -> StepCost:
    """Measure a step's memory at two batch sizes and fit :class:`StepCost`.

    ``step_fn(make_batch(n))`` (forward + backward) is run once untimed at ``sizes[0]`` (so
    gradients and allocator caches exist), then measured under :class:`PeakMemory` at each
    size; the difference gives the cost per item (or per token, when ``tokens_per_item`` is
    given), the rest is fixed.

    Args:
        step_fn: runs one step on a batch.
        make_batch: ``n -> batch`` of ``n`` items.
        sizes: two distinct item counts, smallest first.
        tokens_per_item: tokens in each item of ``make_batch``; when given, the per-item cost
            is reported per token.
        device: CUDA device to measure (``max_memory_allocated``); None: process RSS.

    Raises:
        ValueError: ``sizes`` not two increasing counts >= 1.
    """
    n1, n2 = sizes
    if not 1 <= n1 < n2:
        raise ValueError(f"sizes: expected two increasing counts >= 1, got {sizes}")
    step_fn(make_batch(n1))
    p1 = _measure(step_fn, make_batch(n1), device)
    p2 = _measure(step_fn, make_batch(n2), device)
    per_item = max(0, math.ceil((p2 - p1) / (n2 - n1)))
    fixed = max(0, p1 - per_item * n1)
    if tokens_per_item:
        cost = StepCost(fixed, 0, math.ceil(per_item / tokens_per_item))
    else:
        cost = StepCost(fixed, per_item, 0)
    log.info("probed step cost: %s", cost)
    return cost


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batch size and gradient-accumulation steps for one effective batch.

    Attributes:
        micro_batch: items per micro-batch.
        accumulation_steps: micro-batches per effective batch
            (``micro_batch * accumulation_steps >= target_batch``).
        predicted_peak_bytes: :meth:`StepCost.predict` of one micro-batch.
    """

    micro_batch: int
    accumulation_steps: int
    predicted_peak_bytes: int


def plan_micro_batch(budget_bytes: int, *, cost: StepCost, target_batch: int,
                     tokens_per_item: int = 0,
                     max_micro_batch: int | None = None) -> MicroBatchPlan:
    """Largest micro-batch whose predicted peak fits ``budget_bytes``, split evenly over the
    fewest accumulation steps that reach ``target_batch``.

    Raises:
        ValueError: a negative budget, ``target_batch`` < 1 or ``max_micro_batch`` < 1.
        MemoryBudgetError: not even one item fits the budget.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes: expected >= 0, got {budget_bytes}")
    if target_batch < 1:
        raise ValueError(f"target_batch: expected >= 1, got {target_batch}")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise ValueError(f"max_micro_batch: expected >= 1, got {max_micro_batch}")
    per_item = cost.bytes_per_item + tokens_per_item * cost.bytes_per_token
    room = budget_bytes - cost.fixed_bytes
    fits = target_batch if per_item == 0 and room >= 0 else max(0, room) // max(per_item, 1)
    if fits < 1:
        raise MemoryBudgetError(f"budget_bytes: {budget_bytes} does not fit one item "
                                f"(predicted {cost.predict(1, tokens_per_item)} bytes)")
    micro = min(fits, target_batch, max_micro_batch or target_batch)
    steps = math.ceil(target_batch / micro)
    micro = math.ceil(target_batch / steps)
    return MicroBatchPlan(micro, steps, cost.predict(micro, micro * tokens_per_item))


def auto_budget(*, device: Any = None, safety_fraction: float = 0.1,
                safety_bytes: int = 512 * 2**20) -> int:
    """Bytes a training step may still use on ``device``: CUDA free memory (plus blocks
    torch has cached but not allocated), else available RAM under any cgroup limit, less
    ``safety_fraction`` of it and ``safety_bytes``; never negative.

    Raises:
        ValueError: ``safety_fraction`` outside [0, 1) or negative ``safety_bytes``.
    """
    if not 0 <= safety_fraction < 1:
        raise ValueError(f"safety_fraction: expected in [0, 1), got {safety_fraction}")
    if safety_bytes < 0:
        raise ValueError(f"safety_bytes: expected >= 0, got {safety_bytes}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and "torch" in sys.modules:
        free, _ = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    else:
        free = available_bytes()
    return max(0, int(free * (1 - safety_fraction)) - int(safety_bytes))
