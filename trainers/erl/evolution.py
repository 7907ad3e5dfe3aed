"""ERL's evolution operators (Khadka & Tumer, "Evolution-Guided Policy Gradient in
Reinforcement Learning", NeurIPS 2018, Algorithm 1 and Section 3): tournament selection,
neuron-level crossover, Gaussian / super / reset mutation, and one generation's step."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from trainers.erl.config import Config
from trainers.erl.rollout import Actor


def tournament(fitness: np.ndarray, size: int, rng: np.random.Generator) -> int:
    """Tournament selection: index of the fittest of ``size`` actors drawn at random (without
    replacement) from ``fitness`` float64[pop_size]."""
    entrants = rng.choice(len(fitness), size=min(size, len(fitness)), replace=False)
    return int(entrants[np.argmax(fitness[entrants])])


@torch.no_grad()
def crossover(a: Actor, b: Actor, rng: np.random.Generator) -> Actor:
    """Neuron-level crossover: a child of ``a`` whose hidden/output units (a weight row and its
    bias) each come from ``b`` with probability 1/2 (ERL's layer-wise row exchange)."""
    child = copy.deepcopy(a)
    for lc, lb in zip(child.net, b.net, strict=True):
        if isinstance(lc, nn.Linear):
            rows = torch.as_tensor(rng.random(lc.out_features) < 0.5)
            lc.weight[rows] = lb.weight[rows]
            lc.bias[rows] = lb.bias[rows]
    return child


@torch.no_grad()
def mutate(actor: Actor, cfg: Config, rng: np.random.Generator) -> None:
    """ERL's Gaussian mutation, in place: in each weight matrix, ``mutation_frac`` of the
    weights w get w += N(0, (strength * |w|)^2), with strength 10x for a super mutation
    (``super_mutation_prob``), or are reset to N(0, 1) (``reset_prob``); biases and LayerNorm
    parameters stay."""
    for layer in actor.net:
        if not isinstance(layer, nn.Linear):
            continue
        w = layer.weight.view(-1)
        n = max(1, int(cfg.mutation_frac * w.numel()))
        idx = torch.as_tensor(rng.choice(w.numel(), size=n, replace=False))
        kind = rng.random(n)
        strength = np.where(kind < cfg.super_mutation_prob, 10 * cfg.mutation_strength,
                            cfg.mutation_strength)
        noise = torch.as_tensor(rng.normal(size=n) * strength, dtype=w.dtype)
        reset = torch.as_tensor(kind > 1 - cfg.reset_prob)
        new = w[idx] + noise * w[idx].abs()
        new[reset] = torch.as_tensor(rng.normal(size=int(reset.sum())), dtype=w.dtype)
        w[idx] = new.clamp(-1e6, 1e6)


def evolve(population: list[Actor], fitness: np.ndarray, cfg: Config,
           rng: np.random.Generator) -> list[Actor]:
    """One ERL generation step: elites survive unchanged; every other slot gets an offspring of
    two tournament winners (crossover with ``crossover_prob``, else a copy), then mutated with
    ``mutation_prob``. Returns the new population, elites first (``fitness``:
    float64[pop_size], the population's order)."""
    ranked = np.argsort(-fitness)
    n_elite = max(1, round(cfg.elite_fraction * len(population)))
    new = [population[i] for i in ranked[:n_elite]]
    while len(new) < len(population):
        a = population[tournament(fitness, cfg.tournament_size, rng)]
        b = population[tournament(fitness, cfg.tournament_size, rng)]
        child = crossover(a, b, rng) if rng.random() < cfg.crossover_prob else copy.deepcopy(a)
        if rng.random() < cfg.mutation_prob:
            mutate(child, cfg, rng)
        new.append(child)
    return new
