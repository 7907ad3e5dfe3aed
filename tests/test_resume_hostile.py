"""Issue 44, R1 and E1: ``--resume`` of a run directory somebody else prepared or that was
damaged. Every trainer (erl, grpo, crsp, guidance), through its real entry point
(``trainers.config.run_main``, what ``python -m trainers.X`` runs):

- R1: a checkpoint's ``rng.pt`` (or another torch file) holding a pickle that would create a
  marker file, with ``checksums.json`` recomputed to match or deleted: the marker is never
  created and the resume ends with one line naming the file, exit code 2;
- E1: ``config.json`` a JSON list, not JSON, or its target ``"abc"``; no ``buffer/``; a
  truncated checkpoint file (caught by its checksum, or by the loader once ``checksums.json``
  is gone): one line naming the file and what was expected, exit code 2, no traceback.

A pristine one-unit run of each trainer is made once; each case damages a copy of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.heavy import require

require("reasoning_gym", "transformers", "peft", "tokenizers")

from rlbuffers.checkpoint import CHECKSUMS_JSON, file_crc32c  # noqa: E402
from tests.test_crsp import ARGS as CRSP_ARGS  # noqa: E402
from tests.test_erl import TINY as ERL_TINY  # noqa: E402
from tests.test_grpo import ARGS as GRPO_ARGS  # noqa: E402
from tests.test_guidance import args as guidance_args  # noqa: E402
from tests.test_guidance import make_tiny_bert  # noqa: E402
from tests.tiny_lm import make_tiny_lm_dir  # noqa: E402
from trainers.config import run_main  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

#: trainer -> (module, unit, target flag, a torch file and a weights file of its checkpoint)
TRAINERS = {
    "erl": ("trainers.erl.train", "generation", "generations", "learner.pt", "population.pt"),
    "grpo": ("trainers.grpo.train", "step", "steps", "optimizer.pt", "weights.safetensors"),
    "crsp": ("trainers.crsp.train", "step", "steps", "optimizers.pt", "adapters.safetensors"),
    "guidance": ("trainers.guidance.train", "iteration", "iterations", "optimizers.pt",
                 "critic.safetensors"),
}


#: A progress bar's line (transformers' "Loading weights: 100%|...| 20/20 [...]").
PROGRESS = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return make_tiny_lm_dir(d / "lm"), make_tiny_bert(d / "bert")


def new_run_args(name: str, models, run: Path) -> list[str]:
    lm, bert = models
    if name == "erl":
        return ["--run-dir", str(run), *ERL_TINY, "--generations", "1"]
    if name == "grpo":
        return [*GRPO_ARGS, "--model", str(lm), "--run-dir", str(run), "--steps", "1"]
    if name == "crsp":
        return [*CRSP_ARGS, "--model", str(lm), "--run-dir", str(run), "--steps", "1"]
    return guidance_args((lm, bert), run, "--iterations", "1")


def entry(module: str, argv: list[str], monkeypatch) -> int | str | None:
    """``run_main(module)`` with ``argv`` as the command line; its exit code (0: returned)."""
    monkeypatch.setattr(sys, "argv", [module, *argv])
    torch.set_num_threads(1)
    try:
        run_main(module)
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def pristine(models, tmp_path_factory):
    """``{trainer: run directory}`` of one complete unit each, made lazily."""
    made: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("pristine")

    def get(name: str) -> Path:
        if name not in made:
            run = base / name
            with pytest.MonkeyPatch.context() as mp:
                assert entry(TRAINERS[name][0], [*new_run_args(name, models, run), "--quiet"],
                             mp) == 0
            made[name] = run
        return made[name]

    return get


def resume(name: str, run: Path, monkeypatch, capsys) -> tuple[int | str | None, list[str]]:
    """Resume ``run`` to 2 units; the exit code and stderr's lines (log lines aside)."""
    module, _, target, *_ = TRAINERS[name]
    capsys.readouterr()
    code = entry(module, ["--resume", "--run-dir", str(run), f"--{target}", "2", "--quiet"],
                 monkeypatch)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return code, [line for line in err.splitlines() if line.strip()
                  and not line.startswith(("WARNING ", "INFO ")) and not PROGRESS.search(line)]


def damaged_copy(pristine, name: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the trainer's pristine run and its checkpoint directory."""
    run = tmp_path / "run"
    shutil.copytree(pristine(name), run, symlinks=True)
    return run, run / "ckpt" / f"{TRAINERS[name][1]}-1"


def recompute_checksums(ckpt: Path) -> None:
    """What an attacker does to get past the crc32c check."""
    sums = json.loads((ckpt / CHECKSUMS_JSON).read_text())
    (ckpt / CHECKSUMS_JSON).write_text(json.dumps({n: file_crc32c(ckpt / n) for n in sums}))


class Payload:
    """Unpickling it would call ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def assert_one_line(code, lines, *needles) -> None:
    assert code == 2, (code, lines)
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("name", list(TRAINERS))
@pytest.mark.parametrize("file,checksums", [("rng.pt", "recomputed"), ("rng.pt", "deleted"),
                                            ("torch", "recomputed")])
def test_a_pickle_payload_in_a_checkpoint_never_runs(pristine, name, file, checksums, tmp_path,
                                                     monkeypatch, capsys):
    run, ckpt = damaged_copy(pristine, name, tmp_path)
    marker = tmp_path / "marker"
    target = ckpt / (TRAINERS[name][3] if file == "torch" else file)
    torch.save({"torch": Payload(marker), "numpy": {}, "python": ()}, target)
    if checksums == "recomputed":
        recompute_checksums(ckpt)
    else:
        (ckpt / CHECKSUMS_JSON).unlink()
    code, lines = resume(name, run, monkeypatch, capsys)
    assert not marker.exists(), "the pickle ran code"
    assert_one_line(code, lines, str(target), "weights_only=True")


def test_a_pickle_payload_in_the_reference_weights_never_runs(pristine, tmp_path, monkeypatch,
                                                             capsys):
    """GRPO's full fine-tuning reference (``reference.pt``, memory-mapped at each step)."""
    run, _ = damaged_copy(pristine, "grpo", tmp_path)
    marker = tmp_path / "marker"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, run / "reference.pt")
    code, lines = resume("grpo", run, monkeypatch, capsys)
    assert not marker.exists(), "the pickle ran code"
    assert_one_line(code, lines, str(run / "reference.pt"), "weights_only=True")


