"""Issue 35, resume semantics: a new target is kept in config.json, the interrupt message's
command finishes the run verbatim, a run at its target exits at once without evaluating again
(unless --evaluate-again), a done final evaluation is not repeated; every commit writes
TensorBoard scalars equal to metrics.jsonl; the run ends with a summary naming its files."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "tensorboard")

from tests.test_crsp import ARGS as CRSP_ARGS  # noqa: E402
from tests.test_grpo import ARGS, fake_scores, rows, tiny_dir  # noqa: E402, F401
from trainers.crsp import train as crsp_train  # noqa: E402
from trainers.grpo import train  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

EVAL_ARGS = [a for a in ARGS if a != "--no-evaluate"] + ["--evaluate", "--eval-size", "2"]


def tensorboard_scalars(run_dir):
    """``{tag: [(step, value)]}`` read back from ``run_dir/tb`` by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_tensorboard_matches_metrics(run_dir, unit):
    """Every numeric value of every metrics.jsonl row is a TensorBoard scalar at its unit."""
    scalars = tensorboard_scalars(run_dir)
    history = rows(run_dir)
    for row in history:
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                got = dict(scalars[key])[row[unit]]
                assert got == pytest.approx(value, rel=1e-6), (key, row[unit])
    # one event per unit and key: a resumed run does not repeat units
    assert all(len(v) == len({s for s, _ in v}) for v in scalars.values())
    assert {s for s, _ in scalars[unit]} == {r[unit] for r in history}


@pytest.fixture
def fake_evaluate(monkeypatch):
    """The held-out evaluation replaced by a counter (its own tests are in test_grpo)."""
    calls = []

    def evaluate_sets(model, tok, sampling, sets, *, asdiv=True, label=""):
        calls.append(len(sets.task))
        return {"task": {"accuracy": 0.5, "n": len(sets.task), "ci95": [0.0945, 0.9055],
                         "overlap": 0}}

    monkeypatch.setattr(train, "evaluate_sets", evaluate_sets)
    monkeypatch.setattr(train, "score_group", fake_scores)
    return calls


def test_grpo_resume_keeps_the_new_target_and_the_interrupt_command_finishes_it(
        tiny_dir, tmp_path, monkeypatch, fake_evaluate, capsys):  # noqa: F811
    run = tmp_path / "run"
    train.main([*EVAL_ARGS, "--model", str(tiny_dir), "--run-dir", str(run), "--steps", "1"])
    assert fake_evaluate == [2, 2]  # before and after
    assert json.loads((run / "eval.json").read_text())["after"]["step"] == 1
    err = capsys.readouterr().err
    assert "done: step 1 of 1" in err and f"rlbuffers inspect {run / 'buffer'}" in err
    for name in ("curve.png", "metrics.jsonl", "eval.json", "buffer", "tb"):
        assert str(run / name) in err
    assert "held-out after: task 0.500 [0.095, 0.905] (n=2)" in err

    # Resume to 3 steps, interrupted during step 3: the message's command finishes the run.
    real_update, seen = train.update, []

    def interrupt_in_step_3(*a, **kw):
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt
        return real_update(*a, **kw)

    monkeypatch.setattr(train, "update", interrupt_in_step_3)
    with pytest.raises(SystemExit) as stop:
        train.main(["--resume", "--run-dir", str(run), "--steps", "3"])
    message = str(stop.value)
    assert stop.value.code == 130  # Ctrl-C's exit code, after the line saying how to resume
    assert "step 2 is the last complete one (of 3)" in message
    assert message in capsys.readouterr().err.splitlines()
    assert json.loads((run / "config.json").read_text())["steps"] == 3
    assert len(rows(run)) == 2 and fake_evaluate == [2, 2]
    command = shlex.split(message.split("continue with ", 1)[1])
    assert command[:3] == ["python3", "-m", "trainers.grpo"]
    monkeypatch.setattr(train, "update", real_update)
    train.main(command[3:])  # verbatim
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert fake_evaluate == [2, 2, 2]  # the final evaluation of step 3
    assert json.loads((run / "eval.json").read_text())["after"]["step"] == 3
    assert_tensorboard_matches_metrics(run, "step")
    capsys.readouterr()

    # Nothing left: one line, exit 0, no evaluation, nothing written.
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as stop:
        train.main(["--resume", "--run-dir", str(run)])
    assert stop.value.code is None
    err = [line for line in capsys.readouterr().err.splitlines()
           if not line.startswith("INFO ")]  # the log's progress lines aside
    assert err == [f"{run}: step 3 of 3 is complete, nothing to train (raise --steps to "
                   "continue)"]
    assert fake_evaluate == [2, 2, 2] and (run / "metrics.jsonl").read_text() == before

    # --evaluate-again: the final evaluation only.
    train.main(["--resume", "--run-dir", str(run), "--evaluate-again"])
    assert fake_evaluate == [2, 2, 2, 2] and (run / "metrics.jsonl").read_text() == before


def test_grpo_interrupted_in_the_final_evaluation_evaluates_on_resume(
        tiny_dir, tmp_path, monkeypatch, fake_evaluate):  # noqa: F811
    """The last step committed but its evaluation was cut: a plain --resume evaluates (and
    trains nothing)."""
    run = tmp_path / "run"
    real = train.evaluate_sets

    def cut_after(model, tok, sampling, sets, **kw):
        if len(fake_evaluate) == 1:  # the second call is the final evaluation
            raise KeyboardInterrupt
        return real(model, tok, sampling, sets, **kw)

    monkeypatch.setattr(train, "evaluate_sets", cut_after)
    with pytest.raises(SystemExit, match="step 1 is the last complete one"):
        train.main([*EVAL_ARGS, "--model", str(tiny_dir), "--run-dir", str(run), "--steps", "1"])
    # eval.json holds the evaluation before the first step, not the cut final one
    assert "after" not in json.loads((run / "eval.json").read_text())
    monkeypatch.setattr(train, "evaluate_sets", real)
    train.main(["--resume", "--run-dir", str(run)])
    assert fake_evaluate == [2, 2] and len(rows(run)) == 1
    assert json.loads((run / "eval.json").read_text())["after"]["step"] == 1


def test_crsp_resume_keeps_the_new_target_and_stops_when_nothing_is_left(
        tiny_dir, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    crsp_train.main([*CRSP_ARGS, "--model", str(tiny_dir), "--run-dir", str(run),
                     "--steps", "1"])
    crsp_train.main(["--resume", "--run-dir", str(run), "--steps", "2"])
    assert json.loads((run / "config.json").read_text())["steps"] == 2
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert_tensorboard_matches_metrics(run, "step")
    assert "done: step 2 of 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        crsp_train.main(["--resume", "--run-dir", str(run)])
    assert stop.value.code is None
    assert "step 2 of 2 is complete, nothing to train" in capsys.readouterr().err
    assert len(rows(run)) == 2
