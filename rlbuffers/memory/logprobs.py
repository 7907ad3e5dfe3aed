"""Log-probabilities of chosen tokens from final hidden states, without ``[B, T, V]`` logits.

The LM head is applied ``chunk_tokens`` tokens at a time; each chunk's log-normaliser
(``logsumexp`` over the vocabulary) is computed from that chunk's logits alone, and the
backward pass (a custom :class:`torch.autograd.Function`) recomputes each chunk's logits
instead of keeping them, so forward + backward need O(``chunk_tokens`` x V) extra memory.

This is the chunked cross-entropy of Liger-Kernel / TRL's chunked LM head (online softmax:
Milakov & Gimelshein 2018, "Online normalizer calculation for softmax") written in plain
PyTorch, so it runs on CPU and GPU alike; the gradient of ``log p(y) = z_y - logsumexp(z)``
is ``onehot(y) - softmax(z)`` and that of the entropy ``H = -sum p log p`` is
``-p * (log p + H)`` (with respect to the logits ``z``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: Target ids equal to this are ignored: their log-probability is 0 and they get no gradient.
IGNORE_INDEX = -100


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                  chunk_tokens: int, temperature: float) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected an int >= 1, got {chunk_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if weight.dim() != 2:
        raise ValueError(f"lm_head_weight: expected shape [V, H], got {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden: expected shape [B, T, {weight.shape[1]}] (H of "
                         f"lm_head_weight), got {tuple(hidden.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target_ids: expected shape {tuple(hidden.shape[:-1])} (hidden's "
                         f"leading dims), got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"target_ids: expected an integer dtype, got {targets.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"lm_head_bias: expected shape ({weight.shape[0]},), "
                         f"got {tuple(bias.shape)}")
    if targets.numel():
        valid = targets[targets != IGNORE_INDEX]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= weight.shape[0]):
            raise ValueError(f"target_ids: expected ids in [0, {weight.shape[0]}) or "
                             f"{IGNORE_INDEX}, got values in [{int(valid.min())}, "
                             f"{int(valid.max())}]")


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                  targets: Tensor, low: Tensor | None = None, top: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """``float32[c, V]`` logits of one chunk, divided by the temperature, and (with ``low``)
    each token's argmax id ``int64[c, 1]``.

    ``low`` is the weight in a low-precision matmul dtype: the logits come from that matmul,
    then the target's (``targets: int64[c, 1]``) and the row maximum's (``top``, found when
    None) are recomputed as fp32 dot products, so the terms that dominate ``log p(y)`` and the
    log-normaliser carry no rounding of the low-precision output."""
    if low is None:
        z = torch.nn.functional.linear(h, weight, bias).float()
    else:
        z = torch.nn.functional.linear(h.to(low.dtype), low).float()
        if bias is not None:
            z.add_(bias.float())
        if top is None:
            top = z.argmax(dim=1, keepdim=True)
        idx = torch.cat([targets, top], dim=1)  # [c, 2]
        exact = torch.einsum("ch,ckh->ck", h.float(), weight[idx].float())
        if bias is not None:
            exact.add_(bias.float()[idx])
        z.scatter_(1, idx, exact)
    if temperature != 1.0:
        z.div_(temperature)
    return z, top


def _logsumexp_(z: Tensor) -> Tensor:
    """``logsumexp(z, -1)`` of ``z: float32[c, V]``, overwriting ``z`` (no second [c, V])."""
    m = z.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(z.dtype).min)
    return z.sub_(m).exp_().sum(-1).log_().add_(m.squeeze(1))


def _without_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(ctx, x, ...)`` run with autocast off on ``x``'s device: the matmul dtype here is
    chosen by ``matmul_dtype`` and the fp32 recomputation must stay fp32, whatever autocast
    region the caller (or the backward pass) runs in."""
    @functools.wraps(fn)
    def run(ctx: Any, x: Tensor, *args: Any) -> Any:
        with torch.autocast(x.device.type, enabled=False):
            return fn(ctx, x, *args)
    return run


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Autograd function: forward and backward one chunk of tokens at a time."""

    @staticmethod
    @_without_autocast
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy,
                low, accumulate):
        n = hidden.shape[0]
        logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32,
                              device=hidden.device)
        safe = targets.clamp(min=0).unsqueeze(1)
        top = torch.zeros((n if low is not None else 0, 1), dtype=torch.long,
                          device=hidden.device)
        for start in range(0, n, chunk_tokens):
            sl = slice(start, min(n, start + chunk_tokens))
            z, t = _chunk_logits(hidden[sl], weight, bias, temperature, safe[sl], low)
            if t is not None:
                top[sl] = t
            picked = z.gather(1, safe[sl]).squeeze(1)
            if with_entropy:
                lse[sl] = torch.logsumexp(z, dim=-1)
                z.sub_(lse[sl].unsqueeze(1))  # log p
                entropy[sl] = -(z.exp() * z).sum(-1)
            else:
                lse[sl] = _logsumexp_(z)
            logp[sl] = picked - lse[sl]
            del z  # before the next chunk's logits exist, or two chunks are alive at once
        logp.masked_fill_(targets == IGNORE_INDEX, 0.0)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, low, top)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        ctx.accumulate_into = weight if accumulate else None  # the leaf whose .grad grows
        return logp, entropy

    @staticmethod
    @_without_autocast
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, low, top = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = _weight_grad_target(weight, ctx.accumulate_into) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_b and bias is not None else None
        g_lp = grad_logp.float().masked_fill(targets == IGNORE_INDEX, 0.0)
        g_ent = grad_entropy.float() if entropy.numel() else None
        safe = targets.clamp(min=0).unsqueeze(1)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            sl = slice(start, min(hidden.shape[0], start + ctx.chunk_tokens))
            h = hidden[sl]
            g, _ = _chunk_logits(h, weight, bias, ctx.temperature, safe[sl], low,
                                 None if low is None else top[sl])
            g.sub_(lse[sl].unsqueeze(1))  # log p
            gz = _grad_wrt_logits(g, g_lp[sl], None if g_ent is None else g_ent[sl],
                                  None if g_ent is None else entropy[sl], safe[sl])
            if ctx.temperature != 1.0:
                gz.div_(ctx.temperature)
            if low is not None:  # the matmuls run in the forward's dtype, gz cast once
                gz = gz.to(low.dtype)
            mm = weight if low is None else low
            if grad_h is not None:
                grad_h[sl] = (gz.to(mm.dtype) @ mm).to(hidden.dtype)
            if grad_w is not None:
                _add_weight_grad_(grad_w, gz, h.float() if low is None else h.to(low.dtype))
            if grad_b is not None:
                grad_b.add_(gz.sum(0))
            del g, gz  # as in forward: one chunk alive at a time
        if ctx.accumulate_into is not None or grad_w is None:
            grad_w = None  # accumulated in place (or not needed)
        else:
            grad_w = grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _weight_grad_target(weight: Tensor, leaf: Tensor | None) -> Tensor:
    """Where the weight gradient is summed: the ``leaf``'s ``.grad`` (created as zeros when
    None) with ``accumulate_weight_grad``, else a new fp32 ``[V, H]``."""
    if leaf is None:
        return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if leaf.grad is None:
        leaf.grad = torch.zeros_like(leaf)
    return leaf.grad


#: Vocabulary rows of the weight gradient computed per matmul: a [V, H] product in the
#: matmul dtype is never materialised (57 MB in bf16 for SmolLM2) beside the fp32 gradient.
_VOCAB_BLOCK = 8192


def _add_weight_grad_(grad_w: Tensor, gz: Tensor, h: Tensor) -> None:
    """``grad_w += gz.T @ h`` (``grad_w: [V, H]``, ``gz: [c, V]``, ``h: [c, H]``, the same
    dtype as ``gz``), ``_VOCAB_BLOCK`` rows at a time: in place when the dtypes agree, else
    through a ``[_VOCAB_BLOCK, H]`` product."""
    same = grad_w.dtype == gz.dtype
    for v0 in range(0, grad_w.shape[0], _VOCAB_BLOCK):
        block, g = grad_w[v0:v0 + _VOCAB_BLOCK], gz[:, v0:v0 + _VOCAB_BLOCK].t()
        if same:
            block.addmm_(g, h)
        else:
            block.add_(g @ h)


def _grad_wrt_logits(logp: Tensor, g_lp: Tensor, g_ent: Tensor | None, ent: Tensor | None,
                     safe_targets: Tensor) -> Tensor:
    """Gradient with respect to the chunk's (tempered) logits; reuses ``logp``'s storage."""
    if g_ent is None or ent is None:
        p = logp.exp_()
        gz = p.mul_(-g_lp.unsqueeze(1))
    else:
        p = logp.exp()
        gz = logp.add_(ent.unsqueeze(1)).mul_(p).mul_(-g_ent.unsqueeze(1))  # dH/dz * g_ent
        gz.sub_(p.mul_(g_lp.unsqueeze(1)))
        del p
    gz.scatter_add_(1, safe_targets, g_lp.unsqueeze(1))
    return gz


def token_logprobs(hidden: Tensor, lm_head_weight: Tensor, target_ids: Tensor, *,
                   chunk_tokens: int = 1024, lm_head_bias: Tensor | None = None,
                   temperature: float = 1.0, with_entropy: bool = False,
                   matmul_dtype: torch.dtype | None = None,
                   accumulate_weight_grad: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of ``target_ids`` under ``softmax((hidden @ W.T + b) / temperature)``.

    Equal (to fp32 rounding, values and gradients) to
    ``log_softmax(logits.float() / temperature, -1).gather(-1, target_ids)`` but computed
    ``chunk_tokens`` tokens at a time, never holding more than one chunk's logits, in forward
    or backward (the backward recomputes each chunk; see the module docstring).

    Args:
        hidden: ``float[B, T, H]`` (any leading dims) final hidden states, any float dtype.
        lm_head_weight: ``float[V, H]`` output-embedding matrix.
        target_ids: ``int[B, T]`` (hidden's leading dims) token ids in ``[0, V)``; positions
            equal to ``-100`` are ignored (log-probability 0, no gradient).
        chunk_tokens: tokens per chunk (>= 1); peak extra memory ~ 3 x 4 x chunk_tokens x V
            bytes in backward.
        lm_head_bias: optional ``float[V]`` bias.
        temperature: logits are divided by it (> 0), as samplers do.
        with_entropy: also return the entropy of each position's distribution.
        matmul_dtype: run the LM head's matmuls (forward, and backward's two) in this dtype,
            e.g. ``torch.bfloat16`` (~2.4x the fp32 matmul rate on CPUs with AVX512-BF16),
            the weight cast once per call. The low-precision logits are then corrected where
            their rounding matters most: the target's and the row maximum's logits are
            recomputed as fp32 dot products, so ``log p(y)`` carries no rounding of the
            target logit and the log-normaliser only the rounding of the non-maximal terms,
            weighted by their probabilities (e.g. a peaked distribution: ~1e-3 nats against
            ~3e-2 for plain bf16 logits). Softmax and gradients with respect to the logits
            stay fp32; the gradients with respect to ``hidden`` and the weight are computed
            by matmuls in ``matmul_dtype`` (as autocast does for every other linear layer).
            None: the weight's dtype, with fp32 logits. An autocast region around the call
            changes nothing (autocast is off inside, forward and backward).
        accumulate_weight_grad: the backward pass adds the weight's gradient straight into
            ``lm_head_weight.grad`` (a leaf: a parameter; created as zeros when None) and
            hands autograd no gradient for it, so no ``[V, H]`` fp32 gradient buffer is
            allocated per call (113 MB for SmolLM2; one per micro-batch in a gradient
            accumulation loop, plus autograd's sum with a tied input embedding's). For
            loops that call ``backward()`` and step on ``.grad``: hooks on the weight,
            ``torch.autograd.grad`` and gradient-reducing wrappers (DDP, FSDP) do not see
            this contribution.

    Returns:
        ``logprobs: float32[B, T]``, and ``entropy: float32[B, T]`` (nats) when
        ``with_entropy``. Both are differentiable with respect to ``hidden``,
        ``lm_head_weight`` and ``lm_head_bias``.

    Raises:
        ValueError: ``chunk_tokens`` < 1, ``temperature`` <= 0, shapes that do not match
            (the message names the argument, the expected and the actual shape), ids out
            of range, or ``accumulate_weight_grad`` with a weight that is not a leaf.
    """
    _check_inputs(hidden, lm_head_weight, target_ids, lm_head_bias, chunk_tokens, temperature)
    if matmul_dtype is not None and not (isinstance(matmul_dtype, torch.dtype)
                                         and matmul_dtype.is_floating_point):
        raise ValueError(f"matmul_dtype: expected a floating torch.dtype or None, "
                         f"got {matmul_dtype!r}")
    if accumulate_weight_grad and not lm_head_weight.is_leaf:
        raise ValueError("lm_head_weight: accumulate_weight_grad needs a leaf tensor (a "
                         "parameter, whose .grad it adds to), got the output of an operation")
    lead = hidden.shape[:-1]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    low = None
    if matmul_dtype is not None and matmul_dtype != torch.float32:
        low = lm_head_weight.detach().to(matmul_dtype)
    logp, entropy = _ChunkedTokenLogprobs.apply(
        flat_h, lm_head_weight, lm_head_bias, target_ids.reshape(-1).long(), float(temperature),
        int(chunk_tokens), bool(with_entropy), low, bool(accumulate_weight_grad))
    if with_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)