def _config(run: Path, edit) -> None:
    path = run / "config.json"
    path.write_text(edit(path.read_text()))


CASES = {
    "config_list": (lambda run, t: _config(run, lambda _: "[1, 2]"),
                    ["config.json: top level: expected a JSON object, got a JSON list"]),
    "config_not_json": (lambda run, t: _config(run, lambda s: s[:len(s) // 2]),
                        ["config.json: JSON: expected valid JSON, got"]),
    "target_abc": (lambda run, t: _config(run, lambda s: json.dumps(
        {**json.loads(s), t: "abc"})), ["config.json: {t}: expected int, got 'abc'"]),
    "seed_float": (lambda run, t: _config(run, lambda s: json.dumps(
        {**json.loads(s), "seed": 1.5})), ["config.json: seed: expected int, got 1.5"]),
    "no_buffer": (lambda run, t: shutil.rmtree(run / "buffer"),
                  ["buffer: not an rlbuffers buffer"]),
}


@pytest.mark.parametrize("name", list(TRAINERS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_run_directory_is_one_line(pristine, name, case, tmp_path, monkeypatch,
                                             capsys):
    run, _ = damaged_copy(pristine, name, tmp_path)
    damage, needles = CASES[case]
    target = TRAINERS[name][2]
    damage(run, target)
    code, lines = resume(name, run, monkeypatch, capsys)
    assert_one_line(code, lines, *(n.replace("{t}", target) for n in needles))


@pytest.mark.parametrize("name", list(TRAINERS))
@pytest.mark.parametrize("which", [3, 4])
@pytest.mark.parametrize("checksums", ["kept", "deleted"])
def test_a_truncated_checkpoint_file_is_one_line(pristine, name, which, checksums, tmp_path,
                                                 monkeypatch, capsys):
    run, ckpt = damaged_copy(pristine, name, tmp_path)
    path = ckpt / TRAINERS[name][which]
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    if checksums == "deleted":
        (ckpt / CHECKSUMS_JSON).unlink()
    code, lines = resume(name, run, monkeypatch, capsys)
    assert_one_line(code, lines, str(path),
                    "crc32c expected" if checksums == "kept" else "expected a complete")


@pytest.mark.parametrize("name", ["grpo", "erl"])
def test_state_of_the_wrong_shape_is_one_line(pristine, name, tmp_path, monkeypatch, capsys):
    """state.json edited (checksums recomputed): the unit must match the buffer's commit,
    and every field has the type a fresh trainer gives it."""
    run, ckpt = damaged_copy(pristine, name, tmp_path)
    unit = TRAINERS[name][1]
    state = json.loads((ckpt / "state.json").read_text())
    state["trainer"][unit] = 7
    (ckpt / "state.json").write_text(json.dumps(state))
    recompute_checksums(ckpt)
    code, lines = resume(name, run, monkeypatch, capsys)
    assert_one_line(code, lines, str(ckpt / "state.json"), f"trainer.{unit}: expected 1")
    state["trainer"][unit] = "1"
    (ckpt / "state.json").write_text(json.dumps(state))
    recompute_checksums(ckpt)
    code, lines = resume(name, run, monkeypatch, capsys)
    assert_one_line(code, lines, f"state.trainer.{unit}: expected an integer")


def test_the_undamaged_copy_resumes(pristine, tmp_path, monkeypatch, capsys):
    """The control: the same copy, not damaged, resumes to unit 2 (exit 0)."""
    run, _ = damaged_copy(pristine, "grpo", tmp_path)
    code, lines = resume("grpo", run, monkeypatch, capsys)
    assert code in (0, None), lines
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2]


@pytest.mark.parametrize("env,needle", [
    ("abc", "Environment `abc` doesn't exist"),
    ("tests.no_such_module:Env", "no 'module:' prefix"),
])
def test_an_unknown_or_importing_env_id_in_config_json_is_one_line(pristine, env, needle,
                                                                   tmp_path, monkeypatch,
                                                                   capsys):
    """fuzz_resume (10-minute run): ERL's ``env`` in config.json was handed to gym.make, whose
    NameNotFound escaped as a traceback; a ``module:`` id would make gym.make import it."""
    run, _ = damaged_copy(pristine, "erl", tmp_path)
    _config(run, lambda s: json.dumps({**json.loads(s), "env": env}))
    code, lines = resume("erl", run, monkeypatch, capsys)
    assert_one_line(code, lines, "config.json", "--env: expected a registered Gymnasium", needle)
