"""Child process of test_sb3_resume.py: DQN on CartPole-v1 with a ZarrReplayBuffer committed
every 200 steps (model zip + buffer + RNG states), in one of two modes:

- ``record RUN_DIR``: at the commit of step 600, draw the batches the run samples next and save
  them with the policy parameters to ``RUN_DIR/expected.npz``, then exit (the uninterrupted run
  as of that commit).
- ``kill RUN_DIR``: go on past the commit of step 600 and ``SIGKILL`` itself at step 700, with
  100 transitions added since the commit.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch as th
from stable_baselines3 import DQN
from stable_baselines3.common.callbacks import BaseCallback

from rlbuffers.integrations.sb3 import CommitCallback, ZarrReplayBuffer

COMMIT_EVERY, RECORD_AT, KILL_AT, TOTAL = 200, 600, 700, 1_000
BATCHES, BATCH_SIZE = 5, 32


def make_model(run_dir: str) -> DQN:
    return DQN("MlpPolicy", "CartPole-v1", seed=0, device="cpu", buffer_size=500,
               learning_starts=100, train_freq=4, batch_size=BATCH_SIZE,
               target_update_interval=100, policy_kwargs={"net_arch": [32, 32]},
               replay_buffer_class=ZarrReplayBuffer,
               replay_buffer_kwargs={"path": os.path.join(run_dir, "buffer")})


def draw(model: DQN) -> dict[str, np.ndarray]:
    """The next batches and the parameters: what a resumed run must reproduce."""
    out = {f"param/{k}": v.numpy() for k, v in model.policy.state_dict().items()}
    for i in range(BATCHES):
        batch = model.replay_buffer.sample(BATCH_SIZE)
        for name in ("observations", "actions", "next_observations", "dones", "rewards"):
            out[f"batch{i}/{name}"] = getattr(batch, name).numpy()
    out["torch_draw"] = th.rand(3).numpy()     # SAC samples actions with torch's RNG
    out["num_timesteps"] = np.array(model.num_timesteps)
    return out


class Record(BaseCallback):
    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.run_dir = run_dir

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:   # after CommitCallback's, in the list's order
        if self.model.num_timesteps == RECORD_AT:
            np.savez(os.path.join(self.run_dir, "expected.npz"), **draw(self.model))
            os._exit(0)


class Kill(BaseCallback):
    def _on_step(self) -> bool:
        if self.model.num_timesteps == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return True


def main(mode: str, run_dir: str) -> None:
    th.set_num_threads(1)
    model = make_model(run_dir)
    last = Record(run_dir) if mode == "record" else Kill()
    model.learn(TOTAL, callback=[CommitCallback(COMMIT_EVERY, os.path.join(run_dir, "ckpt")),
                                 last])
    raise SystemExit(f"{mode}: training ended without reaching step {RECORD_AT}/{KILL_AT}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
