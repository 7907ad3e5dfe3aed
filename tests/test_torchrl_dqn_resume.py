"""TorchRL's documented DQN loop on CartPole over a ZarrStorage, killed by SIGKILL after a
commit, resumes from that commit as if it had never stopped (issue 46's "kill -9 + resume").

tests/torchrl_dqn_resume_child.py runs the loop in fresh processes: an uninterrupted
``reference``, a ``kill`` run that the test SIGKILLs as soon as it reports the commit of
segment ``KILL_AFTER`` (the child meanwhile goes on with the next segment's collection, writes,
updates and priority updates, and waits before that segment's commit, so the kill always lands
in uncommitted work; no sleep picks the moment), then a ``resume`` run over the killed path.

Compared, exactly (``torch.equal`` / ``==``):
- at the reopened commit: every stored row (all keys), length and rows ever added, and the
  sampler's state: torch's RNG state (``RandomSampler`` draws from it; the loop's checkpoint
  restores it) or, for ``ZarrPrioritizedSampler``, every slot's priority, the largest
  priority and the buffer's generator (all three from the commit alone);
- the loop's own checkpoint of that commit (online and target networks, Adam, exploration,
  RNG) against the reference's of the same segment;
- after it: every update's sampled indices, importance weights and loss, and the final rows
  (the ring has wrapped by then).

Not compared: the env's internal state at the kill. An env cannot be checkpointed, so every
segment, in all three runs, builds its collector on an env seeded for that segment (what a
resumed loop has to do); the episode that was running at the commit is therefore cut in
the uninterrupted run too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.heavy import require

require("torchrl", "tensordict", "torch", "gymnasium")

import torch

from tests.torchrl_dqn_resume_child import CAPACITY, KILL_AFTER, OPTIM_STEPS, SEGMENTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(mode: str, run_dir, sampler: str) -> subprocess.Popen:
    """The child in ``mode``, its stderr in ``run_dir/MODE.stderr``; a ``kill`` child's
    stdout (its commits) and stdin (which it waits on) are pipes."""
    run_dir.mkdir(exist_ok=True)
    pipe = subprocess.PIPE if mode == "kill" else subprocess.DEVNULL
    with open(run_dir / f"{mode}.stderr", "w") as err:  # the child holds its own copy
        return subprocess.Popen([sys.executable, "-m", "tests.torchrl_dqn_resume_child", mode,
                                 str(run_dir), sampler], cwd=ROOT, stdin=pipe, stdout=pipe,
                                stderr=err, text=True)


def stderr_of(run_dir, mode: str) -> str:
    return (run_dir / f"{mode}.stderr").read_text()[-3000:]


def assert_same(got, want, where: str = "") -> None:
    """``got`` equals ``want`` exactly: tensors by dtype, shape and value, containers by keys
    and items, everything else by ``==``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_dqn_killed_after_a_commit_resumes_as_the_uninterrupted_run(tmp_path, sampler):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    reference, kill = child("reference", ref_dir, sampler), child("kill", run_dir, sampler)
    seen = []
    for line in kill.stdout:  # the child's commits, as it makes them
        seen.append(line.strip())
        if seen[-1] == f"committed {KILL_AFTER}":
            os.kill(kill.pid, signal.SIGKILL)
            break
    kill.wait(timeout=300)
    kill.stdout.close()
    kill.stdin.close()
    assert kill.returncode == -signal.SIGKILL, (seen, stderr_of(run_dir, "kill"))
    assert seen == [f"committed {k}" for k in range(KILL_AFTER + 1)]
    reference.wait(timeout=300)
    assert reference.returncode == 0, stderr_of(ref_dir, "reference")
    assert not (run_dir / f"loop-{KILL_AFTER + 1}.pt").exists()  # killed before it

    resume = child("resume", run_dir, sampler)
    resume.wait(timeout=300)
    assert resume.returncode == 0, stderr_of(run_dir, "resume")

    state, want = torch.load(run_dir / "state.pt"), torch.load(ref_dir / "state.pt")
    assert state["len"] == CAPACITY and state["total_added"] == CAPACITY
    assert ("priority" in want) == (sampler == "prioritized")
    assert_same(state, want, "state at the commit")
    assert_same(torch.load(run_dir / f"loop-{KILL_AFTER}.pt"),
                torch.load(ref_dir / f"loop-{KILL_AFTER}.pt"), "loop checkpoint")
    after, want_after = torch.load(run_dir / "after.pt"), torch.load(ref_dir / "after.pt")
    assert len(want_after["updates"]) == (SEGMENTS - KILL_AFTER - 1) * OPTIM_STEPS
    assert want_after["final"]["total_added"] > CAPACITY  # the ring wrapped after the resume
    assert_same(after, want_after, "after the commit")
