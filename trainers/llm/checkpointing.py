"""Activation (gradient) checkpointing of a causal LM's decoder layers, one set of modes for
every LLM trainer (``--gradient-checkpointing``):

- ``off``: nothing recomputed;
- ``all``: every decoder layer recomputes its forward in backward (~25% more update time);
- ``selective``: the layers ``--checkpoint-layers`` names, or with ``auto`` the fewest layers
  that a measured profile of the bytes each layer saves for backward shows bring them to
  ``--activation-fraction`` (``rlbuffers.memory.activations``);
- ``auto``: ``all`` when one micro-batch's saved activations (profiled, extrapolated) exceed
  the memory budget, ``off`` otherwise (so ``off`` with no budget).

Checkpointing wraps each chosen layer's ``forward`` in ``torch.utils.checkpoint``
(non-reentrant), which works the same for plain and peft models; it is skipped under
``torch.no_grad`` (generation and reference passes never pay for it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlbuffers.memory.activations import profile_activations, select_checkpoint_layers
from rlbuffers.memory.process import trim_heap
from trainers.phases import heartbeat

log = logging.getLogger("trainers.llm.checkpointing")
MIB = 2**20

#: The values of ``--gradient-checkpointing``.
MODES = ("auto", "off", "all", "selective")


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM or of a peft model wrapping one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.get_decoder().layers)


def checkpoint_layers(layers: list[torch.nn.Module], indices: list[int]) -> None:
    """Wrap the ``forward`` of ``layers[i]`` for each ``i`` of ``indices`` in non-reentrant
    ``torch.utils.checkpoint`` (only while grad is enabled)."""
    from torch.utils.checkpoint import checkpoint

    for i in indices:
        layer = layers[i]
        forward = layer.forward

        def wrapped(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


def activation_bytes(model: Any, tokens: int, train_dtype: str = "float32",
                     profile_tokens: int = 128) -> int:
    """Bytes autograd saves for backward over a micro-batch of ``tokens`` tokens without
    checkpointing: ``profile_activations`` of the decoder on ``profile_tokens / 2`` and
    ``profile_tokens`` tokens under ``train_dtype`` autocast, extrapolated linearly (a fixed
    part, e.g. autocast's weight copies, plus a part per token; SDPA saves no ``[T, T]``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    dtype = getattr(torch, train_dtype)
    device = next(model.parameters()).device
    was_training = model.training
    model.train()

    def saved(n: int) -> int:
        ids = torch.zeros((1, n), dtype=torch.long, device=device)

        def forward() -> torch.Tensor:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                return decoder(input_ids=ids, use_cache=False).last_hidden_state.float().sum()

        return profile_activations(list(decoder.layers), forward,
                                   exclude=model.parameters()).total_bytes

    n = max(2, min(profile_tokens, tokens))
    small, large = saved(n // 2), saved(n)
    model.train(was_training)
    trim_heap()
    per_token = (large - small) / (n - n // 2)
    return int(large + per_token * (tokens - n))


def selective_plan(model: Any, tokens: int, fraction: float, profile_tokens: int = 128
                   ) -> dict[str, Any]:
    """Measure the saved-for-backward bytes of each decoder layer on one row of
    ``profile_tokens`` tokens and choose the fewest layers whose checkpointing keeps at most
    ``fraction`` of them (``select_checkpoint_layers``). Returns plain data: the profile, the
    chosen layers and the bytes saved, scaled to a micro-batch of ``tokens``."""
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    ids = torch.zeros((1, min(profile_tokens, tokens)), dtype=torch.long, device=device)
    model.train()
    prof = profile_activations(
        layers, lambda: model(input_ids=ids, logits_to_keep=1).logits.sum(),
        exclude=model.parameters())
    trim_heap()  # the profile's activations are freed: give their pages back
    chosen = select_checkpoint_layers(prof, int(fraction * prof.total_bytes))
    scale = tokens / ids.shape[1]
    saving = int(scale * sum(prof.layers[i].checkpoint_saving_bytes for i in chosen))
    log.info("activation profile (%d tokens): %.1f MiB saved for backward, %.1f MiB per "
             "layer; checkpointing layers %s saves %.1f MiB per %d-token micro-batch",
             ids.shape[1], prof.total_bytes / MIB, prof.layers[-1].saved_bytes / MIB,
             chosen, saving / MIB, tokens)
    return {"profile": prof.state_dict(), "profile_tokens": int(ids.shape[1]),
            "layers": chosen, "saving_bytes": saving}


def set_gradient_checkpointing(model: Any, mode: str, *, tokens: int, budget: int | None,
                               train_dtype: str = "float32", layers: str = "auto",
                               fraction: float = 0.5) -> dict[str, Any]:
    """Apply ``mode`` (see the module docstring) to ``model`` for micro-batches of ``tokens``
    tokens under ``budget`` bytes (None: no budget). ``layers``: with ``selective``, ``auto``
    or comma-separated layer indices. Returns the plan as plain data: ``mode``, the
    ``layers`` checkpointed and, where measured, ``activation_bytes`` / ``saving_bytes``.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`; trainers.config.ConfigError (a
            ValueError, one line on the console): a layer index is out of range.
    """
    if mode not in MODES:
        raise ValueError(f"gradient_checkpointing: expected one of {MODES}, got {mode!r}")
    all_layers = decoder_layers(model)
    plan: dict[str, Any] = {"mode": mode, "layers": []}
    if mode == "auto":
        if budget is not None:
            with heartbeat(f"profiling the activations of a {tokens}-token micro-batch "
                           "(two forward passes) to choose gradient checkpointing"):
                need = activation_bytes(model, tokens, train_dtype)
            on = need > budget
            log.info("activations of a %d-token micro-batch: %.0f MiB, budget %.0f MiB: "
                     "checkpointing %s", tokens, need / MIB, budget / MIB, "on" if on else "off")
            plan["activation_bytes"] = need
            if on:
                plan["layers"] = list(range(len(all_layers)))
    elif mode == "all":
        plan["layers"] = list(range(len(all_layers)))
    elif mode == "selective":
        if layers == "auto":
            with heartbeat("profiling each decoder layer's activations (one forward pass) to "
                           "choose the checkpointed layers"):
                plan.update(selective_plan(model, tokens, fraction))
        else:
            plan["layers"] = [int(i) for i in layers.split(",")]
            bad = [i for i in plan["layers"] if not 0 <= i < len(all_layers)]
            if bad:
                from trainers.config import ConfigError

                raise ConfigError(f"--checkpoint-layers: expected indices in [0, "
                                  f"{len(all_layers)}) (the model's decoder layers), got {bad}")
    checkpoint_layers(all_layers, plan["layers"])
    return plan
