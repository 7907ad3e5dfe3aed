"""A TorchRL prioritized replay loop over ZarrStorage killed by SIGKILL after a commit resumes
from that commit: same rows, same priorities, same sample stream as a run that was not killed
(tests/torchrl_resume_child.py runs both in fresh processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np

from tests.heavy import require

require("torchrl", "tensordict", "torch")

import torch

from tests.torchrl_resume_child import COMMIT_AT, make, rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(mode: str, run_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.torchrl_resume_child", mode,
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigkill_after_commit_resumes_the_committed_buffer_and_stream(tmp_path):
    rec, killed = tmp_path / "record", tmp_path / "kill"
    rec.mkdir()
    killed.mkdir()
    record, kill = child("record", rec), child("kill", killed)  # both at once
    for proc, code in ((record, 0), (kill, -signal.SIGKILL)):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == code, err[-2000:]

    rb, storage, _ = make(str(killed / "buffer"))  # TorchRL's reset of priorities is skipped
    assert storage.buffer.metadata["step"] == COMMIT_AT
    assert len(rb) == 8 * (COMMIT_AT + 1)
    assert torch.equal(rb[:]["x"], torch.arange(8 * (COMMIT_AT + 1)))
    assert torch.equal(rb[:]["obs"][-8:], rows(COMMIT_AT)["obs"])
    expected = np.load(rec / "expected.npz")
    for i in range(len(expected["index"])):
        batch = rb.sample()
        assert np.array_equal(batch["index"].numpy(), expected["index"][i])
        assert np.array_equal(batch["priority_weight"].numpy(), expected["weight"][i])
        assert np.array_equal(batch["x"].numpy(), expected["x"][i])
    rb.extend(rows(COMMIT_AT + 1))  # and the loop goes on where the commit left it
    assert rb[:]["x"][-1].item() == 8 * (COMMIT_AT + 2) - 1
