"""Issue 35, what a newcomer sees: one-line errors (flags, --task, --task-config), inspect on a
run directory, curves readable at 1 and 1,000 points for every trainer, `python3 -m trainers.plot`,
TensorBoard events and the closing summary of ERL and guidance, the process's peak RSS, and a
tiny run whose every phase says when it starts (tools/check_output_gaps.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers", "tensorboard", "gymnasium")

from rlbuffers import FieldSpec, ReplayBuffer  # noqa: E402
from rlbuffers.cli import main as cli_main  # noqa: E402
from rlbuffers.memory.process import (  # noqa: E402
    peak_rss_bytes,
    process_peak_rss_bytes,
    reset_peak_rss,
)
from tests.test_guidance import args as guidance_args  # noqa: E402
from tests.test_guidance import fake_score, tiny  # noqa: E402, F401
from tests.test_newcomer_resume import assert_tensorboard_matches_metrics  # noqa: E402
from tools.check_output_gaps import gaps, timed_lines, tiny_grpo_command  # noqa: E402
from trainers import curves  # noqa: E402
from trainers.config import ConfigError  # noqa: E402
from trainers.grpo import train as grpo_train  # noqa: E402
from trainers.guidance import train as guidance_train  # noqa: E402
from trainers.plot import TRAINERS, draw, plot_run, which_trainer  # noqa: E402
from trainers.plot import main as plot_main  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# ----- errors a person can act on --------------------------------------------------------------

def test_a_mistyped_flag_is_one_line_pointing_at_help(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trainers.grpo", "--stepz", "3"], cwd=tmp_path,
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 2 and "usage:" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert errors == ["python3 -m trainers.grpo: error: unrecognized arguments: --stepz 3 (see "
                      "python3 -m trainers.grpo --help)"]


@pytest.mark.parametrize("flags, match", [
    (["--task", "basic_arithmatic"], r"--task: 'basic_arithmatic' is not a reasoning-gym task; "
                                     r"did you mean basic_arithmetic"),
    (["--task-config", "{'min_terms': 2}"], r"--task-config: not JSON \(Expecting property name "
                                            r"enclosed in double quotes at line 1 column 2\)"),
    (["--task-config", '{"min_terms": 5, "max_terms": 2}'],
     r"--task-config: basic_arithmetic rejects .*max_terms must be >= min_terms"),
    (["--task-config", "[1]"], r"--task-config: expected a JSON object"),
])
def test_task_and_task_config_are_checked_before_any_model_loads(tmp_path, flags, match):
    """The model directory holds no model (a config.json only, so --model itself passes its
    check): the error comes before any load."""
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text("{}")
    argv = ["--task", "basic_arithmetic", *flags, "--model", str(tmp_path / "none"),
            "--run-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=match):
        grpo_train.main(argv)
    assert not (tmp_path / "run").exists()


def test_a_setting_error_is_one_line_on_the_console(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trainers.grpo", "--task", "basic_arithmatic",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: --task: 'basic_arithmatic' is not a "
                                                  "reasoning-gym task; did you mean")


#: (trainer, flag, bad value, the start of the one-line error) found by trying every flag of
#: every trainer with a wrong type, an out-of-range value, an unknown name and a missing path
#: (issue 45: each of these escaped as a traceback or was accepted).
BAD_VALUES = [
    ("erl", "--seed", "-1", "--seed: expected in [0, 2**63), got -1"),
    ("erl", "--seed", str(10**23), "--seed: expected in [0, 2**63)"),
    ("erl", "--train-threads", "99999999999", "--train-threads: expected in [1, 1024]"),
    ("erl", "--env", "Halfcheetah-v5", "--env: expected a registered Gymnasium environment"),
    ("grpo", "--model", "/nonexistent/model", "--model: expected a model directory holding "
                                              "config.json (or '' for the default)"),
    ("grpo", "--lora-alpha", "0", "--lora-alpha: expected >= 1, got 0"),
    ("grpo", "--max-prompt-tokens", "-1", "--max-prompt-tokens: expected >= 1, got -1"),
    ("grpo", "--eval-asdiv", "-2", "--eval-asdiv: expected >= 0, or -1 for all, got -2"),
    ("grpo", "--reuse-groups", "-1", "--reuse-groups: expected >= 0, got -1"),
    ("grpo", "--format-reward", "-1", "--format-reward: expected >= 0, got -1.0"),
    ("grpo", "--generate-threads", "99999999999", "--generate-threads: expected in [1, 1024]"),
    ("crsp", "--sketch-perm", "0", "--sketch-perm: expected >= 1, got 0"),
    ("crsp", "--sketch-capacity", "-1", "--sketch-capacity: expected >= 1, got -1"),
    ("crsp", "--buffer-capacity", "0", "--buffer-capacity: expected >= 1, got 0"),
    ("crsp", "--alpha0", "-1", "--alpha0: expected >= 0, got -1.0"),
    ("crsp", "--prompt-cache-bytes", "-1", "--prompt-cache-bytes: expected >= 0, got -1"),
    ("crsp", "--max-prompt-tokens", "0", "--max-prompt-tokens: expected >= 1, got 0"),
    ("crsp", "--warmup-steps", "999999", "--warmup-steps: expected >= 0, and --warmup-steps x "
                                         "--warmup-batch < --train-size"),
    ("crsp", "--seed-shuffle-buffer", "99999999999", "--seed-shuffle-buffer: expected in [0, "
                                                     "2**20]"),
    ("guidance", "--actor-lr", "0", "--actor-lr: expected > 0, got 0.0"),
    ("guidance", "--guidance-lr", "-1", "--guidance-lr: expected > 0, got -1.0"),
    ("guidance", "--critic-lr", "0", "--critic-lr: expected > 0, got 0.0"),
    ("guidance", "--critic-hidden", "0", "--critic-hidden: expected >= 1, got 0"),
    ("guidance", "--critic-max-tokens", "1", "--critic-max-tokens: expected >= 2, got 1"),
    ("guidance", "--critic-model", "/nonexistent/encoder", "--critic-model: expected an encoder "
                                                         "directory holding config.json"),
]


def checked(trainer, argv):
    """The trainer's config from ``argv`` (with a fresh --run-dir), checked as ``main`` checks
    it before anything loads."""
    import importlib

    from trainers.config import check_finite, parse_config

    mod = importlib.import_module(f"trainers.{trainer}.config")
    cfg = parse_config(mod.Config, argv, prog="p", description="", resumable=set())
    check_finite(cfg)
    mod.check_config(cfg)
    return cfg


@pytest.mark.parametrize("trainer, flag, value, expected", BAD_VALUES)
def test_a_bad_flag_value_is_refused_naming_the_flag(trainer, flag, value, expected, tmp_path):
    with pytest.raises(ConfigError) as refused:
        checked(trainer, ["--run-dir", str(tmp_path / "run"), flag, value])
    assert str(refused.value).startswith(expected), str(refused.value)


def test_no_bad_value_of_any_flag_escapes_as_another_error(tmp_path, capsys):
    """Every flag of every trainer with a wrong type, negative, zero, huge and non-finite
    values: refused by argparse (exit 2, one line) or as a ConfigError, or valid; never
    another exception (which the console would print as a traceback)."""
    import dataclasses
    import importlib

    escaped = []
    for trainer in TRAINERS:
        for f in dataclasses.fields(importlib.import_module(f"trainers.{trainer}.config").Config):
            if isinstance(f.default, bool) or f.name in ("run_dir",):
                continue
            values = (["abc", "-1", "0", "1.5", "99999999999", str(10**30)]
                      if isinstance(f.default, int) else
                      ["abc", "-1", "0", "-1e9", "1e9", "nan", "inf"]
                      if isinstance(f.default, float) else
                      ["zzz-nonsense", "/nonexistent/path", "-1"])
            for v in values:
                try:
                    checked(trainer, ["--run-dir", str(tmp_path / "r"),
                                      "--" + f.name.replace("_", "-"), v])
                except SystemExit as e:
                    err = capsys.readouterr().err.strip().splitlines()
                    if e.code != 2 or len(err) != 1:
                        escaped.append((trainer, f.name, v, e.code, err))
                except ConfigError:
                    pass
                except Exception as e:  # noqa: BLE001 - what the test looks for
                    escaped.append((trainer, f.name, v, type(e).__name__, str(e)[:100]))
    assert escaped == []


def test_inspect_on_a_run_directory_names_its_buffer(tmp_path, capsys):
    ReplayBuffer.create(tmp_path / "run" / "buffer", capacity=4,
                        fields={"x": FieldSpec((), "float32")}).close()
    (tmp_path / "run" / "config.json").write_text("{}")
    assert cli_main(["inspect", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err == [(f"rlbuffers: error: {tmp_path / 'run'} is a run directory: its buffer is "
                   f"{tmp_path / 'run' / 'buffer'} (rlbuffers inspect "
                   f"{tmp_path / 'run' / 'buffer'})")]


# ----- curves and `rlbuffers plot` -------------------------------------------------------------

def synthetic_rows(trainer, n, seed=0):
    """``n`` metrics rows with every key the trainer's curve draws (shares in [0, 1])."""
    rng = np.random.default_rng(seed)
    share = lambda: float(rng.uniform(0, 1))  # noqa: E731
    if trainer == "erl":
        return [{"generation": i, "env_steps": 200 * i, "best_fitness": share() * 100,
                 "mean_fitness": share() * 50 - 25, "learner_return": share() * 10}
                for i in range(1, n + 1)]
    if trainer == "grpo":
        return [{"step": i, "reward_mean": share(), "accuracy": share(), "kl": share() / 100}
                for i in range(1, n + 1)]
    if trainer == "crsp":
        return [{"step": i, "proposer_reward": share(), "solver_reward": share(),
                 "critic_reward": share(), "seed_accuracy": share()} for i in range(1, n + 1)]
    return [{"iteration": i, "turn1_accuracy": share(), "turn2_accuracy": share(),
             "hint_uptake": 0.0, "critic_loss": share()} for i in range(1, n + 1)]


