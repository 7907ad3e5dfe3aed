"""rlbuffers against its peers, side by side in one process on the same data.

Systems: rlbuffers; Stable-Baselines3 ``ReplayBuffer`` + ``save_replay_buffer`` (a pickle);
TorchRL ``ReplayBuffer(LazyMemmapStorage)`` + ``dumps``/``loads``; cpprb ``ReplayBuffer`` +
``save_transitions``/``load_transitions``; and a plain in-RAM ring of numpy arrays saved with
``pickle`` into ``gzip.open`` (defaults: protocol 4, level 9).

Workloads: (a) real Pong frames, uint8 4x84x84, 100k transitions; (b) float32 256 KB
observations, 10k transitions; (c) ragged int32 token trajectories, lengths 50-2,000.

Per system, a cycle: fill; full save (wall, peak extra RSS, bytes on disk); add 2% and save
again (rlbuffers writes only the changed chunks; every peer re-saves everything); drop the
buffer; open/load (wall, extra RSS after). Cycles repeat ``--runs`` times or until the system
has used ``--budget-s`` seconds of the workload (at least once); the tables say how many ran.
Then, with every system's last-loaded buffer open at once, uniform ``sample(256)`` throughput
and CPU time per call in ``--rounds`` interleaved rounds (medians); then the same for
prioritized buffers given identical priorities, and whether priorities survive save+load.
``reward`` holds each transition's id, so sampled batches can be compared across a save and
load.

Run inside the peers venv: ``python3 tools/bench/peers_env.py`` then
``.cache/peers-venv/bin/python -m tools.bench.bench_peers``. Writes the ``peers`` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import pickle
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from rlbuffers import FieldSpec, PrioritizedSampler, ReplayBuffer
from tools.bench.bench_buffer import PeakRSS
from tools.bench.report import stamp, table, write_section

warnings.filterwarnings("ignore", category=UserWarning)
B = 256
MAX_TOKENS = 2000


# -- workloads ---------------------------------------------------------------------------------
@dataclass
class Workload:
    """``n`` transitions made on demand by ``batch(start, count)``; ``obs`` fixed or ragged."""

    key: str
    title: str
    n: int
    obs_shape: tuple[int, ...] | None  # None: ragged int32 tokens
    obs_dtype: Any
    batch: Callable[[int, int], dict[str, Any]]
    note: str
    raw_bytes: int = 0  # of all n + 2% transitions (obs + 14 bytes of scalars each)

    @property
    def ragged(self) -> bool:
        return self.obs_shape is None

    def batches(self, start: int, count: int, size: int = 1000) -> Iterator[dict[str, Any]]:
        for a in range(start, start + count, size):
            yield self.batch(a, min(size, start + count - a))


def _common(ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"action": (ids % 6).astype(np.int64), "reward": ids.astype(np.float32),
            "terminated": ids % 1000 == 999, "truncated": np.zeros(len(ids), bool)}


def atari(n: int, frames: int) -> Workload:
    from tools.bench.atari import pong_transitions

    src = pong_transitions(frames)["obs"]

    def batch(a: int, k: int) -> dict[str, Any]:
        ids = np.arange(a, a + k)
        return {"obs": src[ids % len(src)], **_common(ids)}

    return Workload("a", "(a) Atari: real Pong frames, uint8 4x84x84", n, (4, 84, 84),
                    np.uint8, batch, f"{frames:,} real Pong transitions (random policy, DQN "
                    "preprocessing) tiled", (n + n // 50) * (28224 + 14))


def big_float(n: int) -> Workload:
    src = np.random.default_rng(0).standard_normal((64, 256, 256)).astype(np.float32)

    def batch(a: int, k: int) -> dict[str, Any]:
        ids = np.arange(a, a + k)
        return {"obs": src[ids % 64] + (ids % 7)[:, None, None].astype(np.float32),
                **_common(ids)}

    return Workload("b", "(b) large observations: float32 256x256 (256 KB)", n, (256, 256),
                    np.float32, batch, "64 random-normal arrays tiled, offset per transition "
                    "(incompressible)", (n + n // 50) * (2**18 + 14))


def tokens(n: int) -> Workload:
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, MAX_TOKENS + 1, n + n // 50 + 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = rng.integers(0, 49152, offsets[-1], dtype=np.int32)

    def batch(a: int, k: int) -> dict[str, Any]:
        ids = np.arange(a, a + k)
        return {"obs": [flat[offsets[i] : offsets[i + 1]] for i in ids], **_common(ids)}

    mean = float(lengths.mean())
    return Workload("c", "(c) ragged token trajectories, int32, lengths 50-2,000", n, None,
                    np.int32, batch, f"random ids < 49,152, uniform lengths (mean {mean:.0f})",
                    int(offsets[n + n // 50]) * 4 + (n + n // 50) * 14)


def padded(obs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows -> ``int32[B, MAX_TOKENS]`` padded with -1, and ``int64[B]`` lengths."""
    out = np.full((len(obs), MAX_TOKENS), -1, np.int32)
    for i, row in enumerate(obs):
        out[i, : len(row)] = row
    return out, np.array([len(r) for r in obs], np.int64)


