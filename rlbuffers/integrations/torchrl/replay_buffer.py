"""ZarrTensorDictPrioritizedReplayBuffer: TorchRL's ``TensorDictPrioritizedReplayBuffer`` with
:class:`ZarrPrioritizedSampler` in place of TorchRL's compiled one."""

from __future__ import annotations

from typing import Any

from rlbuffers.integrations import require

require("torchrl", "torchrl")

from torchrl.data import TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer  # noqa: E402

from rlbuffers.integrations.torchrl.sampler import ZarrPrioritizedSampler  # noqa: E402
from rlbuffers.integrations.torchrl.storage import ZarrStorage  # noqa: E402

__all__ = ["ZarrTensorDictPrioritizedReplayBuffer"]


class ZarrTensorDictPrioritizedReplayBuffer(TensorDictPrioritizedReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer`` over a :class:`ZarrStorage`, sampling
    with :class:`ZarrPrioritizedSampler` (proportional prioritized replay, Schaul et al., ICLR
    2016, Eq. 1 and the importance weights of Sec. 3.4).

    TorchRL's class builds its own ``PrioritizedSampler`` in ``__init__``, whose sum tree is
    in TorchRL's compiled extension (which does not load beside every torch: then the
    constructor raises ``SumSegmentTreeFp32 is not available``). This class is that class
    with the sampler swapped and everything else TorchRL's: ``extend`` sets the priorities
    given under ``priority_key`` (default priority otherwise), ``sample`` writes ``"index"``
    and ``"priority_weight"`` (float32[B]) into the batch, ``update_tensordict_priority(batch)``
    sets ``(|batch[priority_key]| + eps)^alpha`` for the sampled rows. The priorities are
    committed with the rows by ``storage.commit()``; a buffer built on a reopened storage
    samples at once, the same stream as an uninterrupted one.

    Args:
        alpha: prioritization exponent, >= 0.
        beta: importance-sampling exponent, in [0, 1] (anneal with ``rb.sampler.beta = b``).
        storage: the :class:`ZarrStorage` (required: the priorities live in its buffer).
        priority_key: the TensorDict key of the priorities (default ``"td_error"``).
        eps: added to every ``|priority|``, > 0.
        reduction: how a row's several priorities reduce to one (``"max"``, ``"min"``,
            ``"sum"``, ``"mean"``, ``"median"``).
        **kwargs: passed to TorchRL's ``TensorDictReplayBuffer`` (``batch_size``,
            ``transform``, ``collate_fn``, ``prefetch``, ``sample_unit``, ...).

    Raises:
        TypeError: ``storage`` is not a ZarrStorage.
        ValueError: ``sync=False`` (TorchRL's mode for writer processes sharing the buffer;
            a ZarrStorage is shared by its path, not by pickling), ``sampler_device`` other
            than CPU, or an argument out of range (named by ZarrPrioritizedSampler).
    """

    def __init__(self, *, alpha: float, beta: float, storage: ZarrStorage,
                 priority_key: Any = "td_error", eps: float = 1e-8, reduction: str = "max",
                 sync: bool = True, sampler_device: Any = None, **kwargs: Any) -> None:
        if not isinstance(storage, ZarrStorage):
            raise TypeError(f"ZarrTensorDictPrioritizedReplayBuffer storage: expected a "
                            f"ZarrStorage, got {type(storage).__name__}")
        if sync is not True:
            raise ValueError("ZarrTensorDictPrioritizedReplayBuffer sync: expected True, got "
                             f"{sync!r} (writer processes share a ZarrStorage by its path)")
        if sampler_device not in (None, "cpu"):
            raise ValueError("ZarrTensorDictPrioritizedReplayBuffer sampler_device: expected "
                             f"None or 'cpu' (the sum tree is numpy), got {sampler_device!r}")
        sampler = ZarrPrioritizedSampler(storage.max_size, alpha, beta, eps, reduction=reduction)
        # the attributes TorchRL's __init__ sets before it builds its own sampler
        self._sync = True
        self._prioritized_sampler = None
        self._prioritized_sampler_write_count = 0
        TensorDictReplayBuffer.__init__(self, priority_key=priority_key, storage=storage,
                                        sampler=sampler, **kwargs)