CONFIGS = {"erl": {"env": "HalfCheetah-v5", "generations": 3}, "grpo": {"task": "t", "steps": 3,
           "group_size": 8}, "crsp": {"steps": 3, "tensor_summary": False},
           "guidance": {"task": "t", "iterations": 3}}
SERIES = {"erl": 3, "grpo": 3, "crsp": 4, "guidance": 4}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_each_trainers_curve_is_readable_at_1_and_at_1000_points(trainer, tmp_path,
                                                                 monkeypatch):
    drawn = []
    real = curves.plot_curve

    def spy(*a, **kw):
        drawn.append(real(*a, **kw))
        return drawn[-1]

    for module in ("erl.train", "grpo.train", "crsp.train", "guidance.data"):  # who draws
        monkeypatch.setattr(f"trainers.{module}.plot_curve", spy)
    for n in (1, 1000):
        history = synthetic_rows(trainer, n)
        draw(trainer, tmp_path / f"{n}.png", history, CONFIGS[trainer])
        info = drawn[-1]
        assert (tmp_path / f"{n}.png").stat().st_size > 0
        assert len(info["labels"]) == SERIES[trainer]  # every series in the legend
        if n == 1:
            x = next(iter(history[0].values())) if trainer != "erl" else history[0]["env_steps"]
            assert info["xlim"][0] < x < info["xlim"][1]
        else:
            assert all("mean of 50" in label for label in info["labels"])
        if trainer != "erl":  # shares, rewards in [0, 1]: no negative axis
            assert info["ylim"][0] == 0
    assert which_trainer(CONFIGS[trainer], {}) == trainer
    assert which_trainer({}, synthetic_rows(trainer, 1)[0]) == trainer


