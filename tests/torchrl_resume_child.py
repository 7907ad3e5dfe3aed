"""Child of tests/test_torchrl_resume.py: a TorchRL prioritized replay loop over a ZarrStorage
that commits at step ``COMMIT_AT``; ``record`` then saves the batches it samples next and
exits, ``kill`` goes on writing, sampling and updating, then SIGKILLs itself mid-run."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from rlbuffers.integrations.torchrl import ZarrPrioritizedSampler, ZarrStorage

CAPACITY, BATCH, COMMIT_AT, DRAWS = 64, 16, 6, 5


def make(path: str) -> tuple[TensorDictReplayBuffer, ZarrStorage, ZarrPrioritizedSampler]:
    storage = ZarrStorage(path, CAPACITY, seed=1)
    sampler = ZarrPrioritizedSampler(CAPACITY, 0.6, 0.4)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=BATCH,
                                priority_key="td_error")
    return rb, storage, sampler


def rows(step: int) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    i = torch.arange(8 * step, 8 * step + 8)
    return TensorDict({"x": i, "obs": torch.randn(8, 5, generator=g),
                       "td_error": torch.rand(8, generator=g) * 3}, [8])


def step(rb: TensorDictReplayBuffer, k: int) -> None:
    rb.extend(rows(k))
    batch = rb.sample()
    batch["td_error"] = torch.rand(BATCH, generator=torch.Generator().manual_seed(100 + k))
    rb.update_tensordict_priority(batch)


def draws(rb: TensorDictReplayBuffer) -> dict[str, np.ndarray]:
    out = [rb.sample() for _ in range(DRAWS)]
    return {"index": np.stack([b["index"].numpy() for b in out]),
            "weight": np.stack([b["priority_weight"].numpy() for b in out]),
            "x": np.stack([b["x"].numpy() for b in out])}


def main(mode: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    rb, storage, _ = make(os.path.join(run_dir, "buffer"))
    for k in range(COMMIT_AT + 4):  # 80 rows through 64 slots by the kill: wraps
        step(rb, k)
        if k == COMMIT_AT:
            storage.commit({"step": k})
            if mode == "record":
                np.savez(os.path.join(run_dir, "expected.npz"), **draws(rb))
                os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
