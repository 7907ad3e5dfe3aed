"""The README's memory-toolkit example runs as written."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def memory_example() -> str:
    text = README.read_text().split("## The memory toolkit", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_memory_example_runs():
    scope: dict = {}
    exec(compile(memory_example(), "README.md (memory toolkit)", "exec"), scope)
    assert scope["stats"].micro_batch == 8 and scope["stats"].micro_steps == 2
    assert scope["metrics"]["phase/train/peak_rss_bytes"] > 0
