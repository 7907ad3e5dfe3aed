"""Learning with HER on disk vs in RAM: section ``her`` of ``docs/benchmarks.md``.

DQN (``MultiInputPolicy``) on SB3's ``BitFlippingEnv`` (``--n-bits`` bits, episodes of at most
``n_bits`` steps, reward -1 until the state equals the goal; Andrychowicz et al. 2017,
"Hindsight Experience Replay", section 4.1) with HER's ``future`` strategy and
``n_sampled_goal=4`` (section 4.5), once with SB3's ``HerReplayBuffer`` (in RAM) and once with
``ZarrHerReplayBuffer`` (on disk, committed every ``--commit-every`` steps with
``CommitCallback``), same seeds, same hyperparameters, one torch thread, the two taken in
turn per seed. Reported per seed: the success rate of the final greedy policy over
``--eval-episodes`` episodes (an evaluation env seeded by the seed), the success rate of the
last 100 training episodes, and the wall time of ``learn``.

Run: ``python -m tools.bench.her_bitflip`` (defaults: 15 bits, 12,000 steps, seeds 0 1 2).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np
import torch as th
from stable_baselines3 import DQN, HerReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.vec_env import DummyVecEnv

from rlbuffers.integrations.sb3 import CommitCallback, ZarrHerReplayBuffer


class Successes(BaseCallback):
    """Success (``info["is_success"]``) of each ended training episode, and the greedy
    policy's success rate every ``every`` steps (``evaluate``: it draws from no RNG that
    training uses; its time is kept apart)."""

    def __init__(self, n_bits: int, every: int, episodes: int, seed: int) -> None:
        super().__init__()
        self.last: deque[bool] = deque(maxlen=100)
        self.n_bits, self.every, self.episodes, self.seed = n_bits, every, episodes, seed
        self.curve: list[float] = []
        self.eval_seconds = 0.0

    def _on_step(self) -> bool:
        for done, info in zip(self.locals["dones"], self.locals["infos"], strict=True):
            if done:
                self.last.append(bool(info.get("is_success", False)))
        if self.num_timesteps % self.every == 0:
            start = time.perf_counter()
            self.curve.append(evaluate(self.model, self.n_bits, self.episodes, self.seed))
            self.eval_seconds += time.perf_counter() - start
        return True


def evaluate(model: DQN, n_bits: int, episodes: int, seed: int) -> float:
    """Success rate of the greedy policy over ``episodes`` episodes."""
    env = BitFlippingEnv(n_bits=n_bits, max_steps=n_bits)
    wins = 0
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed * 100_000 + ep)
        for _ in range(n_bits):
            action, _ = model.predict(obs, deterministic=True)
            obs, _, terminated, truncated, info = env.step(int(action))
            if terminated or truncated:
                break
        wins += bool(info["is_success"])
    return wins / episodes


def run(buffer: str, seed: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    env = DummyVecEnv([lambda: BitFlippingEnv(n_bits=args.n_bits, max_steps=args.n_bits)])
    kwargs: dict[str, Any] = {"n_sampled_goal": 4, "goal_selection_strategy": "future"}
    successes = Successes(args.n_bits, args.eval_every, args.eval_episodes, seed)
    callbacks: list[BaseCallback] = [successes]
    if buffer == "zarr":
        kwargs["path"] = f"{tmp}/buffer_{seed}"
        callbacks.append(CommitCallback(args.commit_every))
    model = DQN("MultiInputPolicy", env, seed=seed, device="cpu", buffer_size=args.steps,
                learning_rate=1e-3, learning_starts=1_000, batch_size=256, gamma=0.95,
                train_freq=1, gradient_steps=1, target_update_interval=500,
                exploration_fraction=0.1, exploration_final_eps=0.02,
                policy_kwargs={"net_arch": [256, 256]},
                replay_buffer_class=ZarrHerReplayBuffer if buffer == "zarr" else HerReplayBuffer,
                replay_buffer_kwargs=kwargs)
    start = time.perf_counter()
    model.learn(args.steps, callback=callbacks)
    seconds = time.perf_counter() - start - successes.eval_seconds
    train = float(np.mean(successes.last)) if successes.last else 0.0
    if buffer == "zarr":
        model.replay_buffer.close()
    return {"eval": evaluate(model, args.n_bits, args.eval_episodes, seed), "train": train,
            "seconds": seconds, "curve": successes.curve,
            "params": {k: v.clone() for k, v in model.policy.state_dict().items()}}


def per_call(n_bits: int, tmp: str) -> list[list[str]]:
    """Milliseconds per ``add`` and per ``sample(256)`` of both buffers, the same 4,000 random
    steps added to each (medians of 3 rounds)."""
    from tools.bench.report import median_of

    env = DummyVecEnv([lambda: BitFlippingEnv(n_bits=n_bits, max_steps=n_bits)])
    args = (20_000, env.observation_space, env.action_space, env, "cpu")
    bufs = {"sb3": HerReplayBuffer(*args), "zarr": ZarrHerReplayBuffer(*args, path=f"{tmp}/pc")}
    rng, obs = np.random.default_rng(0), env.reset()
    steps = []
    for _ in range(4_000):
        action = rng.integers(0, n_bits, size=1)
        new_obs, reward, done, infos = env.step(action)
        nxt = {k: v.copy() for k, v in new_obs.items()}
        if done[0]:
            nxt = {k: v[None] for k, v in infos[0]["terminal_observation"].items()}
        steps.append((obs, nxt, action.reshape(1, 1), reward, done, infos))
        obs = new_obs
    out = []
    for name, buf in bufs.items():
        start = time.perf_counter()
        for step in steps:
            buf.add(*step)
        add_ms = (time.perf_counter() - start) / len(steps) * 1e3

        def sample(buf: Any = buf) -> float:
            start = time.perf_counter()
            for _ in range(300):
                buf.sample(256)
            return (time.perf_counter() - start) / 300 * 1e3

        out.append([name, f"{add_ms:.3f}", f"{median_of(sample):.3f}"])
    bufs["zarr"].close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-bits", type=int, default=15)
    ap.add_argument("--steps", type=int, default=12_000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-episodes", type=int, default=200)
    ap.add_argument("--commit-every", type=int, default=2_000)
    ap.add_argument("--eval-every", type=int, default=2_000)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    from tools.bench.report import stamp, table, write_section

    th.set_num_threads(1)
    rows, curves, results = [], [], {"sb3": [], "zarr": []}
    with tempfile.TemporaryDirectory(prefix="bench-her-") as tmp:
        for seed in args.seeds:
            got = {b: run(b, seed, args, tmp) for b in ("sb3", "zarr")}
            a, b = got["sb3"]["params"], got["zarr"]["params"]
            same = "yes" if all(th.equal(a[k], b[k]) for k in a) else "no"
            for name, r in got.items():
                results[name].append(r)
                curves.append([seed, name, *(f"{x:.2f}" for x in r["curve"])])
            rows.append([seed, f"{got['sb3']['eval']:.2f}", f"{got['zarr']['eval']:.2f}",
                         f"{got['sb3']['train']:.2f}", f"{got['zarr']['train']:.2f}",
                         f"{got['sb3']['seconds']:.1f}", f"{got['zarr']['seconds']:.1f}", same])
            print(rows[-1], curves[-2:], flush=True)
        calls = per_call(args.n_bits, tmp)
    mean = {b: {k: float(np.mean([r[k] for r in rs])) for k in ("eval", "train", "seconds")}
            for b, rs in results.items()}
    rows.append(["mean", *(f"{mean[b]['eval']:.2f}" for b in ("sb3", "zarr")),
                 *(f"{mean[b]['train']:.2f}" for b in ("sb3", "zarr")),
                 *(f"{mean[b]['seconds']:.1f}" for b in ("sb3", "zarr")), ""])
    marks = [f"{(i + 1) * args.eval_every:,}" for i in range(args.steps // args.eval_every)]
    body = "\n".join([
        f"## HER on disk: DQN on BitFlippingEnv ({args.n_bits} bits), SB3's HerReplayBuffer "
        "vs ZarrHerReplayBuffer (`tools/bench/her_bitflip.py`)",
        "",
        stamp(),
        "",
        f"{args.steps:,} steps per run, `future` strategy, `n_sampled_goal=4`, DQN lr 1e-3, "
        "batch 256, gamma 0.95, net [256, 256], one torch thread; ZarrHerReplayBuffer commits "
        f"every {args.commit_every:,} steps (`CommitCallback`). Success: the greedy policy's "
        f"over {args.eval_episodes} evaluation episodes, and the last 100 training episodes'. "
        "Seconds: `learn`, commits included, evaluations left out (the two runs of a seed "
        "run in turn on a shared 2-core machine that other jobs load: differences of tens "
        "of percent are noise; the per-call costs at the end are the buffers' own). Same "
        "params: the two runs end with identical network parameters.",
        "",
        table(["seed", "success SB3", "success Zarr", "train success SB3",
               "train success Zarr", "seconds SB3", "seconds Zarr", "same params"], rows),
        "",
        "Greedy success rate during training, after each number of steps:",
        "",
        table(["seed", "buffer", *marks], curves),
        "",
        "Per call, the same 4,000 random steps in each buffer (medians of 3 x 300 samples):",
        "",
        table(["buffer", "ms per add", "ms per sample(256)"], calls),
    ])
    print(body)
    if not args.no_write:
        write_section("her", body)


if __name__ == "__main__":
    main()
