"""tools/gpu_real_step.py: the CUDA peak of a run is the largest per-phase CUDA peak in its
metrics rows (or the line a TRL child prints); a run's exit code, output and sampled RSS
peak come back from ``run``."""

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


def test_run_returns_the_exit_code_the_output_and_a_sampled_tree_peak(tmp_path: Path) -> None:
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass']); "
            "print('done'); print('CUDA_PEAK 5242880'); sys.exit(3)")
    res = gpu_real_step.run("x", [sys.executable, "-c", code], tmp_path / "none", tmp_path)
    assert res["rc"] == 3
    assert (tmp_path / "x.log").read_text().splitlines() == ["done", "CUDA_PEAK 5242880"]
    assert res["cuda_peak_mib"] == 5  # the child's own line wins over metrics.jsonl
    # sampled from the first moment (an interpreter's start outlasts it)
    assert res["tree_peak_rss_mib"] > 0
