"""Sampling completions from a causal LM on CPU or GPU: batched decoding with the KV cache
under a memory budget (halved on out-of-memory), each prompt's cache computed once and shared by
its group of samples (prefix sharing), finished sequences dropped from the batch, tokens drawn
by inverting the CDF. Used by the LLM trainers."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from rlbuffers.memory.oom import free_memory, is_out_of_memory
from trainers.llm.settings import Sampling

log = logging.getLogger("trainers.generation")


def kv_bytes_per_token(config: Any) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 4


def generation_batch(sampling: Sampling, model: Any, n: int, longest_prompt: int) -> int:
    """Sequences per generate call: at most ``sampling.generation_batch`` (0: no cap) and
    what ``sampling.memory_budget`` allows (KV cache of prompt + completion plus two fp32 rows
    of logits per sequence)."""
    cap = min(n, sampling.generation_batch or n)
    budget = sampling.memory_budget
    if budget is None:
        return cap
    per_seq = (longest_prompt + sampling.max_completion_tokens) \
        * kv_bytes_per_token(model.config) + 2 * 4 * model.config.vocab_size
    return max(1, min(cap, budget // per_seq))


#: torch intra-op threads of greedy decoding (evaluation), whatever the caller's setting: a
#: CPU matrix product's summation order may depend on the thread count (MKL's sgemm gives
#: different fp32 bits with 1 and 2 threads for some row counts: 4-15 rows of 576 x 576 on
#: this machine's Xeon), and greedy tokens follow the bits (one checkpoint scored 24/400
#: with --threads 2 and 25/400 with --threads 1; issue 49).
EVAL_THREADS = 1


@contextmanager
def fixed_threads(n: int) -> Iterator[None]:
    """For the ``with`` block, ``torch.set_num_threads(n)``; the caller's count is put back
    afterwards (also on error)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@torch.no_grad()
def generate(model: Any, tok: Any, prompts: list[np.ndarray], sampling: Sampling, *,
             n_per_prompt: int, greedy: bool = False, max_new: int | None = None,
             on_finished: Callable[[int], None] | None = None
             ) -> list[tuple[np.ndarray, bool]]:
    """``n_per_prompt`` completions of each prompt (int64 token arrays ending at the first EOS,
    which they keep, and whether they were cut at the length limit), in prompt order, with the
    KV cache, in batches under the memory budget (halved on out-of-memory). A prompt's KV cache
    is computed once and copied to its ``n_per_prompt`` sequences (prefix sharing).
    ``on_finished(k)``: told as sequences finish, ``k`` at a time (a "k of n" heartbeat).
    ``greedy`` decoding (evaluation) runs on :data:`EVAL_THREADS` threads whatever the
    caller's setting, so its tokens do not depend on it."""
    model.eval()
    dtype = getattr(torch, sampling.generate_dtype)
    with fixed_threads(EVAL_THREADS) if greedy else nullcontext(), \
            merged_lora(model, dtype), weights_as(model, dtype):
        return _generate(model, tok, prompts, sampling, n_per_prompt, greedy, max_new,
                         on_finished)


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))


@functools.cache
def _warn_once(dtype: torch.dtype, reason: str) -> None:
    """One warning per process for each (dtype, reason) oneDNN gives for refusing to reorder
    (``functools.cache`` keeps the pairs seen): a trainer generates every step, and a bfloat16
    refusal (oneDNN's bf16 path needs AVX-NE-CONVERT or AVX512 BW, VL and DQ) would otherwise
    repeat on each call."""
    log.warning("oneDNN weight reordering unavailable for %s (%s): plain linears%s", dtype,
                reason, "; on a CPU without bf16 units a bfloat16 matmul is far slower than a "
                "float32 one (generate in float32)" if dtype == torch.bfloat16 else "")


