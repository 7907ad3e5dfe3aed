"""The batch type of the streaming pipeline: a ``dict`` of arrays (numpy, or torch tensors with
``as_torch``) and nothing else, so the usual loops over it work as they are::

    batch = {k: v.to(device) for k, v in batch.items()}   # or: batch = batch.to(device)

The two entries that are not arrays are attributes: ``max_seqlen`` (an ``int``, what
flash-attention's varlen kernels take beside ``cu_seqlens``) and ``stats`` (a ``dict`` of
counts and fractions). This is the shape of HF transformers' ``BatchEncoding`` (a mapping of
tensors with ``.to(device)``), kept to a plain ``dict`` subclass: ``batch["input_ids"]`` and
``.items()`` work as on a dict, and pickling (into and out of DataLoader workers) keeps the
attributes.
"""

from __future__ import annotations

from typing import Any

#: The former entries that are attributes now (a lookup by key says so).
ATTRIBUTES = ("max_seqlen", "stats")


class StreamBatch(dict):  # type: ignore[type-arg]
    """One batch: ``name -> array`` (see :mod:`rlbuffers.stream.padding` for the keys, shapes
    and dtypes), every value an ``np.ndarray`` or a ``torch.Tensor``.

    Attributes:
        max_seqlen: the longest segment of ``cu_seqlens`` (padding tails included).
        stats: ``num_sequences``, ``num_tokens``, ``padding_fraction``,
            ``packing_efficiency``, ``truncated_tokens`` and the loader's counters (see
            ``docs/stream.md``, "Counters").
    """

    max_seqlen: int
    stats: dict[str, Any]

    def __init__(self, arrays: Any = (), /, *, max_seqlen: int,
                 stats: dict[str, Any] | None = None) -> None:
        super().__init__(arrays)
        self.max_seqlen = int(max_seqlen)
        self.stats = {} if stats is None else stats

    def __missing__(self, key: Any) -> Any:
        if key in ATTRIBUTES:
            raise KeyError(f"{key!r} is an attribute of the batch, not an entry (the entries are "
                           f"arrays only, so a loop moving them to a device works): use "
                           f"batch.{key}")
        raise KeyError(key)

    def to(self, device: Any, *, non_blocking: bool = False) -> StreamBatch:
        """A new batch with every array as a ``torch.Tensor`` on ``device`` (numpy arrays are
        converted with ``torch.from_numpy`` first, sharing memory on the CPU); the same
        ``max_seqlen`` and a copy of ``stats``."""
        import torch

        return StreamBatch(
            {k: (torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v).to(
                device, non_blocking=non_blocking) for k, v in self.items()},
            max_seqlen=self.max_seqlen, stats=dict(self.stats))

    def __repr__(self) -> str:
        arrays = ", ".join(f"{k!r}: {type(v).__name__}{list(v.shape)} {v.dtype}"
                           for k, v in self.items())
        return f"StreamBatch({{{arrays}}}, max_seqlen={self.max_seqlen}, stats={self.stats})"