# -- the systems -------------------------------------------------------------------------------
class System:
    """One buffer implementation: build, add, save, drop, load, sample."""

    name = "?"
    ragged_note = ""
    prioritized = True

    def __init__(self, wl: Workload, cap: int, scratch: Path) -> None:
        self.wl, self.cap, self.scratch = wl, cap, scratch

    def save(self, gen: int) -> Path:
        raise NotImplementedError

    def uniform_rewards(self) -> np.ndarray:
        """Rewards (= transition ids) of one uniform sample(256)."""
        raise NotImplementedError


class RLB(System):
    name = "rlbuffers"
    ragged_note = "ragged field (values + offsets)"

    def build(self, per: bool = False) -> None:
        shape = (None,) if self.wl.ragged else self.wl.obs_shape
        fields = {"obs": FieldSpec(shape, self.wl.obs_dtype), "action": FieldSpec((), "int64"),
                  "reward": FieldSpec((), "float32"), "terminated": FieldSpec((), "bool"),
                  "truncated": FieldSpec((), "bool")}
        self.path = self.scratch / "rlb"
        self.buf = ReplayBuffer.create(self.path, capacity=self.cap, fields=fields, seed=0,
                                       overwrite=True,
                                       sampler=PrioritizedSampler() if per else None)

    def add(self, batch: dict[str, Any]) -> None:
        self.buf.extend(batch)

    def save(self, gen: int) -> Path:
        self.buf.save()
        return self.path

    def drop(self) -> None:
        self.buf.close()
        del self.buf

    def load(self, path: Path) -> None:
        self.buf = ReplayBuffer.open(path)

    def sample(self) -> Any:
        return self.buf.sample(B)

    def sample_packed(self) -> Any:
        """``sample(256)`` with ragged fields packed (values + ``cu_seqlens``, no list)."""
        return self.buf.sample(B, ragged="packed")

    def sample_padded(self) -> Any:
        """``sample(256)`` with ragged fields padded (values [256, L] + lengths, no list)."""
        return self.buf.sample(B, ragged="padded")

    def uniform_rewards(self) -> np.ndarray:
        return np.asarray(self.buf.sample(B)["reward"])

    def set_priorities(self, low: np.ndarray, n: int) -> None:
        self.buf.update_priorities(np.arange(n), np.where(low, 1e-6, 1.0))

    def prio_rewards(self) -> np.ndarray:
        return np.asarray(self.buf.sample(B)["reward"])


