"""Offline datasets: rlbuffers' Minari / Parquet conversion and sampling against Minari itself,
and a dataset larger than the memory cap converted and exported under that cap.

Speed (section ``offline`` of docs/benchmarks.md): a HalfCheetah-v5 dataset of ``--steps``
random-policy steps is recorded with Minari's ``DataCollector`` (the env's own stepping time is
measured apart), then, each in a fresh subprocess, ``--repeats`` times (medians):
Minari reading every episode (``iterate_episodes``) vs ``rlbuffers convert minari``
(``from_minari``: Minari's read + our write and commit) and reading the buffer's episodes
(``EpisodeReader``); Minari writing the episodes (``create_dataset_from_buffers``) vs
``to_minari`` (our read + Minari's write) and ``to_parquet``; and sampling 256 transitions:
``buf.sample(256)`` vs ``sample_episodes`` + flattening the episodes into transitions + 256
random rows (how a Minari user gets a batch of transitions).

Memory (section ``offline_memory``): a synthetic image dataset (``84x84x3`` uint8
observations) of ``--memory-gb`` GB is written with ``create_dataset_from_buffers`` (no JPEG),
then converted (``from_minari``), exported to Minari and to Parquet, each in a child process
inside a memory cgroup of ``--cap-gb`` (the cgroup code of ``bench_larger_than_ram``); each
export twice: with the reader's chunk cache the exports pick (``scan_cache_bytes``) and with
``ReplayBuffer.open``'s default 256 MiB (what the exports used before they chose one). As a
control, a child loads the dataset's observations into RAM (an in-memory loader).

Run: ``python -m tools.bench.bench_offline [--steps 20000] [--repeats 3] [--memory-gb 2]
[--cap-gb 1] [--skip-memory] [--skip-speed]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.bench.report import stamp, table, write_section

ROOT = Path(__file__).resolve().parents[2]
SRC_ID, BACK_ID, WRITE_ID = "bench/cheetah-v0", "bench/back-v0", "bench/w-v0"
BIG_ID = "bench/big-v0"


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _AnonPeak:
    """The largest RssAnon (the process's own memory, without the file pages it maps, which
    VmHWM counts too) seen every 20 ms by a thread."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _status_mb("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_mb("RssAnon"))


# -- children ------------------------------------------------------------------------------------
def _record(d: Path, steps: int) -> dict:
    import gymnasium as gym

    from tests.offline_data import record

    t = time.perf_counter()
    record(SRC_ID, "HalfCheetah-v5", steps, seed=0)
    total = time.perf_counter() - t
    env = gym.make("HalfCheetah-v5")
    env.action_space.seed(0)
    env.reset(seed=0)
    t = time.perf_counter()
    for _ in range(steps):
        _, _, te, tr, _ = env.step(env.action_space.sample())
        if te or tr:
            env.reset()
    return {"seconds": total, "env_seconds": time.perf_counter() - t}


def _flat_transitions(episodes) -> dict:
    obs = np.concatenate([e.observations[:-1] for e in episodes])
    nxt = np.concatenate([e.observations[1:] for e in episodes])
    return {"obs": obs, "next_obs": nxt, "action": np.concatenate([e.actions for e in episodes]),
            "reward": np.concatenate([e.rewards for e in episodes]),
            "terminated": np.concatenate([e.terminations for e in episodes])}


