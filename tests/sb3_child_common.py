"""What the SB3 kill-and-resume children (tests/sb3_resume_child.py, tests/sb3_her_child.py)
share: record the batches an uninterrupted run samples after a commit, or SIGKILL the run
past that commit."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback

from rlbuffers.integrations.sb3 import CommitCallback


class Record(BaseCallback):
    """At the commit of step ``at``, save ``draw(model)`` to ``run_dir/expected.npz`` and exit."""

    def __init__(self, run_dir: str, at: int,
                 draw: Callable[[Any], dict[str, np.ndarray]]) -> None:
        super().__init__()
        self.run_dir, self.at, self.draw = run_dir, at, draw

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:   # after CommitCallback's, in the list's order
        if self.model.num_timesteps == self.at:
            np.savez(os.path.join(self.run_dir, "expected.npz"), **self.draw(self.model))
            os._exit(0)


class Kill(BaseCallback):
    """``SIGKILL`` the process at step ``at``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def _on_step(self) -> bool:
        if self.model.num_timesteps == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return True


def run(mode: str, run_dir: str, model: BaseAlgorithm, *, commit_every: int, record_at: int,
        kill_at: int, total: int, draw: Callable[[Any], dict[str, np.ndarray]]) -> None:
    """Train ``model`` with a CommitCallback every ``commit_every`` steps until ``mode``'s
    moment: ``record`` (at ``record_at``) or ``kill`` (at ``kill_at``)."""
    th.set_num_threads(1)
    last = Record(run_dir, record_at, draw) if mode == "record" else Kill(kill_at)
    model.learn(total, callback=[CommitCallback(commit_every, os.path.join(run_dir, "ckpt")),
                                 last])
    raise SystemExit(f"{mode}: training ended without reaching step {record_at}/{kill_at}")
