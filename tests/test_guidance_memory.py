"""Issue 49, guidance's memory: the generation batches are sized inside ``--memory-budget``
with the weight copies ``generate`` holds (merged LoRA weights, oneDNN-packed linears) and
the KV cache's transient second copy counted, and ``tools/memsample.py`` (the outside
sampler of the process tree's RSS) sees a child's memory and splits it into phases."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from tests.test_guidance import args, make_tiny_bert  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import parse_config  # noqa: E402
from trainers.guidance import rollout as grollout  # noqa: E402
from trainers.guidance.config import Config  # noqa: E402
from trainers.llm.generation import generation_batch, kv_bytes_per_token  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_lm_dir(d / "lm"), make_tiny_bert(d / "bert")


def test_generation_budget_counts_the_weight_copies_and_the_cache_twice(tiny, tmp_path):
    budget = 50 * 2**20
    cfg = parse_config(Config, [*args(tiny, tmp_path / "g"), "--memory-budget", str(budget)],
                       prog="guidance", description="", resumable=set())
    policies, _, _ = grollout.make_policies(cfg, naive=False)
    model = policies.models["agent"]
    plain = cfg.utterance_sampling()
    # naive count: every adapted projection's base weight (merged copy), every plain Linear
    # weight (packed copy, the LM head included), fp32
    adapted = [m for n, m in model.named_modules() if n.endswith(tuple(
        f".{t}" for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")))]
    merged = sum(m.base_layer.weight.numel() * 4 for m in adapted)
    packed = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    assert merged > 0 and packed > merged  # the LM head is packed too
    assert grollout.weight_copy_bytes(model, plain) == merged + packed
    unpacked = dataclasses.replace(plain, packed_weights=False)
    assert grollout.weight_copy_bytes(model, unpacked) == merged
    s = grollout.generation_sampling(cfg, policies)
    assert s.memory_budget == (budget - merged - packed) // 2
    assert dataclasses.replace(s, memory_budget=None) == dataclasses.replace(
        plain, memory_budget=None)
    # fewer sequences per generate call than the plain budget allowed
    n, prompt = 64, budget // (10 * kv_bytes_per_token(model.config))  # ~10 fit the budget
    few, plain_few = generation_batch(s, model, n, prompt), generation_batch(plain, model, n,
                                                                             prompt)
    assert 1 <= few <= plain_few // 2 and plain_few < n
    # no budget: unchanged; a budget smaller than the copies: one sequence at a time
    none = parse_config(Config, [*args(tiny, tmp_path / "g")], prog="guidance",
                        description="", resumable=set())
    assert grollout.generation_sampling(none, policies) == none.utterance_sampling()
    small = dataclasses.replace(cfg, memory_budget="1000")
    s = grollout.generation_sampling(small, policies)
    assert s.memory_budget == 0 and generation_batch(s, model, n, prompt) == 1


def test_memsample_sees_a_childs_memory_and_splits_phases(tmp_path):
    """A parent that starts a child allocating ~400 MB: the tree's peak (sampled from outside
    every 20 ms) holds it, the phase after the child's line has it, the one before does not;
    --stop-at kills the tree at its line."""
    child = ("import time, numpy as np; print('alloc', flush=True); x = np.ones(50_000_000); "
             "time.sleep(1.0); print('done', flush=True); time.sleep(30)")
    parent = (f"import subprocess, sys, time; time.sleep(0.5); "
              f"subprocess.run([sys.executable, '-c', {child!r}])")
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "tools.memsample", "--quiet", "--out", str(out),
                           "--phase", "alloc=^alloc", "--stop-at", "^done", "--",
                           sys.executable, "-c", parent], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    full = json.loads(out.read_text())
    assert report["stopped"] is True and report["seconds"] < 25  # killed, not slept out
    assert report["peak_bytes"] >= 400e6 and report["phases"]["alloc"]["peak_bytes"] >= 400e6
    assert report["phases"]["start"]["peak_bytes"] < 300e6
    assert report["peak_bytes"] == max(r for _, r in full["timeline"])
    assert [s for _, s in full["lines"]][:2] == ["alloc", "done"]
    gaps = [b[0] - a[0] for a, b in zip(full["timeline"], full["timeline"][1:], strict=False)]
    assert sorted(gaps)[len(gaps) // 2] < 0.2  # every 20 ms (slower on a loaded machine)


def test_probe_stops_at_one_utterance_when_three_would_pass_the_budget(tiny, tmp_path,
                                                                      monkeypatch):
    """The one-utterance step is measured first; when 3 of it would pass the budget the
    3-utterance probe never runs and the cost is that step's bytes per token; else the
    probe runs as before."""
    from rlbuffers.memory.budget import StepCost
    from trainers.guidance import policy as gpolicy

    cfg = parse_config(Config, args(tiny, tmp_path / "p"), prog="guidance", description="",
                       resumable=set())
    policies, tok, _ = grollout.make_policies(cfg, naive=False)
    measured, probed, steps = [1000], [], []

    class FakePeak:
        def __init__(self, device=None):
            self.peak_extra_bytes = measured[0]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            steps.append(True)
            return False

    def fake_probe(step_fn, make_batch, *, sizes, tokens_per_item=None, device=None):
        probed.append(sizes)
        return StepCost(fixed_bytes=7, bytes_per_token=3)

    monkeypatch.setattr(gpolicy, "PeakMemory", FakePeak)
    monkeypatch.setattr(gpolicy, "probe_activation_bytes", fake_probe)
    cost = gpolicy.utterance_step_cost(policies, "agent", 40, 8, tok.pad_token_id, cfg, 2999)
    assert cost == StepCost(fixed_bytes=0, bytes_per_item=0, bytes_per_token=25)  # 1000 / 40
    assert probed == [] and len(steps) == 1
    cost = gpolicy.utterance_step_cost(policies, "agent", 40, 8, tok.pad_token_id, cfg, 3000)
    assert cost == StepCost(fixed_bytes=7, bytes_per_token=3) and probed == [(1, 3)]
