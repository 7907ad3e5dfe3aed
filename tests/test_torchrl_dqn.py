"""TorchRL's documented DQN loop (collector, DQNLoss, Adam, SoftUpdate, epsilon-greedy) on
CartPole with LazyMemmapStorage and with ZarrStorage, same seeds: the same per-step losses,
bit for bit, and the same episode returns; the Zarr run commits every batch."""

from __future__ import annotations

import warnings

import pytest

from tests.heavy import require

require("torchrl", "tensordict", "torch", "gymnasium")

import torch
from tensordict.nn import TensorDictModule as Mod
from tensordict.nn import TensorDictSequential as Seq
from torchrl.data import LazyMemmapStorage, ReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueModule
from torchrl.objectives import DQNLoss, SoftUpdate

from rlbuffers import ReplayBuffer as Buffer
from rlbuffers.integrations.torchrl import ZarrStorage

with warnings.catch_warnings():  # TorchRL 0.14 defines its own deprecated weight updater
    warnings.filterwarnings("ignore", "Creating .*WeightUpdater", DeprecationWarning)
    from torchrl.collectors import Collector

BATCHES, FRAMES, INIT, OPTIM_STEPS, B = 6, 64, 128, 4, 32
#: TorchRL 0.14's own collector builds its deprecated default weight updater
pytestmark = pytest.mark.filterwarnings(
    "ignore:Creating .*WeightUpdater:DeprecationWarning")


def dqn(storage) -> tuple[list[float], list[float]]:
    """Per-step losses and the returns of the episodes that ended, after BATCHES batches."""
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.set_seed(0)
    value_net = Mod(MLP(out_features=env.action_spec.shape[-1], num_cells=[32, 32]),
                    in_keys=["observation"], out_keys=["action_value"])
    policy = Seq(value_net, QValueModule(spec=env.action_spec))
    explore = EGreedyModule(env.action_spec, annealing_num_steps=2_000, eps_init=0.5)
    collector = Collector(env, Seq(policy, explore), frames_per_batch=FRAMES,
                          total_frames=BATCHES * FRAMES, init_random_frames=INIT,
                          auto_register_policy_transforms=False)
    rb = ReplayBuffer(storage=storage)
    loss = DQNLoss(value_network=policy, action_space=env.action_spec, delay_value=True)
    optim = torch.optim.Adam(loss.parameters(), lr=0.02)
    updater = SoftUpdate(loss, eps=0.99)
    losses, returns = [], []
    for data in collector:
        rb.extend(data)
        ended = data["next", "done"].squeeze(-1)
        returns += data["next", "step_count"][ended].squeeze(-1).float().tolist()
        if len(rb) > INIT:
            for _ in range(OPTIM_STEPS):
                loss_vals = loss(rb.sample(B))
                loss_vals["loss"].backward()
                optim.step()
                optim.zero_grad()
                explore.step(data.numel())
                updater.step()
                losses.append(loss_vals["loss"].item())
        if isinstance(storage, ZarrStorage):
            storage.commit({"frames": len(rb)})
    collector.shutdown()
    return losses, returns


def test_dqn_on_zarr_storage_equals_lazy_memmap_storage(tmp_path):
    want = dqn(LazyMemmapStorage(10_000, scratch_dir=tmp_path / "memmap"))
    zarr = ZarrStorage(tmp_path / "zarr", 10_000)
    got = dqn(zarr)
    assert len(want[0]) == (BATCHES - INIT // FRAMES) * OPTIM_STEPS and want[1]
    assert got == want
    zarr.close()
    with Buffer.open(tmp_path / "zarr", mode="r") as buf:
        assert buf.metadata["frames"] == len(buf) == BATCHES * FRAMES
