"""tools/gpu_real_step.py: the CUDA peak of a run is the largest per-phase CUDA peak in its
metrics rows; a run's exit code, output and RSS peaks come back from ``sampled``."""

import json
import sys
from pathlib import Path

from tools import gpu_real_step


def test_cuda_peak_is_the_largest_phase_peak_over_all_rows(tmp_path: Path) -> None:
    rows = [{"step": 1, "cuda_peak_generate_bytes": 10, "cuda_peak_update_bytes": 30,
             "peak_rss_bytes": 999},
            {"step": 2, "cuda_peak_update_bytes": 25, "cuda_peak_reference_bytes": 41,
             "label": "x"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu_real_step.cuda_peak(tmp_path) == 41
    assert gpu_real_step.cuda_peak(tmp_path / "missing") == 0


def test_sampled_returns_the_exit_code_the_output_and_a_tree_peak_over_its_largest(
        tmp_path: Path) -> None:
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass']); "
            "print('done'); sys.exit(3)")
    rc, largest, tree = gpu_real_step.sampled([sys.executable, "-c", code], tmp_path / "log")
    assert rc == 3
    assert (tmp_path / "log").read_text().strip() == "done"
    # sampled from the first moment (an interpreter's start outlasts it), the tree's sum per
    # sample at least its largest process
    assert 0 < largest <= tree