@contextmanager
def packed_linears(model: Any, rows: int, enabled: bool = True) -> Iterator[None]:
    """For the ``with`` block, every ``torch.nn.Linear`` of a CPU ``model`` (float32 or
    bfloat16) computes its product with a copy of its weight reordered for oneDNN's matmul
    (``torch.ops.mkldnn._reorder_linear_weight``, blocked for ``rows`` input rows: the decoding
    batch), instead of MKL's GEMM on the plain ``[out, in]`` weight, which on small batches
    reads the weights at a fraction of the memory bandwidth. The 30 layers' linears of
    SmolLM2-135M for 16 rows: 37-48 ms per decoding step against 77-86 ms in float32, 19
    against 30 ms in bfloat16 (AMD EPYC, 2 threads); a 600-row prefill 640 against 840 ms.
    The results equal the plain product up to float rounding (a different summation order).

    Only under ``torch.no_grad``: with gradients enabled a layer runs its own ``forward``.
    Extra memory: the reordered copies (the linear weights' bytes) while the block runs.
    Off CPU, without oneDNN, with ``enabled`` False, or when the reordering fails (logged once
    per process and reason): nothing changes. The weights are read when the block starts:
    they must not change inside it."""
    if not enabled or model.device.type != "cpu" or not _packing_available():
        yield
        return
    patched = []
    try:
        for module in model.modules():
            if type(module) is not torch.nn.Linear \
                    or module.weight.dtype not in (torch.float32, torch.bfloat16):
                continue
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(),
                                                                 max(1, rows))
            except RuntimeError as e:  # this CPU / build refuses it: plain products
                _warn_once(module.weight.dtype, str(e))
                break
            bias = None if module.bias is None else module.bias.detach()
            module.forward = functools.partial(_packed_forward, module, packed, bias)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _packed_forward(module: torch.nn.Linear, packed: torch.Tensor, bias: torch.Tensor | None,
                    x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != module.weight.dtype:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@contextmanager
def weights_as(model: Any, dtype: torch.dtype) -> Iterator[None]:
    """For the ``with`` block, every floating-point parameter of ``model`` holds a ``dtype``
    copy of its values (e.g. bfloat16, for CPUs with bf16 matrix units); the original tensors
    are put back untouched afterwards (the fp32 master weights never round-trip). Extra memory:
    the copies, while the block runs. Parameters already in ``dtype``: nothing changes."""
    originals = []
    try:
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                originals.append((param, param.data))
                param.data = param.data.to(dtype)
        yield
    finally:
        for param, data in originals:
            param.data = data


@contextmanager
def merged_lora(model: Any, dtype: torch.dtype | None = None) -> Iterator[None]:
    """For the ``with`` block, a peft LoRA model runs as its base model with merged weights
    ``W + scale * B @ A`` (new tensors swapped in, in ``dtype`` when given, else ``W``'s; the
    original ``W`` tensors are put back untouched afterwards, so nothing drifts as peft's
    merge / unmerge would): decoding pays no per-layer adapter matmuls. Extra memory: the
    merged copies of the adapted weights (in ``dtype``: a bf16 merge costs half the bytes of
    an fp32 one and no fp32 copy), while the block runs. Any other model: nothing changes."""
    if not hasattr(model, "disable_adapter"):
        yield
        return
    from peft.tuners.lora import Linear as LoraLinear

    originals = []
    try:
        for module in model.modules():
            if isinstance(module, LoraLinear) and not module.merged and not module.disable_adapters:
                weight = module.get_base_layer().weight
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters
                            if a in module.lora_A)
                originals.append((weight, weight.data))
                weight.data = (weight.data + delta).to(dtype or weight.dtype)
        with model.disable_adapter() if originals else nullcontext():
            yield
    finally:
        for weight, data in originals:
            weight.data = data