class SB3(System):
    name = "SB3 ReplayBuffer"
    ragged_note = "padded int32[2000] obs (-1 = pad; lengths not stored)"
    prioritized = False

    def build(self, per: bool = False) -> None:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer as RB

        shape = (MAX_TOKENS,) if self.wl.ragged else self.wl.obs_shape
        high = 255 if self.wl.obs_dtype == np.uint8 else 2**16
        space = spaces.Box(-1 if self.wl.ragged else 0, high, shape, self.wl.obs_dtype)
        # obs stored once (next obs = following row), as the other systems store it
        self.rb = RB(self.cap, space, spaces.Discrete(6), device="cpu",
                     optimize_memory_usage=True, handle_timeout_termination=False)

    def add(self, batch: dict[str, Any]) -> None:
        obs = padded(batch["obs"])[0] if self.wl.ragged else batch["obs"]
        done = batch["terminated"] | batch["truncated"]
        for i in range(len(obs)):
            self.rb.add(obs[i : i + 1], obs[min(i + 1, len(obs) - 1)][None],
                        batch["action"][i : i + 1], batch["reward"][i : i + 1], done[i : i + 1],
                        [{}])

    def save(self, gen: int) -> Path:
        from stable_baselines3.common.save_util import save_to_pkl

        path = self.scratch / f"sb3-{gen}.pkl"
        save_to_pkl(path, self.rb)  # what model.save_replay_buffer(path) does
        return path

    def drop(self) -> None:
        del self.rb

    def load(self, path: Path) -> None:
        from stable_baselines3.common.save_util import load_from_pkl

        self.rb = load_from_pkl(path)  # what model.load_replay_buffer(path) does

    def sample(self) -> Any:
        return self.rb.sample(B)

    def uniform_rewards(self) -> np.ndarray:
        return self.rb.sample(B).rewards.numpy().ravel()


class TorchRL(System):
    name = "TorchRL LazyMemmapStorage"
    ragged_note = "padded int32[2000] + length"
    prioritized = False  # see PRIORITY_NOTES: its C++ sum tree does not load with torch 2.13

    def build(self, per: bool = False) -> None:
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

        self._n = getattr(self, "_n", 0) + 1
        d = self.scratch / f"trl-scratch-{self._n}"
        self.rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(self.cap, scratch_dir=d),
                                         batch_size=B)

    def _td(self, batch: dict[str, Any]) -> Any:
        import torch
        from tensordict import TensorDict

        data = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()
                if k != "obs"}
        if self.wl.ragged:
            tok, length = padded(batch["obs"])
            data.update(obs=torch.from_numpy(tok), length=torch.from_numpy(length))
        else:
            data["obs"] = torch.from_numpy(batch["obs"])
        return TensorDict(data, batch_size=[len(batch["reward"])])

    def add(self, batch: dict[str, Any]) -> None:
        self.rb.extend(self._td(batch))

    def save(self, gen: int) -> Path:
        path = self.scratch / f"trl-{gen}"
        shutil.rmtree(path, ignore_errors=True)
        self.rb.dumps(path)
        return path

    def drop(self) -> None:
        del self.rb
        gc.collect()
        for d in self.scratch.glob("trl-scratch-*"):
            shutil.rmtree(d, ignore_errors=True)

    def load(self, path: Path) -> None:
        self.build()
        self.rb.loads(path)

    def sample(self) -> Any:
        return self.rb.sample()

    def uniform_rewards(self) -> np.ndarray:
        return self.rb.sample()["reward"].numpy()


