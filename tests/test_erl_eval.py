"""ERL's deterministic evaluation of the learner (trainers/erl/evaluate.py, issue 49 item 5):
no exploration noise, no RNG drawn, a separate env; training with it equals training without
it bit for bit (buffer, networks, RNG states, fitness); its rows in eval.jsonl do not depend
on whether the run was resumed."""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest
import torch

from rlbuffers import ReplayBuffer
from tests.test_erl import (
    REPO,
    TIMEOUT_S,
    TINY,
    buffer_contents,
    metrics,
    run_trainer,
    trainer_cmd,
)
from trainers.erl.evaluate import episode_return, eval_row, eval_seed, evaluate
from trainers.erl.rollout import Actor, make_env, rollout

EVAL = ["--eval-every", "2", "--eval-episodes", "3"]


def small_env_actor(seed: int = 0):
    env = make_env("HalfCheetah-v5", 50)
    torch.manual_seed(seed)
    actor = Actor(17, 6, 16, env.action_space.low, env.action_space.high)
    return env, actor


class NoDraws(np.random.Generator):
    """A generator whose every draw fails: an episode that needs noise cannot use it."""

    def __init__(self) -> None:
        super().__init__(np.random.PCG64(0))

    def normal(self, *a, **k):  # noqa: D102
        raise AssertionError("the evaluation drew exploration noise")

    uniform = normal


def test_evaluation_is_the_noise_free_episode_and_draws_no_random_number():
    env, actor = small_env_actor()
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    py_state = random.getstate()
    returns = evaluate(env, actor, seed=7, episodes=3)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    got = np.random.get_state()
    assert got[0] == np_state[0] and np.array_equal(got[1], np_state[1]) and got[2:] == np_state[2:]
    # the same as the training rollout with no noise (whose rng is then never drawn from)
    for k, r in enumerate(returns):
        ret, _ = rollout(env, actor, eval_seed(7, k), NoDraws(), noise_std=0.0)
        assert r == ret
    assert evaluate(env, actor, seed=7, episodes=3) == returns  # repeatable
    assert len(set(returns)) == 3  # three different start states
    # exploration noise would change the return: the evaluation has none
    noisy, _ = rollout(env, actor, eval_seed(7, 0), np.random.default_rng(0), noise_std=0.1)
    assert noisy != returns[0]
    assert episode_return(env, actor, eval_seed(7, 0)) == returns[0]


def test_eval_seeds_are_not_the_training_episodes_seeds():
    from trainers.erl.config import Config
    from trainers.erl.train import episode_seed

    cfg = Config(seed=3)
    train = {episode_seed(cfg, e) for e in range(10_000)}
    assert not train & {eval_seed(3, k) for k in range(100)}
    assert eval_seed(3, 0) != eval_seed(4, 0)


def test_eval_row_holds_no_timing():
    row = eval_row(4, 800, 400, [1.0, 2.0, 4.0])
    assert row == {"generation": 4, "env_steps": 800, "td3_updates": 400, "n": 3,
                   "mean": pytest.approx(7 / 3), "std": pytest.approx(np.std([1, 2, 4], ddof=1)),
                   "returns": [1.0, 2.0, 4.0]}


def ckpt_files(run_dir, gen):
    return {name: torch.load(run_dir / "ckpt" / f"generation-{gen}" / name, weights_only=True)
            for name in ("population.pt", "learner.pt", "rng.pt", "best_actor.pt")}


def test_training_with_evaluation_equals_training_without_it_bit_for_bit(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    run_trainer(on, *TINY, "--generations", "4", *EVAL)
    run_trainer(off, *TINY, "--generations", "4", "--eval-every", "0")
    assert not (off / "eval.jsonl").exists()
    evals = [json.loads(line) for line in (on / "eval.jsonl").read_text().splitlines()]
    assert [e["generation"] for e in evals] == [0, 2, 4]
    assert [e["n"] for e in evals] == [3, 3, 3] and evals[0]["td3_updates"] == 0
    # everything but the evaluation's own rows is the same, bit for bit
    info_on, rows_on = buffer_contents(on)
    info_off, rows_off = buffer_contents(off)
    assert info_on == info_off
    for name, col in rows_on.items():
        np.testing.assert_array_equal(col, rows_off[name], err_msg=name)
    with ReplayBuffer.open(on / "buffer", mode="r") as a, \
            ReplayBuffer.open(off / "buffer", mode="r") as b:
        np.testing.assert_array_equal(a.sample(64)["obs"], b.sample(64)["obs"])  # sampler RNG
    a, b = ckpt_files(on, 4), ckpt_files(off, 4)
    assert repr(a) == repr(b)  # every tensor, optimizer state and RNG state
    m_on, m_off = metrics(on), metrics(off)
    for key in ("env_steps", "fitness", "learner_return", "td3_updates", "buffer_size"):
        assert [m[key] for m in m_on] == [m[key] for m in m_off], key
    assert [("eval_return_mean" in m) for m in m_on] == [False, True, False, True]
    assert m_on[1]["eval_return_mean"] == evals[1]["mean"]
    assert not any("eval_return_mean" in m for m in m_off)


# A resumed run's eval.jsonl (exactly the committed rows after a kill, the uncommitted row
# dropped, byte-equal to the uninterrupted run, extended after a finished run): checked in
# tests/test_erl.py's kill test, which runs with evaluation on (one killed run for both).


@pytest.mark.parametrize("flag", ["--eval-every", "--eval-episodes"])
def test_eval_settings_are_checked_and_fixed_for_a_run(tmp_path, flag):
    bad = subprocess.run(trainer_cmd(tmp_path / "bad", *TINY, flag, "-1"), cwd=REPO,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert bad.returncode != 0 and flag in bad.stderr
    run = tmp_path / "run"
    run_trainer(run, *TINY, "--generations", "1", *EVAL)
    clash = subprocess.run(trainer_cmd(run, "--resume", flag, "7"), cwd=REPO,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert clash.returncode != 0 and flag.lstrip("-").replace("-", "_") in clash.stderr