def _child(task: str, d: Path) -> dict:  # noqa: C901 - one branch per task
    import minari

    from rlbuffers import ReplayBuffer
    from rlbuffers.integrations.minari import from_minari, to_minari
    from rlbuffers.integrations.parquet import to_parquet
    from rlbuffers.maintenance.episodes import EpisodeReader

    anon = _AnonPeak()
    t = time.perf_counter()
    out: dict = {}
    if task == "minari_read":
        n = sum(len(e.observations) for e in minari.load_dataset(SRC_ID).iterate_episodes())
        out["rows"] = n
    elif task == "minari_write":
        eps = list(minari.load_dataset(SRC_ID).iterate_episodes())
        from minari.data_collector import EpisodeBuffer
        bufs = [EpisodeBuffer(observations=e.observations, actions=e.actions,
                              rewards=e.rewards, terminations=e.terminations,
                              truncations=e.truncations, infos={}) for e in eps]
        src = minari.load_dataset(SRC_ID)
        t = time.perf_counter()  # the write only
        minari.create_dataset_from_buffers(WRITE_ID, bufs, observation_space=src.observation_space,
                                           action_space=src.action_space, algorithm_name="x",
                                           author="x", author_email="x", code_permalink="x",
                                           description="x")
    elif task == "convert":
        from_minari(SRC_ID, d / "buf", overwrite=True).close()
    elif task == "buffer_read":
        with ReplayBuffer.open(d / "buf", mode="r") as buf:
            out["rows"] = sum(len(p) for p in EpisodeReader(buf))
    elif task == "to_minari":
        to_minari(d / "buf", BACK_ID, overwrite=True)
    elif task == "to_parquet":
        to_parquet(d / "buf", d / "pq", overwrite=True)
    elif task.startswith("sample_"):
        out["per_sample_ms"] = _sample(task, d)
    elif task.startswith("big_"):
        out.update(_big(task, d))
    out["seconds"] = time.perf_counter() - t
    out["peak_rss_mb"] = _status_mb("VmHWM")
    out["peak_anon_mb"] = anon.stop()
    return out


def _sample(task: str, d: Path) -> float:
    import minari

    from rlbuffers import ReplayBuffer

    rng = np.random.default_rng(0)
    if task == "sample_rlbuffers":
        buf = ReplayBuffer.open(d / "buf", mode="r")
        draw = lambda: buf.sample(256, rng=rng)  # noqa: E731
    else:
        ds = minari.load_dataset(SRC_ID)
        ds.set_seed(0)
        k = min(256 if task == "sample_minari" else 4, ds.total_episodes)

        def draw():
            rows = _flat_transitions(ds.sample_episodes(k))
            pick = rng.integers(0, len(rows["reward"]), 256)
            return {n: v[pick] for n, v in rows.items()}
    draw()
    times = []
    for _ in range(300 if task == "sample_rlbuffers" else 30):
        t = time.perf_counter()
        draw()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _big(task: str, d: Path) -> dict:
    import minari

    from rlbuffers.integrations.minari import from_minari, to_minari
    from rlbuffers.integrations.parquet import to_parquet

    if task == "big_convert":
        buf = from_minari(BIG_ID, d / "bigbuf", overwrite=True)
        n = len(buf)
        buf.close()
        return {"rows": n}
    # the export's own cache (None), or the open default of 256 MiB
    cache = 256 * 2**20 if task.endswith("_256") else None
    if task.startswith("big_to_minari"):
        return {"rows": to_minari(d / "bigbuf", "bench/bigback-v0", overwrite=True,
                                  cache_bytes=cache).steps, "cache_bytes": cache}
    if task.startswith("big_to_parquet"):
        return {"rows": to_parquet(d / "bigbuf", d / "bigpq", overwrite=True,
                                   cache_bytes=cache)["total_frames"], "cache_bytes": cache}
    # big_in_ram: the control, every observation of the dataset in a list in RAM
    kept = [e.observations for e in minari.load_dataset(BIG_ID).iterate_episodes()]
    return {"rows": sum(len(o) for o in kept)}