class CPPRB(System):
    name = "cpprb"
    ragged_note = "padded int32[2000] + length"

    def _env(self) -> dict[str, Any]:
        shape = (MAX_TOKENS,) if self.wl.ragged else self.wl.obs_shape
        env = {"obs": {"shape": shape, "dtype": self.wl.obs_dtype}, "action": {"dtype": np.int64},
               "reward": {"dtype": np.float32}, "terminated": {"dtype": np.bool_},
               "truncated": {"dtype": np.bool_}}
        if self.wl.ragged:
            env["length"] = {"dtype": np.int64}
        return env

    def build(self, per: bool = False) -> None:
        import cpprb

        cls = cpprb.PrioritizedReplayBuffer if per else cpprb.ReplayBuffer
        self.rb = cls(self.cap, self._env(), **({"alpha": 0.6} if per else {}))
        self.per = per

    def add(self, batch: dict[str, Any]) -> None:
        data = dict(batch)
        if self.wl.ragged:
            data["obs"], data["length"] = padded(batch["obs"])
        self.rb.add(**data)

    def save(self, gen: int) -> Path:
        path = self.scratch / f"cpprb-{gen}.npz"
        self.rb.save_transitions(str(path))
        return path

    def drop(self) -> None:
        del self.rb

    def load(self, path: Path) -> None:
        self.build(self.per)
        self.rb.load_transitions(str(path))

    def sample(self) -> Any:
        return self.rb.sample(B)

    def uniform_rewards(self) -> np.ndarray:
        return self.rb.sample(B)["reward"].ravel()

    def set_priorities(self, low: np.ndarray, n: int) -> None:
        self.rb.update_priorities(np.arange(n), np.where(low, 1e-6, 1.0))

    def prio_rewards(self) -> np.ndarray:
        return self.rb.sample(B)["reward"].ravel()


