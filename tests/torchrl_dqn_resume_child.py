"""Child of tests/test_torchrl_dqn_resume.py: TorchRL's documented DQN loop (``Collector`` on
``GymEnv("CartPole-v1")``, ``DQNLoss``, Adam, ``SoftUpdate``, epsilon-greedy) over a
``ZarrStorage``, run as segments of ``FRAMES`` frames, each ending in a commit.

At the end of segment ``k`` the loop saves its own checkpoint (``loop-k.pt``: the loss
module's state (online and target networks), Adam's, the exploration's and torch's global
RNG state) and then commits the storage with ``{"segment": k}``, the way a user would: the
commit is the point of truth, and a resumed loop loads the checkpoint of the last commit (one
written after it, by a loop killed before its commit, is never read). Each segment builds its
collector anew on an env seeded ``SEED + k``, in every mode, as a resumed loop must (an env
cannot be checkpointed), so the uninterrupted run and a resumed one collect the same frames.

Modes (``python -m tests.torchrl_dqn_resume_child MODE RUN_DIR SAMPLER``, ``SAMPLER``
``uniform`` (TorchRL's ``RandomSampler``) or ``prioritized`` (``ZarrPrioritizedSampler``)):

- ``reference``: all ``SEGMENTS``; writes ``state.pt`` (rows and sampler state) after the
  commit of segment ``KILL_AFTER``, and ``after.pt`` (every later update's sampled indices,
  weights and loss, and the final rows).
- ``kill``: prints ``committed k`` after each commit; after the one of ``KILL_AFTER`` it goes
  on with the next segment (collects, extends the storage, trains, updates priorities), then
  waits on stdin before that segment's checkpoint and commit; the parent SIGKILLs it when it
  reads ``committed KILL_AFTER``, so the kill lands in that uncommitted work or the wait.
- ``resume``: reopens the path, loads the last commit's checkpoint, writes ``state.pt`` at
  once, then runs the remaining segments and writes ``after.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from tensordict.nn import TensorDictModule as Mod
from tensordict.nn import TensorDictSequential as Seq
from torchrl.data import RandomSampler, TensorDictReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueModule
from torchrl.objectives import DQNLoss, SoftUpdate

from rlbuffers.integrations.torchrl import ZarrPrioritizedSampler, ZarrStorage

with warnings.catch_warnings():  # TorchRL 0.14 defines its own deprecated weight updater
    warnings.filterwarnings("ignore", "Creating .*WeightUpdater", DeprecationWarning)
    from torchrl.collectors import Collector

SEGMENTS, FRAMES, INIT, OPTIM_STEPS, B, CAPACITY, KILL_AFTER, SEED = 6, 64, 128, 4, 32, 256, 3, 7


def env_for(segment: int) -> TransformedEnv:
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.set_seed(SEED + segment)
    return env


class Loop:
    """The DQN loop's objects over the storage at ``path`` (reopened if it holds a commit)."""

    def __init__(self, path: str, sampler: str) -> None:
        torch.manual_seed(SEED)
        env = env_for(0)
        spec = env.action_spec
        value_net = Mod(MLP(out_features=spec.shape[-1], num_cells=[32, 32]),
                        in_keys=["observation"], out_keys=["action_value"])
        self.policy = Seq(value_net, QValueModule(spec=spec))
        self.policy(env.fake_tensordict())  # the MLP's lazy layers take their shapes
        self.explore = EGreedyModule(spec, annealing_num_steps=2_000, eps_init=0.5)
        self.storage = ZarrStorage(path, CAPACITY, seed=SEED)
        self.prioritized = sampler == "prioritized"
        self.rb = TensorDictReplayBuffer(
            storage=self.storage, batch_size=B,
            sampler=ZarrPrioritizedSampler(CAPACITY, 0.6, 0.4) if self.prioritized
            else RandomSampler(), priority_key="td_error")
        self.loss = DQNLoss(value_network=self.policy, action_space=spec, delay_value=True)
        self.loss.make_value_estimator(gamma=0.99)  # built now, so that a checkpoint loads
        self.optim = torch.optim.Adam(self.loss.parameters(), lr=0.02)
        self.updater = SoftUpdate(self.loss, eps=0.99)

    def segment(self, k: int) -> list[dict[str, torch.Tensor]]:
        """Collect FRAMES frames on env ``SEED + k``, extend, train; each update's draw."""
        collector = Collector(env_for(k), Seq(self.policy, self.explore), frames_per_batch=FRAMES,
                              total_frames=FRAMES,
                              init_random_frames=FRAMES if k * FRAMES < INIT else None,
                              auto_register_policy_transforms=False)
        data = next(iter(collector))
        collector.shutdown()
        self.rb.extend(data)
        updates = []
        if len(self.rb) > INIT:
            for _ in range(OPTIM_STEPS):
                batch = self.rb.sample()
                vals = self.loss(batch)
                vals["loss"].backward()
                self.optim.step()
                self.optim.zero_grad()
                if self.prioritized:
                    self.rb.update_tensordict_priority(batch)
                self.explore.step(data.numel())
                self.updater.step()
                updates.append({"index": batch["index"].clone(),
                                "weight": batch.get("priority_weight", torch.ones(B)).clone(),
                                "loss": vals["loss"].detach().clone()})
        return updates

    def checkpoint(self, run_dir: str, k: int) -> None:
        """The loop's own state at the end of segment ``k``, then the storage's commit."""
        state = {"loss": self.loss.state_dict(), "optim": self.optim.state_dict(),
                 "explore": self.explore.state_dict(), "torch_rng": torch.get_rng_state()}
        tmp = os.path.join(run_dir, f"loop-{k}.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(run_dir, f"loop-{k}.pt"))
        self.storage.commit({"segment": k})

    def restore(self, run_dir: str) -> int:
        """Load the checkpoint of the storage's last commit; returns its segment."""
        k = int(self.storage.buffer.metadata["segment"])
        state = torch.load(os.path.join(run_dir, f"loop-{k}.pt"))
        self.loss.load_state_dict(state["loss"])
        self.optim.load_state_dict(state["optim"])
        self.explore.load_state_dict(state["explore"])
        torch.set_rng_state(state["torch_rng"])
        return k

    def state(self) -> dict:
        """The stored rows (flattened keys) and the sampler's state: the priorities of every
        slot, the largest priority, the buffer's generator (prioritized); torch's RNG
        (uniform: RandomSampler draws from it)."""
        buf = self.storage.buffer
        out: dict = {"rows": dict(self.rb[:].flatten_keys(".").items()), "len": len(self.rb),
                     "total_added": buf.total_added, "torch_rng": torch.get_rng_state()}
        if self.prioritized:
            out["priority"] = torch.from_numpy(buf._context().priorities())
            out["sampler"] = json.dumps(buf.sampler.state_dict())
            out["generator"] = json.dumps(buf.rng.bit_generator.state)
        return out


def main(mode: str, run_dir: str, sampler: str) -> None:
    torch.set_num_threads(1)
    loop = Loop(os.path.join(run_dir, "buffer"), sampler)
    start = 0
    if mode == "resume":
        start = loop.restore(run_dir) + 1
        torch.save(loop.state(), os.path.join(run_dir, "state.pt"))
    updates = []
    for k in range(start, SEGMENTS):
        got = loop.segment(k)
        if k > KILL_AFTER:
            updates += got
        if mode == "kill" and k == KILL_AFTER + 1:
            sys.stdin.readline()  # the parent kills this process before it answers
            raise SystemExit("kill: not killed before the next commit")
        loop.checkpoint(run_dir, k)
        if mode == "kill":
            print(f"committed {k}", flush=True)
        if mode == "reference" and k == KILL_AFTER:
            torch.save(loop.state(), os.path.join(run_dir, "state.pt"))
    torch.save({"updates": updates, "final": loop.state()}, os.path.join(run_dir, "after.pt"))
    loop.storage.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
