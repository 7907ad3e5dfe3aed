"""``sample(256)`` of frame-stacked Atari transitions (obs and next_obs, uint8 4x84x84):
rlbuffers with frame-stack deduplication against cpprb's ``stack_compress`` + ``next_of`` and
SB3's ``ReplayBuffer(optimize_memory_usage=True)``, side by side in one process on the same
transitions (issue 33: sampling at least as fast as every peer on the Atari workload, where
the stacks are rebuilt at sample time).

Data: ``--frames`` real Pong transitions (``tools.bench.atari.pong_transitions``: random
policy, DQN preprocessing, gymnasium ``FrameStackObservation``, so an episode's first stack
repeats its reset frame), the last one marked truncated, repeated to ``--transitions``.
``next_obs`` is the next transition's stack within an episode; at an episode's end (where the
data has no next frame) the stack shifted by one with its newest frame repeated.

- rlbuffers: ``FieldSpec((4, 84, 84), "uint8", stack_axis=0)`` and ``next_of={"next_obs":
  "obs"}``: one 84x84 frame per transition on disk, stacks rebuilt on every read.
- cpprb: ``env_dict`` obs ``(84, 84, 4)`` (its ``stack_compress`` stacks along the last
  axis), ``next_of="obs"``, ``stack_compress="obs"``, ``on_episode_end()`` after each
  episode; the same frames, channels last.
- SB3: ``ReplayBuffer(optimize_memory_usage=True)``: every stack whole, next_obs the next
  row (its documented limitation at episode ends).

Each buffer is filled, its sampled stacks are checked against the source transitions (the
reward column holds each transition's id), then ``sample(256)`` of every system is timed in
``--rounds`` interleaved rounds (``bench_peers.interleaved``; calls/s and CPU time per call,
medians); then the same for prioritized buffers (rlbuffers and cpprb; the first half of the
transitions gets priority 1e-6).

Run in the peers venv (``tools/bench/peers_env.py``): ``python -m
tools.bench.bench_framestack_sample``. Writes the ``framestack_sample`` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from tools.bench.atari import pong_transitions
from tools.bench.bench_peers import B, interleaved
from tools.bench.report import stamp, table, write_section


def source(frames: int) -> dict[str, np.ndarray]:
    """``frames`` real Pong transitions with ``next_obs``; the last one ends its episode."""
    data = pong_transitions(frames)
    data["truncated"][-1] = ~data["terminated"][-1]
    ends = data["terminated"] | data["truncated"]
    nxt = np.empty_like(data["obs"])
    nxt[:-1] = data["obs"][1:]
    shifted = np.concatenate([data["obs"][:, 1:], data["obs"][:, -1:]], axis=1)
    nxt[ends] = shifted[ends]
    data["next_obs"] = nxt
    return data


def batches(src: dict[str, np.ndarray], n: int, size: int = 1000):
    """``n`` transitions of ``src`` repeated, ``reward`` = transition id, in batches."""
    m = len(src["action"])
    for a in range(0, n, size):
        ids = np.arange(a, min(a + size, n))
        batch = {k: v[ids % m] for k, v in src.items()}
        batch["reward"] = ids.astype(np.float32)
        yield batch


class Ours:
    name = "rlbuffers (frame-stack deduplication)"

    def __init__(self, path: Path, cap: int, per: bool) -> None:
        fields = {"obs": FieldSpec((4, 84, 84), "uint8", stack_axis=0),
                  "action": FieldSpec((), "int64"), "reward": FieldSpec((), "float32"),
                  "terminated": FieldSpec((), "bool"), "truncated": FieldSpec((), "bool")}
        self.buf = ReplayBuffer.create(path, capacity=cap, fields=fields, seed=0,
                                       overwrite=True, next_of={"next_obs": "obs"},
                                       sampler=PrioritizedSampler() if per else None)

    def add(self, batch: dict[str, np.ndarray]) -> None:
        self.buf.extend(batch)

    def sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = self.buf.sample(B)
        return out["obs"], out["next_obs"], out["reward"]

    def set_priorities(self, low: np.ndarray) -> None:
        self.buf.update_priorities(np.arange(len(low)), np.where(low, 1e-6, 1.0))

    def close(self) -> None:
        self.buf.close()


class Cpprb:
    name = "cpprb (stack_compress + next_of)"

    def __init__(self, path: Path, cap: int, per: bool) -> None:
        import cpprb

        env = {"obs": {"shape": (84, 84, 4), "dtype": np.uint8}, "action": {"dtype": np.int64},
               "reward": {"dtype": np.float32}, "done": {"dtype": np.bool_}}
        cls = cpprb.PrioritizedReplayBuffer if per else cpprb.ReplayBuffer
        self.rb = cls(cap, env, next_of="obs", stack_compress="obs",
                      **({"alpha": 0.6} if per else {}))

    def add(self, batch: dict[str, np.ndarray]) -> None:
        done = batch["terminated"] | batch["truncated"]
        cuts = np.flatnonzero(done) + 1
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(done)], strict=True):
            if a == b:
                continue
            self.rb.add(obs=batch["obs"][a:b].transpose(0, 2, 3, 1),
                        next_obs=batch["next_obs"][a:b].transpose(0, 2, 3, 1),
                        action=batch["action"][a:b], reward=batch["reward"][a:b],
                        done=done[a:b])
            if done[b - 1]:
                self.rb.on_episode_end()

    def sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = self.rb.sample(B)
        return (out["obs"].transpose(0, 3, 1, 2), out["next_obs"].transpose(0, 3, 1, 2),
                out["reward"].ravel())

    def set_priorities(self, low: np.ndarray) -> None:
        self.rb.update_priorities(np.arange(len(low)), np.where(low, 1e-6, 1.0))

    def close(self) -> None:
        del self.rb


class Sb3:
    name = "SB3 ReplayBuffer (optimize_memory_usage)"

    def __init__(self, path: Path, cap: int, per: bool) -> None:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer as RB

        self.rb = RB(cap, spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(6),
                     device="cpu", optimize_memory_usage=True,
                     handle_timeout_termination=False)

    def add(self, batch: dict[str, np.ndarray]) -> None:
        done = batch["terminated"] | batch["truncated"]
        for i in range(len(done)):
            self.rb.add(batch["obs"][i : i + 1], batch["next_obs"][i : i + 1],
                        batch["action"][i : i + 1], batch["reward"][i : i + 1],
                        done[i : i + 1], [{}])

    def sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = self.rb.sample(B)
        return (out.observations.numpy(), out.next_observations.numpy(),
                out.rewards.numpy().ravel())

    def close(self) -> None:
        del self.rb


def exact(system: Any, src: dict[str, np.ndarray], sb3: bool) -> str:
    """Whether 20 sampled batches equal the source stacks of their transition ids ("next_obs"
    is not checked for SB3, whose next row is the next episode's first stack at an end)."""
    m = len(src["action"])
    for _ in range(20):
        obs, nxt, ids = system.sample()
        ids = np.asarray(ids).astype(np.int64) % m
        if not np.array_equal(obs, src["obs"][ids]):
            return "no (obs)"
        if not sb3 and not np.array_equal(nxt, src["next_obs"][ids]):
            return "no (next_obs)"
    return "yes" + (" (obs; next_obs wrong at episode ends by design)" if sb3 else "")


def measure(src: dict[str, np.ndarray], n: int, rounds: int, root: Path,
            per: bool) -> dict[str, dict[str, Any]]:
    """Build and fill every system, check, time ``sample(256)`` interleaved."""
    kinds: list[type] = [Ours, Cpprb] if per else [Ours, Cpprb, Sb3]
    systems, out = {}, {}
    for cls in kinds:
        t = time.perf_counter()
        s = cls(root / cls.__name__, n, per)
        for b in batches(src, n):
            s.add(b)
        if per:
            s.set_priorities(np.arange(n) < n // 2)
        out[cls.name] = {"fill_s": time.perf_counter() - t, "exact": exact(s, src, cls is Sb3)}
        print(cls.name, out[cls.name], flush=True)
        for _ in range(-(-n // B)):  # warm up: every system's pages touched as in training
            s.sample()
        systems[cls.name] = s
    fns: dict[str, Callable[[], Any]] = {name: s.sample for name, s in systems.items()}
    for name, (rate, cpu) in interleaved(fns, rounds).items():
        out[name].update(per_s=rate, cpu_s=cpu)
        print(name, "prioritized" if per else "uniform", f"{rate:,.0f}/s",
              f"{cpu * 1e6:,.0f} us CPU", flush=True)
    for s in systems.values():
        s.close()
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transitions", type=int, default=100_000)
    ap.add_argument("--frames", type=int, default=5000, help="real Pong transitions collected")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print, don't write the docs")
    args = ap.parse_args()
    t0 = time.perf_counter()
    src = source(args.frames)
    root = Path(tempfile.mkdtemp(prefix="rlb-fs-"))
    try:
        uni = measure(src, args.transitions, args.rounds, root, per=False)
        shutil.rmtree(root)
        root.mkdir()
        pri = measure(src, args.transitions, args.rounds, root, per=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ours = uni[Ours.name]
    rows = []
    for name, r in uni.items():
        p = pri.get(name)
        rows.append([name, f"{r['fill_s']:.1f}", r["exact"], f"{r['per_s']:,.0f}",
                     f"{r['cpu_s'] * 1e6:,.0f}",
                     f"{ours['per_s'] / r['per_s']:.2f}x" if name != Ours.name else "-",
                     f"{p['per_s']:,.0f}" if p else "n/a",
                     (f"{pri[Ours.name]['per_s'] / p['per_s']:.2f}x" if name != Ours.name
                      else "-") if p else "n/a"])
    heads = ["system", "fill s", "samples equal the source", "uniform sample(256)/s",
             "CPU us per call", "ours / this", "prioritized sample(256)/s", "ours / this"]
    episodes = int((src["terminated"] | src["truncated"]).sum())
    body = (
        "## Frame-stacked Atari sampling: rlbuffers vs cpprb and SB3\n\n"
        f"{stamp()} `python -m tools.bench.bench_framestack_sample --transitions "
        f"{args.transitions} --rounds {args.rounds}` in the venv of `tools/bench/peers_env.py`;"
        f" total {time.perf_counter() - t0:,.0f} s. {args.frames:,} real Pong transitions "
        f"({episodes} episode ends; the last transition marked truncated) repeated to "
        f"{args.transitions:,}; each `sample(256)` returns obs and next_obs (uint8 "
        "4x84x84 each, 14.5 MB a call): rlbuffers rebuilds both from one stored frame per "
        "transition (`FieldSpec(stack_axis=0)`, `next_of`), cpprb from its `stack_compress` "
        "frames (channels last, as it stacks), SB3 copies whole stored stacks. Sampling timed "
        f"with every system's buffer in memory at once, {args.rounds} interleaved rounds (up "
        "to 200 calls or 5 s each), medians; CPU time per call counts all threads. "
        "Prioritized: the first half of the transitions at priority 1e-6, the rest 1.\n\n"
        + table(heads, rows) + "\n"
    )
    print(body)
    if not args.no_write:
        write_section("framestack_sample", body)


if __name__ == "__main__":
    main()
