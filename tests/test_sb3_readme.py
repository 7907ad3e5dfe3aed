"""The README's "Use with Stable-Baselines3 / CleanRL" examples run as written."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

import torch as th

from rlbuffers import ReplayBuffer

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Use with Stable-Baselines3 / CleanRL"


def examples() -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    section = text[start:text.index("\n## ", start + len(SECTION))]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A fresh working directory; the global RNG states and torch threads given back."""
    state = np.random.get_state(), random.getstate(), th.get_rng_state(), th.get_num_threads()
    monkeypatch.chdir(tmp_path)
    th.set_num_threads(1)
    yield tmp_path
    np.random.set_state(state[0])
    random.setstate(state[1])
    th.set_rng_state(state[2])
    th.set_num_threads(state[3])


def test_readme_has_both_examples():
    assert len(examples()) == 2


def test_sb3_example(run_dir):
    scope: dict = {}
    exec(compile(examples()[0], "README.md:sb3", "exec"), scope)
    model = scope["model"]
    assert model.num_timesteps == 3_000
    model.replay_buffer.close()
    with ReplayBuffer.open(run_dir / "runs/cartpole/buffer", mode="r") as buf:
        assert buf.metadata["num_timesteps"] == 3_000 and len(buf) == 3_000
    assert [p.name for p in (run_dir / "runs/cartpole").glob("*.zip")] == ["model_3000.zip"]


def test_cleanrl_example(run_dir):
    scope: dict = {}
    exec(compile(examples()[1], "README.md:cleanrl", "exec"), scope)
    assert scope["data"].observations.shape == (32, 4)
    scope["rb"].close()
    scope["envs"].close()
    with ReplayBuffer.open(run_dir / "runs/cleanrl/buffer", mode="r") as buf:
        assert buf.metadata["global_step"] == 999 and len(buf) == 1_000
