"""Which layers hold the activation memory: a measured profile of the tensors autograd saves
for backward, per layer, and the choice of layers to checkpoint (selective activation
checkpointing, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198, section 4: recompute only where it saves most)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LayerActivations:
    """What one layer's forward left for backward.

    Attributes:
        index: position of the layer in the profiled sequence.
        saved_bytes: bytes of the tensors autograd saved for backward during the layer's
            forward (each storage counted once, by the first layer that saved it; parameters
            excluded): the layers' ``saved_bytes`` and ``other_bytes`` add up to the forward's.
        exclusive_bytes: the part of those storages that no other layer (or code outside the
            layers) also saved, such as the rotary ``cos``/``sin`` every layer saves: only
            these are freed when this layer alone is checkpointed.
        input_bytes: bytes of the layer's tensor inputs that require grad (what a checkpointed
            layer keeps to recompute its forward).
    """

    index: int
    saved_bytes: int
    exclusive_bytes: int
    input_bytes: int

    @property
    def checkpoint_saving_bytes(self) -> int:
        """Bytes checkpointing this layer frees until backward: ``exclusive - input``
        (>= 0). Savings of several layers add up (what layers share stays saved)."""
        return max(self.exclusive_bytes - self.input_bytes, 0)


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-for-backward bytes of one forward pass, per layer and outside the layers."""

    layers: tuple[LayerActivations, ...]
    other_bytes: int
    """Bytes saved outside the profiled layers (embeddings, final norm, LM head, loss)."""
    shared_bytes: int = 0
    """Bytes of storages saved by two or more layers and nothing else (rotary ``cos``/``sin``):
    freed only when every layer that saves them is checkpointed, so the layers' savings
    (which count them as kept) are exact for any set of layers but all of these, and an
    upper bound on what stays saved then."""

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + sum(x.saved_bytes for x in self.layers)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": [asdict(x) for x in self.layers], "other_bytes": self.other_bytes,
                "shared_bytes": self.shared_bytes}


def _tensors(args: Iterable[Any]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _check_layers(layers: Sequence[torch.nn.Module]) -> None:
    if not layers:
        raise ValueError("layers: expected at least one module, got none")
    if len({id(m) for m in layers}) != len(layers):
        raise ValueError("layers: expected distinct modules, got one module twice")


def profile_activations(layers: Sequence[torch.nn.Module], forward: Callable[[], Any], *,
                        exclude: Iterable[torch.Tensor] = ()) -> ActivationProfile:
    """Run ``forward()`` once with grad enabled and attribute every tensor autograd saves for
    backward to the layer of ``layers`` whose forward was running (or to ``other_bytes``).

    Sizes are storage sizes (a saved view keeps its whole storage alive), each storage counted
    once. What ``forward()`` returns is dropped, so its graph is freed before this returns.

    Args:
        layers: the modules to profile (e.g. a transformer's decoder layers), not nested in
            one another.
        forward: runs the model on a representative micro-batch (the shapes decide the
            bytes, not the values).
        exclude: tensors never counted (the model's parameters, which autograd saves by
            reference; every ``torch.nn.Parameter`` is excluded anyway).

    Returns:
        ActivationProfile with one ``LayerActivations`` per entry of ``layers``.

    Raises:
        ValueError: ``layers`` is empty or holds one module twice.
        RuntimeError: grad is disabled (nothing would be saved).
    """
    _check_layers(layers)
    if not torch.is_grad_enabled():
        raise RuntimeError("profile_activations: grad is disabled, so autograd saves nothing; "
                           "call it outside torch.no_grad()")
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    for m in layers:
        skip.update(p.untyped_storage().data_ptr() for p in m.parameters())
    owners: dict[int, tuple[int, set[int]]] = {}  # storage -> (bytes, savers; -1: other)
    first: dict[int, int] = {}  # storage -> its first saver
    inputs = [0] * len(layers)
    running: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if not isinstance(t, torch.nn.Parameter) and ptr not in skip:
            who = running[-1] if running else -1
            owners.setdefault(ptr, (st.nbytes(), set()))[1].add(who)
            first.setdefault(ptr, who)
        return t

    def pre(i: int) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            running.append(i)
            inputs[i] += sum(t.untyped_storage().nbytes()
                             for t in _tensors([*args, *kwargs.values()]) if t.requires_grad)
        return hook

    def post(_m: Any, _args: Any, _out: Any) -> None:
        running.pop()

    handles = []
    try:
        for i, m in enumerate(layers):
            handles.append(m.register_forward_pre_hook(pre(i), with_kwargs=True))
            handles.append(m.register_forward_hook(post))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        del out
    finally:
        for h in handles:
            h.remove()
    return _summarise(owners, first, inputs)


def _summarise(owners: dict[int, tuple[int, set[int]]], first: dict[int, int],
               inputs: list[int]) -> ActivationProfile:
    """The profile from each storage's bytes, savers (-1: outside the layers), first saver."""
    saved = [0] * (len(inputs) + 1)  # [-1]: other
    exclusive, shared = [0] * len(inputs), 0
    for ptr, (nbytes, who) in owners.items():
        saved[first[ptr]] += nbytes
        if -1 not in who:
            if len(who) == 1:
                exclusive[next(iter(who))] += nbytes
            else:
                shared += nbytes
    return ActivationProfile(tuple(LayerActivations(i, saved[i], exclusive[i], inputs[i])
                                   for i in range(len(inputs))), saved[-1], shared)


def select_checkpoint_layers(profile: ActivationProfile, max_saved_bytes: int) -> list[int]:
    """The fewest layers to checkpoint so that the forward's saved bytes fall to
    ``max_saved_bytes``: layers by ``checkpoint_saving_bytes``, largest first (ties: lower
    index first), until the total minus their savings is within the budget.

    If even every layer with a saving does not reach it, all of them are returned (the best
    checkpointing can do). Returns sorted layer indices (empty if the profile already fits).

    Raises:
        ValueError: ``max_saved_bytes`` < 0.
    """
    if max_saved_bytes < 0:
        raise ValueError(f"max_saved_bytes: expected >= 0, got {max_saved_bytes!r}")
    remaining, chosen = profile.total_bytes, []
    order = sorted(profile.layers, key=lambda x: (-x.checkpoint_saving_bytes, x.index))
    for layer in order:
        if remaining <= max_saved_bytes or layer.checkpoint_saving_bytes == 0:
            break
        chosen.append(layer.index)
        remaining -= layer.checkpoint_saving_bytes
    return sorted(chosen)