def _write_big(gb: float) -> dict:
    """A synthetic image dataset of ~``gb`` GB (observations 84x84x3 uint8, 1000-step
    episodes), written one episode at a time."""
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer

    obs_space = gym.spaces.Box(0, 255, (84, 84, 3), np.uint8)
    act_space = gym.spaces.Box(-1.0, 1.0, (6,), np.float32)
    episodes = max(1, int(gb * 1e9 // (1001 * 84 * 84 * 3)))
    rng = np.random.default_rng(0)

    def gen():
        for _ in range(episodes):
            base = rng.integers(0, 256, (84, 84, 3), dtype=np.uint8)
            obs = np.stack([np.roll(base, t, axis=1) for t in range(1001)])
            ends = np.zeros(1000, bool)
            ends[-1] = True
            yield EpisodeBuffer(observations=obs, actions=rng.uniform(-1, 1, (1000, 6)).astype(
                np.float32), rewards=rng.normal(size=1000), terminations=np.zeros(1000, bool),
                truncations=ends, infos={})

    t = time.perf_counter()
    minari.create_dataset_from_buffers(BIG_ID, gen(), observation_space=obs_space,
                                       action_space=act_space, algorithm_name="synthetic",
                                       author="bench", author_email="bench", code_permalink="x",
                                       description="synthetic images", jpeg_encoding=False)
    return {"episodes": episodes, "seconds": time.perf_counter() - t}


# -- the parent ----------------------------------------------------------------------------------
def _run(task: str, d: Path, env: dict, preexec=None, extra=()) -> tuple[int, dict]:
    out = d / f"{task}.json"
    out.unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-m", "tools.bench.bench_offline", "--child", task,
                        "--dir", str(d), "--child-out", str(out), *extra], cwd=ROOT, env=env,
                       preexec_fn=preexec)
    return p.returncode, json.loads(out.read_text()) if out.exists() else {}


def _median(task: str, d: Path, env: dict, repeats: int, key: str = "seconds") -> float:
    vals = []
    for _ in range(repeats):
        rc, r = _run(task, d, env)
        if rc != 0:
            sys.exit(f"bench_offline: child {task} failed (exit {rc})")
        vals.append(r[key])
    return statistics.median(vals)


def speed(d: Path, env: dict, steps: int, repeats: int) -> str:
    rc, rec = _run("record", d, env, extra=["--steps", str(steps)])
    if rc != 0:
        sys.exit("bench_offline: recording failed")
    m = {t: _median(t, d, env, repeats) for t in ("minari_read", "convert", "buffer_read",
                                                    "to_minari", "to_parquet")}
    w = []
    for _ in range(repeats):
        shutil.rmtree(d / "minari" / WRITE_ID, ignore_errors=True)
        w.append(_run("minari_write", d, env)[1]["seconds"])
    m["minari_write"] = statistics.median(w)
    s_r = _median("sample_rlbuffers", d, env, repeats, "per_sample_ms")
    s_m = _median("sample_minari", d, env, repeats, "per_sample_ms")
    s_4 = _median("sample_minari_4", d, env, repeats, "per_sample_ms")
    rows = [
        ["record the dataset with DataCollector (env stepping alone)",
         f"{rec['seconds']:.2f} s ({rec['env_seconds']:.2f} s)", "-"],
        ["read every episode: Minari iterate_episodes / the buffer's EpisodeReader",
         f"{m['minari_read']:.2f} s", f"{m['buffer_read']:.2f} s"],
        ["write every episode: Minari create_dataset_from_buffers (episodes in RAM)",
         f"{m['minari_write']:.2f} s", "-"],
        ["rlbuffers convert minari: Minari's read + our write + commit", "-",
         f"{m['convert']:.2f} s"],
        ["rlbuffers export minari: our read + Minari's write", "-",
         f"{m['to_minari']:.2f} s"],
        ["rlbuffers export parquet", "-", f"{m['to_parquet']:.2f} s"],
        ["sample 256 transitions: sample_episodes(min(256, episodes)) + flatten + 256 rows "
         "/ buf.sample(256)", f"{s_m:.2f} ms", f"{s_r:.3f} ms ({s_m / s_r:.0f}x faster)"],
        ["the same with sample_episodes(4) (a batch from only 4 episodes: correlated)",
         f"{s_4:.2f} ms", f"{s_r:.3f} ms ({s_4 / s_r:.0f}x faster)"],
    ]
    return (f"{stamp()}\n\nHalfCheetah-v5, {steps:,} random-policy steps "
            f"({steps // 1000} episodes of 1,000; reduced size), Minari HDF5; medians of "
            f"{repeats} runs, each in a fresh subprocess (`python -m tools.bench.bench_offline`)."
            "\n\n" + table(["operation", "Minari", "rlbuffers"], rows))


