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
import sys

import numpy as np
import torch as th
from stable_baselines3 import DQN

from rlbuffers.integrations.sb3 import ZarrReplayBuffer
from tests.sb3_child_common import run

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


def main(mode: str, run_dir: str) -> None:
    run(mode, run_dir, make_model(run_dir), commit_every=COMMIT_EVERY, record_at=RECORD_AT,
        kill_at=KILL_AT, total=TOTAL, draw=draw)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
