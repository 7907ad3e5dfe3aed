"""Checks of what a resumed run reads back from its run directory, beyond the file loaders
of :mod:`rlbuffers.safe_load`: directories that must be the run's own (not symlinks), files a
reader opens by name, and the trainer state's shape against a fresh trainer's."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rlbuffers.errors import CorruptCheckpointError, UnsafePathError
from rlbuffers.safe_load import RunFileError, open_regular

if TYPE_CHECKING:
    from trainers.common import Run


#: The shape of ``MemoryMonitor.state_dict()`` (phase name -> 4 numbers; saving -> a number).
MONITOR_STATE = {"phases": {"*": [0.0]}, "savings": {"*": 0.0}}
#: The files of a ``TokenStore`` directory.
TOKEN_STORE_FILES = ["meta.json", "offsets.bin", "tokens.bin"]

#: (template type, check of the value, what is expected), first match wins.
_SCALARS = ((bool, lambda v: isinstance(v, bool), "true or false"),
            (int, lambda v: type(v) is int, "an integer"),
            (float, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
            (str, lambda v: isinstance(v, str), "a string"),
            (dict, lambda v: isinstance(v, dict), "an object"),
            (list | tuple, lambda v: isinstance(v, list | tuple), "a list"))


def check_state(value: Any, template: Any, path: Path, field: str = "state") -> None:
    """Check that ``value`` (read back from the checkpoint file ``path``) has the shape of
    ``template`` (the same state as a fresh trainer makes it): a dict holds every key of the
    template's (more are allowed) with values of the same shape, a list is a list (its items
    shaped like the template's first), an int an int (>= 0 where the template's is: counters
    and sizes), a float a number, a string a string
    (``None`` in the template: anything; a dict template ``{"*": t}``: every value shaped
    like ``t``).

    Raises:
        rlbuffers.CorruptCheckpointError: ``<path>: <field.key...>: expected <type>, got
            <value>`` for the first difference.
    """
    for kind, ok, expected in _SCALARS:
        if isinstance(template, kind):
            if not ok(value):
                _fail(path, field, expected, value)
            break
    if type(template) is int and template >= 0 and value < 0:
        _fail(path, field, "an integer >= 0", value)
    if isinstance(template, dict):
        _check_items(value, template, path, field)
    elif isinstance(template, list | tuple) and template:
        for i, item in enumerate(value):
            check_state(item, template[0], path, f"{field}[{i}]")


def _check_items(value: dict[str, Any], template: dict[str, Any], path: Path,
                 field: str) -> None:
    if list(template) == ["*"]:
        for key, sub in value.items():
            check_state(sub, template["*"], path, f"{field}.{key}")
        return
    for key, sub in template.items():
        if key not in value:
            raise CorruptCheckpointError(f"{path}: {field}.{key}: expected a value, got "
                                         "nothing (missing)")
        check_state(value[key], sub, path, f"{field}.{key}")


def _fail(path: Path, field: str, expected: str, value: Any) -> NoReturn:
    raise CorruptCheckpointError(f"{path}: {field}: expected {expected}, got "
                                 f"{type(value).__name__} {str(value)[:60]!r}")


def check_unit(trainer: dict[str, Any], run: Run, path: Path) -> None:
    """Check that the trainer state's ``trainer[run.unit]`` is the buffer commit's unit.

    Raises:
        rlbuffers.CorruptCheckpointError: it is not (one line naming ``path``).
    """
    if trainer.get(run.unit) != run.done:
        raise CorruptCheckpointError(f"{path}: trainer.{run.unit}: expected {run.done} (the "
                                     f"buffer's last commit), got {trainer.get(run.unit)!r}")


def real_dir(root: Path, name: str, *, make: bool = True) -> Path:
    """``root/name`` as a directory of its own (made when missing and ``make``): not a
    symlink, so what is written there stays in the run directory.

    Raises:
        rlbuffers.UnsafePathError: ``root/name`` is a symlink or not a directory.
        rlbuffers.safe_load.RunFileError: it is missing and not ``make``.
    """
    path = root / name
    if make:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise RunFileError(path, "directory", "a directory", "nothing (missing)") from None
    if not stat.S_ISDIR(mode):
        what = "a symlink" if stat.S_ISLNK(mode) else f"mode {stat.filemode(mode)}"
        raise UnsafePathError(f"{path}: expected a directory, got {what}; the trainers write "
                              "only inside the run directory (remove it)")
    return path


def check_regular_files(directory: Path, names: list[str]) -> None:
    """Check that each of ``names`` in ``directory`` is a regular file (not a symlink, FIFO
    or directory) before a reader that opens them by name (e.g. a ``TokenStore``).

    Raises:
        rlbuffers.safe_load.RunFileError: one of them is missing or not a regular file.
    """
    real_dir(directory.parent, directory.name, make=False)
    for name in names:
        os.close(open_regular(directory / name))


def check_optimizer(opt: Any) -> None:
    """Check that every tensor of the loaded optimizer state (Adam's moments) has the shape
    of its parameter (a state saved for another model would fail only at the next step).

    Raises:
        ValueError: a state tensor's shape differs (``restoring`` names the file).
    """
    import torch

    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                    raise ValueError(f"{key} of shape {tuple(value.shape)} for a parameter "
                                     f"of shape {tuple(p.shape)}")


def open_token_store(directory: Path, vocab_size: int) -> Any:
    """The ``TokenStore`` at ``directory`` (the run's tokenized prompts), checked: its files
    regular, its ``meta.json`` a JSON object, its sequences covering its tokens exactly and
    every token id below ``vocab_size`` (a damaged store would fail only inside the model).

    Raises:
        rlbuffers.safe_load.RunFileError: a file is missing, not a regular file, or
            ``meta.json`` is not a JSON object.
        rlbuffers.CorruptCheckpointError: the store does not hold what it says (one line).
    """
    from rlbuffers.safe_load import load_json, restoring
    from rlbuffers.stream.token_store import TokenStore

    check_regular_files(directory, TOKEN_STORE_FILES)
    load_json(directory / "meta.json", dict)
    expected = f"token sequences of ids below {vocab_size}"
    with restoring(directory, expected, field="token store"):
        store = TokenStore(directory)
        total = 0
        for seq in store:
            total += len(seq)
            if len(seq) and not 0 <= int(seq.min()) <= int(seq.max()) < vocab_size:
                raise ValueError(f"a token id out of range [{int(seq.min())}, "
                                 f"{int(seq.max())}]")
        if total != store.num_tokens:
            raise ValueError(f"sequences of {total} tokens in all, meta.json says "
                             f"{store.num_tokens}")
    return store


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (none when it is missing; blank lines skipped),
    read as a regular file (never through a symlink, never waiting on a FIFO).

    Raises:
        rlbuffers.safe_load.RunFileError: it is not a regular file or a line is not a JSON
            object.
    """
    import json

    from rlbuffers.safe_load import read_bytes

    path = run_dir / "metrics.jsonl"
    if not os.path.lexists(path):
        return []
    rows = []
    for i, line in enumerate(read_bytes(path).decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RunFileError(path, f"line {i}", "a JSON object", e.msg) from None
        if not isinstance(rows[-1], dict):
            raise RunFileError(path, f"line {i}", "a JSON object", repr(rows[-1])[:60])
    return rows