def memory(d: Path, env: dict, gb: float, cap_gb: float) -> str:
    from rlbuffers.maintenance.episodes import scan_cache_bytes
    from tools.bench.bench_larger_than_ram import MemoryCap

    load0 = os.getloadavg()[0]
    rc, made = _run("big_write", d, env, extra=["--memory-gb", str(gb)])
    if rc != 0:
        sys.exit("bench_offline: writing the big dataset failed")
    rows, how, own = [], "", ""
    for task, what in (("big_convert", "rlbuffers convert minari"),
                       ("big_to_minari_256", "rlbuffers export minari, 256 MiB cache (before)"),
                       ("big_to_minari", "rlbuffers export minari, its own cache"),
                       ("big_to_parquet_256", "rlbuffers export parquet, 256 MiB cache "
                        "(before)"),
                       ("big_to_parquet", "rlbuffers export parquet, its own cache"),
                       ("big_in_ram", "control: every observation in a list in RAM")):
        if task == "big_to_minari":  # the buffer exists now: the cache the export picks
            own = f"{scan_cache_bytes(d / 'bigbuf') / 2**20:.0f} MiB"
        cap = MemoryCap(int(cap_gb * 2**30))
        try:
            rc, r = _run(task, d, env, cap.preexec)
            st, how = cap.stats(), cap.how
        finally:
            cap.close()
        cg = f"{st.get('cg_peak_mb', float('nan')):.0f} MB / {st.get('cg_oom_kills', '-')}"
        rows.append([what, "killed (OOM)" if rc in (-9, 137) else f"exit {rc}",
                     f"{r.get('rows', '-'):,}" if r else "-",
                     f"{r['seconds']:.0f} s" if r else "-",
                     f"{r['peak_rss_mb']:.0f} / {r['peak_anon_mb']:.0f} MB" if r else "-", cg])
        print(task, rc, r, st, flush=True)
    size = sum(f.stat().st_size for f in (d / "minari" / BIG_ID).rglob("*") if f.is_file())
    return (f"{stamp()}\n\nA synthetic Minari HDF5 dataset of {size / 1e9:.2f} GB "
            f"({made['episodes']} episodes of 1,000 steps, 84x84x3 uint8 observations, no JPEG) "
            f"converted and exported, each in a child process capped at {cap_gb:g} GiB by "
            f"{how}; the buffer holds obs and next_obs, so its working tier is twice the "
            "observations. Each export runs with the read-only reader's decoded-chunk cache at "
            "`ReplayBuffer.open`'s default, 256 MiB (what the exports used before), and at the "
            f"size the export picks for one ordered read (`scan_cache_bytes`: {own} here). "
            "VmHWM counts the working tier's pages mapped into the process "
            "(page cache the kernel may evict); RssAnon is the process's own memory, sampled "
            f"every 20 ms. Load (1-minute average, {os.cpu_count()} cores): {load0:.1f} at the "
            f"start, {os.getloadavg()[0]:.1f} at the end: times on a busy machine are longer."
            "\n\n" + table(
                ["child", "result", "rows", "time", "peak RSS: VmHWM / RssAnon",
                 "cgroup peak (incl. page cache) / OOM kills"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-gb", type=float, default=2.0)
    ap.add_argument("--cap-gb", type=float, default=1.0)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        d = Path(args.dir)
        if args.child == "record":
            r = _record(d, args.steps)
        elif args.child == "big_write":
            r = _write_big(args.memory_gb)
        else:
            r = _child(args.child, d)
        Path(args.child_out).write_text(json.dumps(r))
        return
    d = Path(args.dir or tempfile.mkdtemp(prefix="rlb-offline-"))
    env = {**os.environ, "MINARI_DATASETS_PATH": str(d / "minari"), "MUJOCO_GL": "egl",
           "PYTHONPATH": str(ROOT)}
    try:
        if not args.skip_speed:
            body = speed(d, env, args.steps, args.repeats)
            write_section("offline", body)
            print(body, flush=True)
        if not args.skip_memory:
            body = memory(d, env, args.memory_gb, args.cap_gb)
            write_section("offline_memory", body)
            print(body, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