class _ArraysOnly(pickle.Unpickler):
    """The peer's load: pickle, as the peer stores, but resolving only numpy's array and dtype
    constructors, so a planted file cannot run code (the state is a dict of arrays and lists).
    Not ``rlbuffers.integrations.sb3.inert_pickle``: that one is the pure-Python unpickler
    (every opcode in Python), which would time the peer's load far slower than its real
    ``pickle.load``; this keeps the C unpickler and only narrows ``find_class`` (called once
    per global name, not per byte)."""

    ALLOWED = {(m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray")
               for n in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED and not (module == "numpy.dtypes"
                                                       and name.endswith("DType")):
            raise pickle.UnpicklingError(f"{module}.{name}: not a numpy array part; refused")
        return super().find_class(module, name)


class PickleGzip(System):
    name = "numpy ring + pickle+gzip"
    ragged_note = "Python list of int32 arrays (object)"
    prioritized = False

    def build(self, per: bool = False) -> None:
        c = self.cap
        obs: Any = [None] * c if self.wl.ragged else np.zeros((c, *self.wl.obs_shape),
                                                              self.wl.obs_dtype)
        self.state = {"obs": obs, "action": np.zeros(c, np.int64),
                      "reward": np.zeros(c, np.float32), "terminated": np.zeros(c, bool),
                      "truncated": np.zeros(c, bool), "cursor": 0, "size": 0}
        self.rng = np.random.default_rng(0)

    def add(self, batch: dict[str, Any]) -> None:
        s, k = self.state, len(batch["reward"])
        idx = (s["cursor"] + np.arange(k)) % self.cap
        for name, v in batch.items():
            if isinstance(s[name], list):
                for j, i in enumerate(idx.tolist()):
                    s[name][i] = v[j]
            else:
                s[name][idx] = v
        s["cursor"], s["size"] = int((s["cursor"] + k) % self.cap), min(s["size"] + k, self.cap)

    def save(self, gen: int) -> Path:
        path = self.scratch / f"ring-{gen}.pkl.gz"
        with gzip.open(path, "wb") as f:
            pickle.dump(self.state, f)
        return path

    def drop(self) -> None:
        del self.state

    def load(self, path: Path) -> None:
        with gzip.open(path, "rb") as f:
            self.state = _ArraysOnly(f).load()

    def sample(self) -> Any:
        s = self.state
        idx = self.rng.integers(0, s["size"], B)
        out = {k: s[k][idx] for k in ("action", "reward", "terminated", "truncated")}
        out["obs"] = [s["obs"][i] for i in idx] if self.wl.ragged else s["obs"][idx]
        return out

    def uniform_rewards(self) -> np.ndarray:
        return self.sample()["reward"]


SYSTEMS = [RLB, SB3, TorchRL, CPPRB, PickleGzip]
PRIORITY_NOTES = {
    "SB3 ReplayBuffer": "no prioritized replay buffer",
    "TorchRL LazyMemmapStorage": "n/a: torchrl 0.14.1's C++ sum tree (`torchrl._torchrl`) fails"
    " to load against torch 2.13.0 (undefined symbol), so `PrioritizedSampler` cannot be built",
    "numpy ring + pickle+gzip": "none (plain arrays)",
}


# -- measuring ---------------------------------------------------------------------------------
def _rss() -> int:
    return psutil.Process().memory_info().rss


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and ".working" not in
               p.parts)


def _rate(fn: Callable[[], Any], calls: int = 200, budget_s: float = 5.0) -> tuple[float, float]:
    """``fn``'s calls per second of wall time and its CPU time per call (s, all threads)."""
    fn()
    t, c, k = time.perf_counter(), time.process_time(), 0
    while k < calls and (k < 5 or time.perf_counter() - t < budget_s):
        fn()
        k += 1
    return k / (time.perf_counter() - t), (time.process_time() - c) / k


def interleaved(fns: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, tuple[float, float]]:
    """``{key: (calls/s, CPU s per call)}``: medians of ``rounds`` rounds, each timing every
    ``fns[key]`` in turn (:func:`_rate`), so that a slow spell of the machine falls on every
    system alike rather than on whichever ran then."""
    runs: dict[Any, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            runs[key].append(_rate(fn))
    return {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
            for k, v in runs.items()}


def _warm(fn: Callable[[], Any], n: int, budget_s: float = 20.0) -> None:
    """Draw about ``n`` rows (``n / B`` calls, at most ``budget_s``) before timing, the same
    for every system: a buffer that was just loaded from a memory map (TorchRL, rlbuffers)
    pays a page fault on the first touch of each page, while in-RAM copies were faulted in by
    the load. Training samples millions of times; the figure of interest is the steady rate."""
    t = time.perf_counter()
    for _ in range(-(-n // B)):
        fn()
        if time.perf_counter() - t > budget_s:
            break


def _reseed_globals(seed: int) -> None:
    """What a fresh process looks like to libraries that draw from global RNGs."""
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def _clear(sys_: System) -> None:
    """Drop ``sys_``'s buffer and delete its files."""
    sys_.drop()
    gc.collect()
    for p in sys_.scratch.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def cycle(sys_: System, wl: Workload) -> dict[str, Any]:
    """One fill / save / +2% save / drop / load cycle; returns the measurements and leaves
    the loaded buffer warmed up (its sampling is timed by :func:`interleaved`)."""
    r: dict[str, Any] = {}
    sys_.build()
    t = time.perf_counter()
    for b in wl.batches(0, wl.n):
        sys_.add(b)
    r["fill_s"] = time.perf_counter() - t
    gc.collect()
    with PeakRSS() as m:
        t = time.perf_counter()
        path = sys_.save(0)
        r["save_s"] = time.perf_counter() - t
    r["save_rss"], r["save_anon"], r["bytes"] = m.extra, m.extra_anon, _du(path)
    for b in wl.batches(wl.n, wl.n // 50):
        sys_.add(b)
    with PeakRSS() as m:
        t = time.perf_counter()
        path = sys_.save(1)
        r["inc_s"] = time.perf_counter() - t
    r["inc_rss"] = m.extra
    expected = sys_.uniform_rewards()  # the sample the saved RNG state draws next
    sys_.drop()
    gc.collect()
    _reseed_globals(int(np.random.SeedSequence().entropy % 2**32))
    base = _rss()
    t = time.perf_counter()
    sys_.load(path)
    r["open_s"] = time.perf_counter() - t
    r["open_rss"] = _rss() - base
    r["rng_survives"] = bool(np.array_equal(expected, sys_.uniform_rewards()))
    _warm(sys_.sample, wl.n)
    return r


def prioritized(sys_: System, wl: Workload) -> None:
    """Build ``sys_`` with prioritized sampling, fill it and give the first half of the
    transitions priority 1e-6 (the rest 1); warm it up (its sampling is timed by
    :func:`interleaved`, every system with the same priorities)."""
    sys_.build(per=True)
    for b in wl.batches(0, wl.n):
        sys_.add(b)
    low = np.arange(wl.n) < wl.n // 2
    sys_.set_priorities(low, wl.n)
    _warm(sys_.prio_rewards, wl.n)


def priorities_survive(sys_: System, wl: Workload) -> dict[str, Any]:
    """Save and load the buffer of :func:`prioritized`: after a faithful load almost no
    sample hits the first half (priority 1e-6)."""
    path = sys_.save(0)
    sys_.drop()
    gc.collect()
    sys_.load(path)
    hits = np.concatenate([sys_.prio_rewards() for _ in range(20)]) < wl.n // 2
    return {"prio_survive": bool(hits.mean() < 0.05), "low_share": float(hits.mean())}


def _timed(loaded: dict[str, System], wl: Workload, rounds: int,
           kinds: dict[str, Callable[[System], Callable[[], Any] | None]]
           ) -> dict[str, dict[str, float]]:
    """``{system: {kind + "_per_s": calls/s, kind + "_cpu_s": CPU s per call}}`` of the
    sampling functions ``kinds[kind](system)`` (None: not timed), interleaved."""
    fns = {(name, kind): fn for name, s in loaded.items() for kind, get in kinds.items()
           if (fn := get(s)) is not None}
    out: dict[str, dict[str, float]] = {name: {} for name in loaded}
    for (name, kind), (rate, cpu) in interleaved(fns, rounds).items():
        out[name].update({f"{kind}_per_s": rate, f"{kind}_cpu_s": cpu})
        print(wl.key, name, kind, f"{rate:,.0f}/s", f"{cpu * 1e6:,.0f} us CPU", flush=True)
    return out


def bench_workload(wl: Workload, runs: int, budget_s: float, root: Path,
                   rounds: int) -> dict[str, dict]:
    """Every system's cycles, then their uniform sampling timed in interleaved rounds with all
    systems loaded; then every prioritized system built, checked and timed the same way."""
    out: dict[str, dict] = {}
    loaded: dict[str, System] = {}
    for cls in SYSTEMS:
        scratch = root / f"{wl.key}-{cls.__name__}"
        scratch.mkdir(parents=True, exist_ok=True)
        sys_ = cls(wl, wl.n + wl.n // 50, scratch)
        t0, cycles = time.perf_counter(), []
        while len(cycles) < runs and (not cycles or time.perf_counter() - t0 < budget_s):
            if cycles:
                _clear(sys_)  # the buffer of the previous cycle
            cycles.append(cycle(sys_, wl))
            print(wl.key, cls.name, cycles[-1], flush=True)
        res = {k: statistics.median(c[k] for c in cycles) for k in cycles[0]
               if k != "rng_survives"}
        res["rng_survives"] = all(c["rng_survives"] for c in cycles)
        res["cycles"] = len(cycles)
        out[cls.name], loaded[cls.name] = res, sys_
    ragged = {"packed": lambda s: s.sample_packed if wl.ragged and isinstance(s, RLB) else None}
    for name, r in _timed(loaded, wl, rounds, {"uniform": lambda s: s.sample, **ragged}).items():
        out[name].update(r)
    for s in loaded.values():
        _clear(s)
    loaded = {s.name: s for s in loaded.values() if s.prioritized}
    for s in loaded.values():
        prioritized(s, wl)
    prio = {"prio": lambda s: s.prio_rewards, "prio_packed": ragged["packed"]}
    for name, r in _timed(loaded, wl, rounds, prio).items():
        out[name].update(r)
    for name, s in loaded.items():
        out[name].update(priorities_survive(s, wl))
        print(wl.key, name, "prioritized", out[name]["low_share"], flush=True)
        _clear(s)
    for cls in SYSTEMS:
        shutil.rmtree(root / f"{wl.key}-{cls.__name__}", ignore_errors=True)
    return out


# -- reporting ---------------------------------------------------------------------------------
def _mb(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def _row(name: str, r: dict, wl: Workload, raw: int) -> list[str]:
    prio = (f"{r['prio_per_s']:,.0f}" if "prio_per_s" in r else "n/a")
    surv = (f"{'yes' if r['prio_survive'] else 'no'} ({r['low_share']:.0%} low)"
            if "prio_survive" in r else "n/a")
    return [
        name + (f" ({r['cycles']} run{'s' * (r['cycles'] > 1)})"),
        f"{r['fill_s']:.1f}", f"{r['save_s']:.2f}",
        f"{_mb(r['save_rss'])} / {_mb(r['save_anon'])} ({r['save_rss'] / raw:.2f}x)",
        f"{r['bytes'] / 1e6:,.1f} ({r['bytes'] / raw:.2f})", f"{r['inc_s']:.2f}",
        f"{r['open_s'] * 1000:,.1f}", _mb(r["open_rss"]), f"{r['uniform_per_s']:,.0f}", prio,
        surv, "yes" if r["rng_survives"] else "no",
    ]


def _ratios(res: dict[str, dict]) -> list[list[str]]:
    ours = res["rlbuffers"]
    rows = []
    for name, r in res.items():
        if name == "rlbuffers":
            continue
        rows.append([
            name,
            f"{r['inc_s'] / ours['inc_s']:,.1f}x",
            f"{r['open_s'] / ours['open_s']:,.1f}x",
            f"{ours['uniform_per_s'] / r['uniform_per_s']:.2f}x"
            + (f" (packed: {ours['packed_per_s'] / r['uniform_per_s']:.2f}x)"
               if "packed_per_s" in ours else ""),
            f"{ours['prio_per_s'] / r['prio_per_s']:.2f}x"
            + (f" (packed: {ours['prio_packed_per_s'] / r['prio_per_s']:.2f}x)"
               if "prio_packed_per_s" in ours else "") if "prio_per_s" in r else "n/a",
            f"{r['uniform_cpu_s'] / ours['uniform_cpu_s']:.2f}x",
            f"{r['bytes'] / ours['bytes']:.1f}x",
        ])
    return rows


def section(wl: Workload, res: dict[str, dict]) -> str:
    raw = wl.raw_bytes
    heads = ["system (cycles)", "fill s", "full save s",
             "save peak extra RSS MB: all / anon (all / raw)",
             "bytes on disk MB (/ raw)", "save after +2% s", "open/load ms",
             "RSS after open MB", "uniform sample(256)/s", "prioritized sample(256)/s",
             "priorities survive save+load", "RNG survives"]
    rows = [_row(n, r, wl, raw) for n, r in res.items()]
    ours = res.get("rlbuffers", {})
    if "packed_per_s" in ours:  # the same buffer sampled with ragged="packed"
        rows.insert(1, ['rlbuffers, `sample(256, ragged="packed")`', *["same"] * 7,
                        f"{ours['packed_per_s']:,.0f}",
                        f"{ours['prio_packed_per_s']:,.0f}" if "prio_packed_per_s" in ours
                        else "n/a", "same", "same"])
    notes = ", ".join(f"{n}: {SYSTEMS[i].ragged_note}" for i, n in enumerate(res)) \
        if wl.ragged else ""
    rheads = ["peer", "peer's +2% re-save / ours", "peer's load / our open",
              "our uniform sample/s / peer's" + (' (and with ragged="packed")' if wl.ragged
                                                 else ""),
              "our prioritized sample/s / peer's", "peer's CPU per uniform sample / ours",
              "peer's bytes / ours"]
    return (
        f"### {wl.title}, {wl.n:,} transitions (+2%: {wl.n // 50:,})\n\n"
        f"Data: {wl.note}. Raw size ~{raw / 1e9:.2f} GB."
        + (f" Ragged storage per system: {notes}." if notes else "") + "\n\n"
        + table(heads, rows) + "\n\nRatios (> 1x: rlbuffers better):\n\n"
        + table(rheads, _ratios(res)) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3, help="fill/save/load cycles per system")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds timing every system's sampling")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="per system and workload: start no new cycle after this many seconds")
    ap.add_argument("--atari", type=int, default=100_000)
    ap.add_argument("--frames", type=int, default=5000, help="real Pong transitions collected")
    ap.add_argument("--big", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--workloads", default="abc")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print, don't write the docs")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="rlb-peers-"))
    makers = {"a": lambda: atari(args.atari, args.frames), "b": lambda: big_float(args.big),
              "c": lambda: tokens(args.tokens)}
    parts = []
    t0 = time.perf_counter()
    try:
        for key in args.workloads:
            wl = makers[key]()
            parts.append(section(wl, bench_workload(wl, args.runs, args.budget_s, root,
                                                       args.rounds)))
            print(parts[-1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    versions = _versions()
    body = (
        "## rlbuffers vs peers (same process, same data)\n\n"
        f"{stamp()} `python -m tools.bench.bench_peers` in the venv of "
        f"`tools/bench/peers_env.py` ({versions}); total {time.perf_counter() - t0:,.0f} s. "
        "Each system runs cycles of fill, full save, +2% transitions and save again, drop, "
        f"open/load: medians of up to {args.runs} cycles (fewer where a "
        f"system's cycles passed {args.budget_s:.0f} s; the first column says how many). "
        "Sampling is timed with every system's last-loaded buffer open at once (each warmed "
        "up by ~n/256 calls after its load): uniform `sample(256)` calls per second, medians "
        f"of {args.rounds} interleaved rounds (each system in turn, up to 200 calls or 5 s "
        "each), so a slow spell of the shared machine falls on all systems alike; then the "
        "same for prioritized buffers (built, filled and given the same priorities; then "
        "each saved and loaded to see whether they survive). "
        "CPU time per call counts all threads (rlbuffers copies gathers of >= 4 MB in "
        "parallel parts, numpy's `take` releasing the GIL; the peers copy in one thread). Peers "
        "have no incremental save, so their '+2%' save rewrites everything; their saves return "
        "once the bytes are in the page cache (no fsync), while an rlbuffers save compresses "
        "and fsyncs its chunks and manifest before it returns. Peak extra RSS is "
        "sampled every 2 ms during the save; 'anon' excludes file-backed pages (page cache "
        "mapped by memmaps). RSS after open is the RSS growth across open/load. SB3 stores obs "
        "once (`optimize_memory_usage=True`), like the others. 'RNG survives': after a save, "
        "reseeding numpy's and torch's global RNGs (as a new process would have them) and "
        "loading, the next uniform sample equals the one the original would draw. 'Priorities "
        "survive': half of the transitions get priority 1e-6 before the save; after loading, "
        "the share of prioritized samples from that half (should be ~0%).\n\n"
        + "\n".join(parts) + "\nNo prioritized sampling: "
        + "; ".join(f"{k}: {v}" for k, v in PRIORITY_NOTES.items()) + "."
    )
    if args.no_write:
        print(body)
    else:
        write_section("peers", body)


def _versions() -> str:
    from importlib.metadata import version

    out = []
    for p in ("torch", "stable-baselines3", "torchrl", "tensordict", "cpprb", "zarr"):
        try:
            out.append(f"{p} {version(p)}")
        except Exception:  # noqa: BLE001 - a missing peer is reported, not fatal
            out.append(f"{p} missing")
    return ", ".join(out)


if __name__ == "__main__":
    main()