def test_trainers_plot_draws_a_run_from_its_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                               for r in synthetic_rows("guidance", 5)))
    assert plot_main([str(run), "-o", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0
    assert plot_run(run) == run / "curve.png" and (run / "curve.png").exists()


def plot_errors(tmp_path):
    """``(argv, the one error line expected)`` for each way ``trainers.plot`` is refused."""
    run, empty, bad, badcfg = (tmp_path / n for n in ("run", "empty", "bad", "badcfg"))
    for d in (run, empty, bad, badcfg):
        d.mkdir()
    rows = "".join(json.dumps(r) + "\n" for r in synthetic_rows("grpo", 2))
    (run / "metrics.jsonl").write_text(rows)
    (empty / "metrics.jsonl").write_text("")
    (bad / "metrics.jsonl").write_text(rows + "{not json\n")
    (badcfg / "metrics.jsonl").write_text(rows)
    (badcfg / "config.json").write_text("[1]")
    ReplayBuffer.create(tmp_path / "buf", capacity=4, fields={"x": FieldSpec((), "float32")}
                        ).close()
    return [
        ([str(tmp_path / "none")], f"{tmp_path / 'none'}: no such directory"),
        ([str(run / "metrics.jsonl")], f"{run / 'metrics.jsonl'}: not a directory (give a run "
                                       "directory)"),
        ([str(tmp_path / "buf")], f"{tmp_path / 'buf'}: no metrics.jsonl, not a trainer's run "
                                  "directory (a buffer: give its run directory)"),
        ([str(empty)], f"{empty / 'metrics.jsonl'}: no rows yet (the first unit has not "
                       "completed)"),
        ([str(bad)], f"{bad / 'metrics.jsonl'}: line 3: expected a JSON object, got Expecting "
                     "property name enclosed in double quotes"),
        ([str(badcfg)], f"{badcfg / 'config.json'}: "),
        ([str(run), "-o", str(tmp_path / "no" / "c.png")],
         f"-o {tmp_path / 'no' / 'c.png'}: no directory {tmp_path / 'no'} to write it in"),
        ([str(run), "-o", str(tmp_path / "c.jpg")], f"-o {tmp_path / 'c.jpg'}: expected a .png "
                                                    "file name"),
        ([str(run), "--o", "x.png"], "unrecognized arguments: --o x.png (see python3 -m "
                                     "trainers.plot --help)"),
    ]


def test_trainers_plot_errors_are_one_line_naming_what_is_wrong(tmp_path, capsys):
    """Issue 45: every refusal is one line, exit code 2, naming the directory or file (the
    old ``rlbuffers plot`` ended its errors in "(while working on ?)")."""
    for argv, expected in plot_errors(tmp_path):
        try:
            code = plot_main(argv)
        except SystemExit as e:  # argparse's errors
            code = e.code
        err = capsys.readouterr().err.splitlines()
        assert code == 2 and len(err) == 1, (argv, err)
        assert err[0].startswith(f"python3 -m trainers.plot: error: {expected}"), (argv, err)
        assert "?" not in err[0] and "Traceback" not in err[0]


def test_python3_m_trainers_plot_runs_from_the_checkout(tmp_path):
    """The command the run's summary prints, in a process of its own (the library does not
    import the trainers: the command is theirs)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(synthetic_rows("erl", 1)[0]) + "\n")
    out = subprocess.run([sys.executable, "-m", "trainers.plot", str(run)], capture_output=True,
                         text=True, env=ENV, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == str(run / "curve.png"), out.stderr
    out = subprocess.run([sys.executable, "-m", "trainers.plot", str(tmp_path / "none")],
                         capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        f"python3 -m trainers.plot: error: {tmp_path / 'none'}: no such directory"]


# ----- TensorBoard, summary, quiet output: ERL and guidance ------------------------------------

def test_erl_writes_tensorboard_events_a_summary_and_no_mujoco_warning(tmp_path):
    from tests.test_erl import TINY

    run = tmp_path / "erl"
    out = subprocess.run([sys.executable, "-m", "trainers.erl", "--run-dir", str(run), *TINY,
                          "--generations", "2"], capture_output=True, text=True, env=ENV,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert_tensorboard_matches_metrics(run, "generation")
    assert "settotalmass" not in out.stdout + out.stderr
    assert "done: generation 2 of 2" in out.stderr
    assert f"rlbuffers inspect {run / 'buffer'}" in out.stderr
    peak = int(out.stderr.split("peak RSS ")[1].split(" MiB")[0].replace(",", ""))
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert peak * 2**20 >= last["process_peak_rss_bytes"] - 2**20
    assert last["process_peak_rss_bytes"] >= last["peak_rss_bytes"]


def test_guidance_writes_tensorboard_events_and_a_summary(tiny, tmp_path, monkeypatch,  # noqa: F811
                                                          capsys):
    monkeypatch.setattr(guidance_train, "score", fake_score)
    run = tmp_path / "g"
    guidance_train.main(guidance_args(tiny, run, "--iterations", "2"))
    assert_tensorboard_matches_metrics(run, "iteration")
    err = capsys.readouterr().err
    assert "done: iteration 2 of 2" in err and str(run / "tb") in err


# ----- peak RSS --------------------------------------------------------------------------------

def test_the_process_peak_survives_the_phase_resets():
    block = np.ones(64 * 2**20 // 8)  # 64 MiB touched
    high = peak_rss_bytes()
    del block
    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    # the 64 MiB peak is lost to peak_rss_bytes() and kept here (up to what other threads
    # allocate between reset_peak_rss's read and its reset: < 1 MiB)
    assert peak_rss_bytes() < high - 32 * 2**20  # the block was freed, then the reset
    assert process_peak_rss_bytes() >= high - 2**20


# ----- no silent phase -------------------------------------------------------------------------

def test_every_phase_of_a_tiny_grpo_run_says_when_it_starts(tmp_path):
    rc, lines = timed_lines(tiny_grpo_command(tmp_path / "run"), timeout_s=300)
    text = [line for _, line in lines]
    assert rc == 0, text[-20:]
    for step in (1, 2):
        for phase in ("generate", "score", "reference", "save_wait", "update", "buffer"):
            assert any(f"{phase} (step {step})..." in line for line in text), (phase, step)
    assert any("loading trainers.grpo" in line for line in text)
    assert any("loading the model from" in line for line in text)
    assert any("held-out evaluations: 4 task problems before step 1 and after step 2 (greedy, "
               "up to 12 tokens each; --no-evaluate skips them)" in line for line in text)
    for when in ("before", "after"):  # announced with their size, as they start
        assert sum(f"held-out evaluation {when}: 4 task problems..." in line
                   for line in text) == 1, when
    assert any("done: step 2 of 2" in line for line in text)
    assert len(gaps(lines)) == len(lines)