def _generate(model: Any, tok: Any, prompts: list[np.ndarray], sampling: Sampling,
              n_per_prompt: int, greedy: bool, max_new: int | None,
              on_finished: Callable[[int], None] | None = None
              ) -> list[tuple[np.ndarray, bool]]:
    max_new = max_new or sampling.max_completion_tokens
    size = generation_batch(sampling, model, len(prompts) * n_per_prompt,
                            max(map(len, prompts)))
    with packed_linears(model, size, enabled=sampling.packed_weights):
        out: list[tuple[np.ndarray, bool]] = []
        eos = tok.eos_token_id
        done = 0  # sequences finished, in prompt order
        while done < len(prompts) * n_per_prompt:
            if size >= n_per_prompt:  # whole groups: prompts done // n .. , each copied n times
                first = done // n_per_prompt
                part, copies = prompts[first:first + size // n_per_prompt], n_per_prompt
            else:  # fewer sequences than a group per call: no sharing
                part, copies = [prompts[done // n_per_prompt]] * min(
                    size, n_per_prompt - done % n_per_prompt), 1
            try:
                rows = _generate_call(model, tok, part, copies, sampling, greedy, max_new,
                                      on_finished)
            except Exception as e:
                if not is_out_of_memory(e) or size == 1:
                    raise
                free_memory()
                log.warning("out of memory generating %d sequences: batch %d -> %d",
                            len(part) * copies, size, size // 2)
                size //= 2
                continue
            for row in rows:
                ends = np.flatnonzero(row == eos)
                out.append((row[:ends[0] + 1], False) if len(ends) else (row, True))
            done += len(rows)
        return out


def _generate_call(model: Any, tok: Any, prompts: list[np.ndarray], copies: int,
                   sampling: Sampling, greedy: bool, max_new: int,
                   on_finished: Callable[[int], None] | None = None) -> np.ndarray:
    """One ``generate`` call: ``copies`` samples of each prompt (left padded); with copies > 1
    the prompts (but their last token) are run once and the cache repeated. Returns the new
    tokens ``int64[len(prompts) * copies, <= max_new]``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.from_numpy(p.astype(np.int64))
        att[i, width - len(p):] = 1
    ids, att = ids.to(model.device), att.to(model.device)  # the model's device (CPU or GPU)
    cache = None
    if copies > 1 and width > 1:
        pos = (att.cumsum(-1) - 1).clamp(min=0)  # as generate() makes them from the mask
        cache = model(input_ids=ids[:, :-1], attention_mask=att[:, :-1],
                      position_ids=pos[:, :-1], use_cache=True, logits_to_keep=1)
        cache = getattr(cache, _cache_kwarg())  # the output's name for it, without warning
        cache.batch_repeat_interleave(copies)
    ids, att = ids.repeat_interleave(copies, 0), att.repeat_interleave(copies, 0)
    draw = None if greedy else sampling_processors(sampling.temperature, sampling.top_p)
    return decode(model, ids, att, cache, max_new, tok.eos_token_id, tok.pad_token_id,
                  draw, on_finished=on_finished).cpu().numpy()


@torch.no_grad()
def decode(model: Any, ids: torch.Tensor, att: torch.Tensor, cache: Any, max_new: int,
           eos: int, pad: int, draw: Any = None, compact_at: float = 0.125,
           on_finished: Callable[[int], None] | None = None) -> torch.Tensor:
    """Decoding with the KV cache that drops finished sequences from the batch.

    ``generate`` keeps every sequence in the batch until the last one ends, so a step costs
    the same with 32 sequences alive as with 1 (GRPO completions of up to 256 tokens end at
    ~190 on average); here, once the finished sequences still in the batch reach
    ``compact_at`` of it, they are removed from the inputs and the cache
    (``batch_select_indices``), whose growth per step is then for the live ones only.

    Args:
        ids, att: int64 ``[B, W]`` left-padded prompts and their attention mask (1 = token).
        cache: the KV cache of ``ids[:, :-1]`` (e.g. a prompt's, repeated for its group), or
            None to compute the prompts' cache here.
        max_new: most new tokens per sequence.
        eos, pad: end-of-sequence and padding token ids.
        draw: ``transformers`` logits processors choosing the token (see
            :func:`sampling_processors`), or None for greedy (argmax) decoding.
        compact_at: fraction of the batch that finished sequences may occupy before they are
            dropped (0: at every step where one ended).
        on_finished: called with how many sequences finished (``eos``; at the end, the ones
            cut at ``max_new``) since its last call, so that the calls add up to ``B``.

    Returns:
        int64 ``[B, S]`` new tokens, ``S <= max_new`` (the steps run: decoding stops when
        every sequence has produced ``eos``), ``pad`` after a sequence's ``eos``: the same
        tokens as ``generate(..., do_sample=False, logits_processor=draw)`` under greedy
        decoding (the sampling stream differs once a sequence is dropped: fewer rows draw).
    """
    name = _cache_kwarg()
    out = torch.full((len(ids), max_new), pad, dtype=torch.long, device=ids.device)
    live = torch.arange(len(ids), device=ids.device)  # the batch rows' sequence numbers
    ended = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)  # per batch row
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    if cache is None:
        inputs = {"input_ids": ids, "position_ids": pos}
    else:
        inputs = {"input_ids": ids[:, -1:], "position_ids": pos[:, -1:], name: cache}
    steps = told = 0  # told: sequences of the current batch rows reported to on_finished
    for t in range(max_new):
        res = model(**inputs, attention_mask=att, use_cache=True, logits_to_keep=1)
        cache, scores = getattr(res, name), res.logits[:, -1].float()
        if t == 0:  # room for every token still to come: no torch.cat of the cache per step
            preallocate(cache, max_new - 1)
        token = scores.argmax(-1) if draw is None else draw(None, scores).argmax(-1)
        token = token.masked_fill(ended, pad)
        out[live, t] = token
        steps = t + 1
        ended |= token == eos
        if on_finished is not None and int(ended.sum()) > told:
            on_finished(int(ended.sum()) - told)
            told = int(ended.sum())
        if bool(ended.all()):
            break
        if bool(ended.any()) and int(ended.sum()) >= compact_at * len(ended):
            keep = (~ended).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            live, ended, token, att = live[keep], ended[keep], token[keep], att[keep]
            told = 0
        att = torch.cat([att, att.new_ones((len(att), 1))], -1)
        inputs = {"input_ids": token[:, None], "position_ids": att.sum(-1, keepdim=True) - 1,
                  name: cache}
    if on_finished is not None and len(ended) > told:  # cut at max_new
        on_finished(len(ended) - told)
    return out[:, :steps]


def preallocate(cache: Any, tokens: int) -> None:
    """Give each plain ``DynamicLayer`` of a ``transformers`` KV cache (``cache.layers``)
    room for ``tokens`` more tokens: its keys and values become views of buffers ``[B,
    heads, length + tokens, head_dim]`` that later steps write into, instead of the
    ``torch.cat`` of the whole cache per layer and step that ``DynamicLayer.update`` does (a
    step of 16 sequences with 150-token prompts spent 35% of its time in that copy on CPU).
    Caches without ``layers`` (transformers < 4.56) or other layer types are left as they are."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            layers[i] = _preallocated_layer_class()(layer.keys, layer.values, tokens)


@functools.cache
def _preallocated_layer_class() -> Any:
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys`` / ``values`` are views of the first ``n`` tokens
        of buffers with spare room (``_k``, ``_v``: ``[B, heads, capacity, head_dim]``); a
        buffer out of room is doubled (as a list grows)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, tokens: int) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            n = keys.shape[2]
            self._k, self._v = self._room(keys, n + tokens), self._room(values, n + tokens)
            self._k[:, :, :n], self._v[:, :, :n] = keys, values
            self._view(n)

        @staticmethod
        def _room(t: torch.Tensor, capacity: int) -> torch.Tensor:
            return t.new_empty((t.shape[0], t.shape[1], capacity, t.shape[3]))

        def _view(self, n: int) -> None:
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            start = self.keys.shape[2]
            n = start + key_states.shape[2]
            if n > self._k.shape[2]:
                cap = max(n, 2 * self._k.shape[2])
                k, v = self._room(self._k, cap), self._room(self._v, cap)
                k[:, :, :start], v[:, :, :start] = self.keys, self.values
                self._k, self._v = k, v
            self._k[:, :, start:n] = key_states
            self._v[:, :, start:n] = value_states
            self._view(n)
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            n = self.keys.shape[2]
            self._k, self._v = self._k[indices], self._v[indices]  # one copy, same room
            self._view(n)

        def batch_repeat_interleave(self, repeats: int) -> None:
            n = self.keys.shape[2]
            self._k = self._k.repeat_interleave(repeats, 0)
            self._v = self._v.repeat_interleave(repeats, 0)
            self._view(n)

        def reset(self) -> None:  # keep the room: length 0 (crop: the base class's slicing)
            self._view(0)

    return PreallocatedLayer


def inverse_cdf_sample(scores: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from ``softmax(scores)`` (``scores``: ``[B, V]`` logits after
    temperature / top-p, ``-inf`` for excluded tokens; returns int64 ``[B]``), by inversion of
    the cumulative distribution (Devroye 1986, "Non-Uniform Random Variate Generation",
    Ch. III, Sec. 2): one uniform per row and a binary search. Probabilities in float32, their
    running sum in float64 (1.7 ms per step for 32 x 49,152 on an AMD EPYC, 2 threads,
    against 2.9 ms with the softmax in float64; the CDFs differ by < 4e-6). A token of
    probability 0 has an empty interval and is never drawn. ``torch.multinomial`` draws an
    exponential per vocabulary entry instead: 14.7 ms per decoding step for 16 x 49,152 on
    this CPU against 2.5 ms, 18% of generation."""
    cdf = torch.softmax(scores.float(), dim=-1).double().cumsum_(-1)
    u = torch.rand((len(scores), 1), dtype=torch.float64, device=scores.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=scores.shape[-1] - 1)


def sampling_processors(temperature: float, top_p: float) -> Any:
    """``transformers`` logits processors that make greedy ``generate`` sample at
    ``temperature`` within the nucleus ``top_p``: the library's temperature and top-p
    warpers, then a draw by :func:`inverse_cdf_sample` whose token alone keeps a finite
    score (so the greedy argmax returns it)."""
    from transformers import (
        LogitsProcessor,
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    class Draw(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            token = inverse_cdf_sample(scores)
            out = torch.full_like(scores, -float("inf"))
            return out.scatter_(1, token[:, None], 0.0)

    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList([*warpers, Draw()])


def _cache_kwarg() -> str:
    """``generate``'s name for a KV cache passed in: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (earlier)."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
