"""Issue 45, what GRPO says while it sets up: the activation profile that chooses gradient
checkpointing under a budget (23 s of silence on SmolLM2 after the placement line) is
announced before it runs."""

from __future__ import annotations

import logging

import pytest

from tests.heavy import require

require("transformers", "tokenizers")

from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.llm.checkpointing import set_gradient_checkpointing  # noqa: E402
from trainers.llm.model import load_causal_lm  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model, _ = load_causal_lm(make_tiny_lm_dir(tmp_path_factory.mktemp("tiny")))
    return model


def test_the_activation_profile_under_a_budget_is_announced_before_it_runs(tiny_model,
                                                                           caplog):
    with caplog.at_level(logging.INFO):
        plan = set_gradient_checkpointing(tiny_model, "auto", tokens=64, budget=1)
    said = [r.getMessage() for r in caplog.records]
    announced = said.index("profiling the activations of a 64-token micro-batch (two forward "
                           "passes) to choose gradient checkpointing...")
    result = next(i for i, m in enumerate(said) if m.startswith("activations of a 64-token"))
    assert announced < result and plan["activation_bytes"] > 1  # over the 1-byte budget
    assert plan["layers"] == [0, 1]


def test_generate_tells_each_finished_sequence_once(tmp_path_factory):
    """``on_finished`` (the evaluation's "k of n") adds up to the sequences generated, with
    sequences ending at EOS during decoding and the rest cut at the length limit, across the
    batch compactions and the generate calls of a small generation batch."""
    import numpy as np

    from trainers.llm.generation import generate
    from trainers.llm.settings import Sampling

    model, tok = load_causal_lm(make_tiny_lm_dir(tmp_path_factory.mktemp("tiny2")))
    prompts = [np.asarray(tok.encode(f"Calculate {i} + {i}."), np.int64) for i in range(7)]
    told: list[int] = []
    out = generate(model, tok, prompts, Sampling(max_completion_tokens=10, generation_batch=4),
                   n_per_prompt=2, on_finished=told.append)
    assert len(out) == 14 and sum(told) == 14 and all(k > 0 for k in told)
    assert len(told) >= 2  # 4 calls of at most 4 sequences: told per call at least


def test_checkpoint_layers_out_of_range_name_the_flag(tiny_model):
    from trainers.config import ConfigError

    with pytest.raises(ConfigError, match=r"--checkpoint-layers: expected indices in \[0, 2\) "
                                          r"\(the model's decoder layers\), got \[99\]"):
        set_gradient_checkpointing(tiny_model, "selective", tokens=64, budget=None,
                                   layers="0,99")


def test_a_capacity_the_buffer_refuses_names_the_flag(tmp_path, tiny_model):
    """--buffer-groups 99999999999: ReplayBuffer.create's ValueError (too many chunks) comes
    back naming the trainer's flag (a ConfigError: one line on the console)."""
    from tests.test_grpo import ARGS
    from trainers.config import ConfigError
    from trainers.grpo import train

    lm = make_tiny_lm_dir(tmp_path / "lm")
    with pytest.raises(ConfigError, match=r"--buffer-groups 99999999999: the replay buffer "
                                          r"refuses its capacity \(.*capacity"):
        train.main([*ARGS, "--model", str(lm), "--run-dir", str(tmp_path / "run"),
                    "--buffer-groups", "99999999999"])
    assert not (tmp_path / "run").exists()


def test_a_cuda_device_the_machine_lacks_is_a_config_error():
    """--device cuda:99 (or cuda on a machine without one) is one line on the console, not a
    ValueError's traceback."""
    from trainers.config import ConfigError
    from trainers.llm.device import resolve_device

    with pytest.raises(ConfigError, match=r"--device: expected a CUDA device below \d+ \(this "
                                          r"machine has \d+\), got 'cuda:99'"):
        resolve_device("cuda:99")
