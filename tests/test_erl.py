"""Tests of the ERL reference trainer (trainers/erl/).

The subprocess tests run the real script on a tiny budget (HalfCheetah-v5, 50-step episodes,
3 actors, 16-unit networks: 200 env steps per generation). The SIGKILL test checks that a run
killed during generation 3 (at its commit, by a patched ``Run.commit``) resumes from generation
2 and then matches an uninterrupted run exactly: generation counter, fitness history and every
transition in the buffer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbuffers import ReplayBuffer
from rlbuffers.checkpoint import load_state
from trainers.common import restore_metrics
from trainers.config import field_docs
from trainers.erl.config import Config, check_config
from trainers.erl.evolution import crossover, evolve, mutate, tournament
from trainers.erl.rollout import Actor

REPO = Path(__file__).resolve().parents[1]
TINY = ["--env", "HalfCheetah-v5", "--max-episode-steps", "50", "--pop-size", "3",
        "--hidden", "16", "--learning-starts", "100", "--batch-size", "32", "--sync-every", "2"]
STEPS_PER_GEN = 4 * 50  # 3 actors + the learner, one 50-step episode each
TIMEOUT_S = 120


def trainer_cmd(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "trainers.erl", "--run-dir", str(run_dir), *args]


def run_trainer(run_dir: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(trainer_cmd(run_dir, *args), cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def buffer_contents(run_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    with ReplayBuffer.open(run_dir / "buffer", mode="r") as buf:
        info = {"size": len(buf), "total_added": buf.total_added, "metadata": buf.metadata}
        return info, buf[:]


#: ``python -m trainers.erl`` with ``trainers.common.Run.commit`` of generation ``{gen}`` replaced
#: by a SIGKILL of the process: the kill lands after that generation's rollouts are in the
#: buffer and its TD3 updates, evaluation and evolution are done, before anything of it is
#: written (no checkpoint, no buffer commit), at the same point on every machine.
KILL_AT_COMMIT = """
import os, runpy, signal, sys
from trainers import common
real = common.Run.commit
def commit(self, n, *a, **k):
    if n == {gen}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, n, *a, **k)
