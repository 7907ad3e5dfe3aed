"""A ZarrReplayBuffer of Atari size (1,000,000 x uint8 (4, 84, 84) observations: 56.4 GB with
next_obs) neither allocates its capacity nor grows the heap as it fills: measured in a child
process as the change of RssAnon (anonymous resident memory, what numpy arrays occupy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.heavy import require

require("stable_baselines3", "torch", "gymnasium")

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

CHILD = r"""
import json, sys
import numpy as np
from gymnasium import spaces
from rlbuffers.integrations.sb3 import ZarrReplayBuffer

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

before = rss_anon()
buf = ZarrReplayBuffer(1_000_000, spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(6),
                       "cpu", handle_timeout_termination=False, path=sys.argv[1])
built = rss_anon()
obs = np.random.default_rng(0).integers(0, 256, (1, 4, 84, 84), dtype=np.uint8)
for i in range(2_000):
    buf.add(obs, obs, np.array([i % 6]), np.array([1.0]), np.array([i % 100 == 99]), [{}])
for _ in range(10):
    batch = buf.sample(32)
filled = rss_anon()
assert batch.observations.shape == (32, 4, 84, 84)
print(json.dumps({"before": before, "built": built, "filled": filled,
                  "capacity": buf.storage.capacity}))
"""


def test_atari_capacity_stays_off_the_heap(tmp_path):
    if not Path("/proc/self/status").exists():
        raise AssertionError("needs /proc/self/status (Linux) to read RssAnon")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "buf")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["capacity"] == 1_000_000
    # SB3's buffer: np.zeros of 2 x 28.2 GB; 2,000 steps fill 113 MB of it
    assert m["built"] - m["before"] < 32 * MIB, m
    assert m["filled"] - m["before"] < 32 * MIB, m
