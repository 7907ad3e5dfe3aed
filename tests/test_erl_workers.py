"""ERL with its population evaluated on Ray rollout workers: the same seeds give the same
transitions, fitness and learner as the sequential run, and a resumed worker run continues
exactly."""

from __future__ import annotations

import numpy as np

from tests.heavy import require
from tests.test_erl import TINY, buffer_contents, metrics, run_trainer

require("ray")

KEYS = ["generation", "best_fitness", "mean_fitness", "learner_return", "env_steps",
        "buffer_size"]


def test_two_ray_workers_give_the_sequential_run(tmp_path):
    run_trainer(tmp_path / "w1", *TINY, "--generations", "2")
    run_trainer(tmp_path / "w2", *TINY, "--generations", "2", "--workers", "2")
    one, two = metrics(tmp_path / "w1"), metrics(tmp_path / "w2")
    assert [[r[k] for k in KEYS] for r in two] == [[r[k] for k in KEYS] for r in one]
    info1, rows1 = buffer_contents(tmp_path / "w1")
    info2, rows2 = buffer_contents(tmp_path / "w2")
    assert info1 == info2
    for name in rows1:
        np.testing.assert_array_equal(rows2[name], rows1[name], err_msg=name)
    # and a worker run resumes where it stopped, equal to the uninterrupted one
    run_trainer(tmp_path / "w2", "--resume", "--generations", "3", "--workers", "2")
    run_trainer(tmp_path / "w1", "--resume", "--generations", "3")
    assert [[r[k] for k in KEYS] for r in metrics(tmp_path / "w2")] == \
        [[r[k] for k in KEYS] for r in metrics(tmp_path / "w1")]
