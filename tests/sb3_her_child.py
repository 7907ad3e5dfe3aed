"""Child process of test_sb3_her.py: DQN on BitFlippingEnv with a ZarrHerReplayBuffer
committed every 100 steps (model zip + buffer + RNG states), in one of two modes:

- ``record RUN_DIR``: at the commit of step 300, draw the batches the run samples next and save
  them with the policy parameters to ``RUN_DIR/expected.npz``, then exit.
- ``kill RUN_DIR``: go on past that commit and ``SIGKILL`` itself at step 345, with 45
  transitions (and a running episode) added since the commit.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from stable_baselines3 import DQN
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.vec_env import DummyVecEnv

from rlbuffers.integrations.sb3 import ZarrHerReplayBuffer
from tests.sb3_child_common import run

COMMIT_EVERY, RECORD_AT, KILL_AT, TOTAL = 100, 300, 345, 600
BATCHES, BATCH_SIZE = 4, 32


def make_env() -> DummyVecEnv:
    return DummyVecEnv([lambda: BitFlippingEnv(n_bits=6, max_steps=6)])


def make_model(run_dir: str) -> DQN:
    return DQN("MultiInputPolicy", make_env(), seed=0, device="cpu", buffer_size=250,
               learning_starts=50, train_freq=4, batch_size=BATCH_SIZE,
               target_update_interval=100, policy_kwargs={"net_arch": [32]},
               replay_buffer_class=ZarrHerReplayBuffer,
               replay_buffer_kwargs={"path": os.path.join(run_dir, "buffer"),
                                     "n_sampled_goal": 4, "goal_selection_strategy": "future"})


def draw(model: DQN) -> dict[str, np.ndarray]:
    """The next batches and the parameters: what a resumed run must reproduce."""
    out = {f"param/{k}": v.numpy() for k, v in model.policy.state_dict().items()}
    for i in range(BATCHES):
        batch = model.replay_buffer.sample(BATCH_SIZE)
        for name in ("observations", "next_observations"):
            for key, value in getattr(batch, name).items():
                out[f"batch{i}/{name}/{key}"] = value.numpy()
        for name in ("actions", "dones", "rewards"):
            out[f"batch{i}/{name}"] = getattr(batch, name).numpy()
    out["ep_length"] = model.replay_buffer.ep_length.copy()
    out["num_timesteps"] = np.array(model.num_timesteps)
    return out


def main(mode: str, run_dir: str) -> None:
    run(mode, run_dir, make_model(run_dir), commit_every=COMMIT_EVERY, record_at=RECORD_AT,
        kill_at=KILL_AT, total=TOTAL, draw=draw)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