common.Run.commit = commit
sys.argv[0] = "trainers.erl"
runpy.run_module("trainers.erl", run_name="__main__", alter_sys=True)
"""


def kill_during_generation(run_dir: Path, generation: int, *args: str) -> None:
    """Run the trainer and SIGKILL it at generation ``generation``'s commit (its rollouts are
    in the buffer, nothing of it saved)."""
    code = KILL_AT_COMMIT.format(gen=generation)
    proc = subprocess.run([sys.executable, "-c", code, "--run-dir", str(run_dir), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert f"gen {generation - 1:4d}/" in proc.stdout and f"gen {generation:4d}/" not in \
        proc.stdout


def test_sigkill_during_generation_3_resumes_from_generation_2(tmp_path):
    """Also the deterministic evaluation's rows (``eval.jsonl``, issue 49 item 5): after the
    kill exactly the committed generations' rows; a row of an evaluation that never committed
    is dropped on resume; the resumed file equals the uninterrupted one byte for byte; and
    extending a finished run adds evaluations after its last one."""
    ref, run = tmp_path / "reference", tmp_path / "killed"
    args = [*TINY, "--generations", "4", "--eval-every", "1", "--eval-episodes", "2"]
    run_trainer(ref, *args)

    kill_during_generation(run, 3, *args)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["generation"] for e in evals] == [0, 1, 2]  # exactly the committed ones
    with open(run / "eval.jsonl", "a") as f:  # an evaluation that never committed
        f.write('{"generation": 3, "mean": 1e9, "returns": [1e9]}\n')
    info, rows = buffer_contents(run)
    assert info["metadata"]["trainer_generation"] == 2, "the kill must land before gen 3 commits"
    assert info["size"] == info["total_added"] == 2 * STEPS_PER_GEN
    _, ref_rows = buffer_contents(ref)
    for name, col in rows.items():
        np.testing.assert_array_equal(col, ref_rows[name][: 2 * STEPS_PER_GEN], err_msg=name)
    # Also a kill that fell between writing ckpt/generation-3 and the buffer commit of
    # generation 3,
    # and one during the checkpoint write of generation 4: both must be ignored and removed.
    (run / "ckpt" / "generation-3").mkdir()
    (run / "ckpt" / "generation-3" / "state.json").write_bytes(b"never committed")
    (run / "ckpt" / "generation-4.tmp").mkdir()

    out = run_trainer(run, "--resume", "--generations", "4").stdout
    assert "resumed" in out and "at generation 2" in out
    assert [line.split("/")[0] for line in out.splitlines() if line.startswith("gen ")] == \
        ["gen    3", "gen    4"]

    got, want = metrics(run), metrics(ref)
    assert [m["generation"] for m in got] == [1, 2, 3, 4]
    for key in ("env_steps", "fitness", "best_fitness", "learner_return", "td3_updates",
                "buffer_size", "eval_return_mean"):
        assert [m.get(key) for m in got] == [m.get(key) for m in want], key
    info, rows = buffer_contents(run)
    assert info["metadata"] == {"trainer_generation": 4, "env_steps": 4 * STEPS_PER_GEN}
    assert info["size"] == info["total_added"] == 4 * STEPS_PER_GEN
    for name, col in rows.items():
        np.testing.assert_array_equal(col, ref_rows[name], err_msg=name)
    assert (run / "eval.jsonl").read_bytes() == (ref / "eval.jsonl").read_bytes()
    # keep=2: generation-1 and generation-2 pruned (no spare by default)
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["generation-3", "generation-4"]
    state = load_state(run / "ckpt" / "generation-4")
    assert state["trainer"]["generation"] == 4
    assert [h["fitness"] for h in state["history"]] == [m["fitness"] for m in want]
    run_trainer(run, "--resume", "--generations", "5")  # extending a finished run
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["generation"] for e in evals] == [0, 1, 2, 3, 4, 5]


def test_smoke_two_generations_write_every_artifact(tmp_path):
    # as a user runs it: a --run-dir relative to the working directory
    proc = run_trainer(Path("run"), *TINY, "--generations", "2",
                       "--warn-below-available-mib", "100000000", cwd=tmp_path)
    run = tmp_path / "run"
    out = proc.stdout
    assert "low memory" in proc.stderr  # the MemoryMonitor warning, through logging
    assert out.startswith("memory at start: this process's RSS ")  # a labelled line
    lines = [line for line in out.splitlines() if line.startswith("gen ")]
    assert len(lines) == 2
    for word in ("best", "mean", "learner", "steps", "buffer", "rss", "peak"):
        assert word in lines[-1]
    # Issue 45: one human line per commit, the only one giving the commit's time; the
    # buffer's own per-save line (a SaveReport repr) is not on the trainer's console.
    commits = [line for line in proc.stderr.splitlines() if " committed in " in line]
    assert len(commits) == 2 and "SaveReport" not in proc.stderr
    assert re.fullmatch(r"INFO trainers\.common: generation 2 committed in \d+\.\d s: "
                        r"checkpoint, buffer commit 2 \(\d+ chunks, [\d.]+ [KM]iB written\), "
                        r"curve", commits[1]), commits
    assert "commit" not in lines[-1]
    phase_line = next(line for line in proc.stderr.splitlines() if "generation 2: " in line)
    assert re.search(r"\| commit [\d,]+ MiB$", phase_line), phase_line  # a peak, no seconds
    rows = metrics(run)
    assert [r["generation"] for r in rows] == [1, 2]
    assert rows[-1]["env_steps"] == rows[-1]["buffer_size"] == 2 * STEPS_PER_GEN
    assert rows[-1]["commit_bytes"] > 0 and rows[-1]["peak_rss_bytes"] > 0
    assert (run / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run / "config.json").read_text())["pop_size"] == 3
    best = torch.load(run / "ckpt" / "generation-2" / "best_actor.pt", weights_only=True)
    actor = Actor(17, 6, 16, -np.ones(6), np.ones(6))
    actor.load_state_dict(best)
    inspect = [sys.executable, "-m", "rlbuffers.cli", "inspect", "--json", "--verify"]
    report = json.loads(subprocess.run([*inspect, str(run / "buffer")], cwd=REPO, text=True,
                                       capture_output=True, timeout=TIMEOUT_S, check=True).stdout)
    assert report["size"] == report["total_added"] == 2 * STEPS_PER_GEN
    assert report["metadata"]["trainer_generation"] == 2
    assert report["episodes"] == 2 * 4

    refused = subprocess.run(trainer_cmd(run, *TINY), cwd=REPO, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr
    clash = subprocess.run(trainer_cmd(run, "--resume", "--pop-size", "5"), cwd=REPO,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert clash.returncode != 0 and "pop_size" in clash.stderr


def test_a_default_run_logs_its_memory_plan_and_per_phase_line(tmp_path):
    err = run_trainer(tmp_path / "run", *TINY, "--generations", "1").stderr
    transition = 2 * 17 * 4 + 6 * 4 + 4 + 2  # obs, next_obs, action, reward, 2 flags: bytes
    assert (f"INFO trainers.erl: memory plan: buffer 1,000,000 transitions x {transition} B"
            in err)
    phase = r"{} \d+\.\d s [\d,]+ MiB"
    line = "INFO trainers.phases: generation 1: " + r" \| ".join(
        phase.format(p) for p in ("rollout", "update", "evolve")) + r" \| commit [\d,]+ MiB"
    for p in ("rollout", "update", "evolve", "commit"):  # each phase says when it starts
        assert f"INFO trainers.phases: {p} (generation 1)..." in err, p
    assert re.search(line, err), err[-3000:]
    row = metrics(tmp_path / "run")[0]
    assert row["transition_bytes"] == transition and row["buffer_capacity"] == 1_000_000
    for p in ("rollout", "update", "evolve"):
        assert row[f"seconds_{p}"] >= 0 and row[f"peak_rss_{p}_bytes"] > 0, p
    assert row["seconds_commit"] > 0
    quiet = run_trainer(tmp_path / "quiet", *TINY, "--generations", "1", "--quiet").stderr
    assert "memory plan" not in quiet and "trainers.phases" not in quiet


def test_help_lists_every_config_field_with_its_docstring():
    out = subprocess.run([sys.executable, "-m", "trainers.erl", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=TIMEOUT_S).stdout
    docs = field_docs(Config)
    assert set(docs) == {f for f in Config.__dataclass_fields__}
    for name in docs:
        assert "--" + name.replace("_", "-") in out
    assert "Actors in the evolving population" in out


def test_a_bad_setting_is_named_with_its_flag():
    check_config(Config())
    for bad, match in (({"pop_size": 0}, "--pop-size: expected >= 1, got 0"),
                       ({"crossover_prob": 1.5},
                        "--crossover-prob: expected in \\[0, 1\\], got 1.5"),
                       ({"rollout_backend": "dask"}, "--rollout-backend: expected '', 'inprocess' "
                                                     "or 'ray', got 'dask'")):
        with pytest.raises(ValueError, match=match):
            check_config(Config(**bad))


# -- evolution operators and bookkeeping, in process ------------------------------------------
def small_actor(seed: int) -> Actor:
    torch.manual_seed(seed)
    return Actor(5, 2, 8, -np.ones(2), np.ones(2))


def test_tournament_returns_the_fittest_entrant():
    rng = np.random.default_rng(0)
    fitness = np.array([3.0, 1.0, 2.0, 0.0])
    assert tournament(fitness, 4, rng) == 0
    wins = [tournament(fitness, 2, rng) for _ in range(200)]
    assert 3 not in wins and wins.count(0) > wins.count(2) > wins.count(1)


def test_crossover_takes_whole_units_from_either_parent():
    a, b = small_actor(0), small_actor(1)
    child = crossover(a, b, np.random.default_rng(0))
    for lc, la, lb in zip(child.net, a.net, b.net, strict=True):
        if isinstance(lc, torch.nn.Linear):
            from_a = (lc.weight == la.weight).all(1) & (lc.bias == la.bias)
            from_b = (lc.weight == lb.weight).all(1) & (lc.bias == lb.bias)
            assert (from_a ^ from_b).all()
    assert any((lc.weight != la.weight).any() for lc, la in zip(child.net, a.net, strict=True)
               if isinstance(lc, torch.nn.Linear))


def test_mutation_perturbs_the_configured_fraction_of_weights():
    cfg = Config(mutation_frac=0.25, super_mutation_prob=0.0, reset_prob=0.0)
    actor = small_actor(0)
    before = [p.clone() for p in actor.parameters()]
    mutate(actor, cfg, np.random.default_rng(0))
    for (name, p), q in zip(actor.named_parameters(), before, strict=True):
        changed = (p != q).float().mean().item()
        if name.endswith("weight") and p.ndim == 2:
            assert 0.15 < changed <= 0.25, name
        else:
            assert changed == 0, name  # biases and LayerNorm stay


def test_evolve_keeps_elites_and_replaces_the_rest():
    cfg = Config(pop_size=5, elite_fraction=0.2)
    pop = [small_actor(i) for i in range(5)]
    fitness = np.array([1.0, 5.0, 2.0, 3.0, 0.0])
    new = evolve(pop, fitness, cfg, np.random.default_rng(0))
    assert len(new) == 5 and new[0] is pop[1]
    assert all(all(child is not p for p in pop) for child in new[1:])


def test_restore_metrics_drops_uncommitted_and_restores_lost_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    logged = [{"generation": g, "save_bytes": 10 * g} for g in (1, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in logged) + '{"generation": 5, "sa')
    history = [{"generation": g} for g in (1, 2, 3)]
    restore_metrics(path, history, "generation")
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"generation": 1, "save_bytes": 10}, {"generation": 2}, {"generation": 3, "save_bytes": 30}]
