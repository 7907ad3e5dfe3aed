"""``python3 -m trainers.grpo.compare`` (issue 48's learning parity, paired): two runs'
checkpoints on the same held-out problems; the paired figures against naive references; each
run's accuracy equal to the one its own evaluation logged; runs whose held-out sets or
decoding differ, and a missing checkpoint, refused by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from tests.test_grpo import ARGS  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import ConfigError  # noqa: E402
from trainers.grpo import compare, train  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_paired_figures_against_naive_references():
    rng = np.random.default_rng(3)
    for _ in range(40):
        n = int(rng.integers(1, 60))
        a, b = rng.random(n) < rng.random(), rng.random(n) < rng.random()
        got = compare.paired(a, b)
        table = {"both": 0, "breaks": 0, "fixes": 0, "neither": 0}
        for x, y in zip(a, b, strict=True):  # item by item
            table[{(True, True): "both", (True, False): "breaks", (False, True): "fixes",
                   (False, False): "neither"}[(bool(x), bool(y))]] += 1
        assert {k: got[k] for k in table} == table and got["n"] == n
        assert got["accuracy"] == [a.mean(), b.mean()]
        assert got["difference"] == pytest.approx(b.mean() - a.mean(), abs=1e-12)
        lo, hi = got["difference_ci95"]
        assert -1 <= lo <= got["difference"] <= hi <= 1
        d = table["breaks"] + table["fixes"]  # two-sided exact binomial test at 1/2, by sums
        tail = sum(math.comb(d, i) for i in range(d + 1)
                   if math.comb(d, i) <= math.comb(d, table["fixes"]))
        assert got["mcnemar_p"] == pytest.approx(min(1.0, tail / 2**d) if d else 1.0)
    with pytest.raises(ValueError, match="expected two \\[n\\] arrays of one length"):
        compare.paired(np.ones(3, bool), np.ones(4, bool))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 2-step tiny runs of one seed (so one held-out set), different learning rates."""
    root = tmp_path_factory.mktemp("compare")
    tiny = make_tiny_lm_dir(root / "tiny")
    runs = [root / "a", root / "b"]
    for run, lr in zip(runs, ("1e-2", "3e-2"), strict=True):
        args = [a for a in ARGS if a != "--no-evaluate"]
        args[args.index("--lr") + 1] = lr
        train.main([*args, "--model", str(tiny), "--run-dir", str(run), "--steps", "2",
                    "--lora-rank", "4", "--evaluate", "--eval-size", "6"])
    return runs


def test_each_run_scores_as_its_own_evaluation_did(two_runs, tmp_path):
    out = tmp_path / "cmp.json"
    got = compare.main([f"--run-dir={two_runs[0]}", f"--run-dir={two_runs[1]}", "--step", "2",
                        "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(got))
    for run, acc in zip(two_runs, got["accuracy"], strict=True):
        ev = json.loads((run / "eval.json").read_text())
        assert acc == ev["after"]["task"]["accuracy"] and ev["after"]["task"]["n"] == 6
        assert got["held_out"] == ev["held_out"]  # the same problems
    assert got["both"] + got["breaks"] + got["fixes"] + got["neither"] == 6


def test_runs_of_other_held_out_sets_and_missing_checkpoints_are_refused(two_runs, tmp_path):
    cfg = json.loads((two_runs[1] / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "seed": cfg["seed"] + 1}))
    with pytest.raises(ConfigError, match="--seed: expected the same value in both runs"):
        compare.main(["--run-dir", str(two_runs[0]), "--run-dir", str(other), "--step", "2"])
    with pytest.raises(ConfigError, match="--step: expected a checkpoint both runs keep, got 9"):
        compare.main(["--run-dir", str(two_runs[0]), "--run-dir", str(two_runs[1]),
                      "--step", "9"])
    with pytest.raises(ConfigError, match="--run-dir: expected two run directories, got 1"):
        compare.main(["--run-dir", str(two_runs[0]), "--step", "2"])
