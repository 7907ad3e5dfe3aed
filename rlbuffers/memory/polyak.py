"""Chunked in-place Polyak (soft target) update: ``target <- (1 - tau) * target + tau * source``.

Polyak & Juditsky (1992) averaging as used for target networks in DDPG (Lillicrap et al.
2016, Algorithm 1, last line). Done parameter by parameter and in slices of at most
``chunk_bytes``, so a target on CPU can follow a source on GPU with only one slice copied
at a time.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 16 * 2**20


def _float_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    out.update({k: b for k, b in module.named_buffers() if b.is_floating_point()})
    return out


def _check(target: dict[str, torch.Tensor], source: dict[str, torch.Tensor], tau: float,
           chunk_bytes: int) -> None:
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau: expected in [0, 1], got {tau!r}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
    if target.keys() != source.keys():
        missing = sorted(target.keys() ^ source.keys())[:5]
        raise ValueError(f"source: expected the target's parameter and float buffer names, "
                         f"these differ: {missing}")
    for name, t in target.items():
        if t.shape != source[name].shape:
            raise ValueError(f"source[{name!r}]: expected shape {tuple(t.shape)} (target), "
                             f"got {tuple(source[name].shape)}")


def _slices(t: torch.Tensor, s: torch.Tensor,
            chunk_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching views of ``t`` and ``s`` of at most ``chunk_bytes`` of the larger element
    size (whole rows of dim 0 when either is not contiguous)."""
    item = max(t.element_size(), s.element_size())
    if t.is_contiguous() and s.is_contiguous() or t.dim() == 0:
        tf, sf = t.reshape(-1), s.reshape(-1)
        step = max(1, chunk_bytes // item)
        return [(tf[i:i + step], sf[i:i + step]) for i in range(0, tf.numel(), step)]
    row = max(1, t[0].numel() * item)
    step = max(1, chunk_bytes // row)
    return [(t[i:i + step], s[i:i + step]) for i in range(0, t.shape[0], step)]


@torch.no_grad()
def polyak_update_(target: torch.nn.Module, source: torch.nn.Module, tau: float, *,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """In place: ``target <- (1 - tau) * target + tau * source`` over every parameter and
    floating-point buffer, slice by slice.

    Args:
        target: module updated in place (any device and float dtype).
        source: module with the same parameter and float-buffer names and shapes (any
            device; each slice is copied to the target's device and dtype).
        tau: weight of the source, in [0, 1] (1 copies the source).
        chunk_bytes: largest slice moved and combined at once; the peak extra memory is
            about one slice on the target's device (plus its dtype conversion).

    Raises:
        ValueError: ``tau`` outside [0, 1], ``chunk_bytes`` < 1, or names or shapes that
            differ between target and source (named).
    """
    tgt, src = _float_tensors(target), _float_tensors(source)
    _check(tgt, src, tau, chunk_bytes)
    for name, t in tgt.items():
        for t_part, s_part in _slices(t, src[name], chunk_bytes):
            s_local = s_part.to(device=t_part.device, dtype=t_part.dtype)
            t_part.mul_(1.0 - tau).add_(s_local, alpha=tau)
            del s_local
