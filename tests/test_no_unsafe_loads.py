"""Issue 44 (R1): nothing under rlbuffers/, trainers/ or tools/ reads data in a way that can
run code: every ``torch.load`` passes ``weights_only=True`` literally, and there is no
``pickle.load``/``loads``/``Unpickler``, ``np.load(allow_pickle=True)``, ``yaml.load``,
``dill``, ``cloudpickle``, ``marshal``, ``joblib.load``, ``shelve``, ``eval`` or ``exec``
outside the few modules allowed below by name, each with its reason
(``rlbuffers/integrations/sb3/pickle_reader.py`` needs none: it reads SB3 pickles only through
``rlbuffers.integrations.sb3.inert_pickle``'s restricted unpickler). The scanner reads
the source with :mod:`ast` (no import) and is checked on planted calls too."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("rlbuffers", "trainers", "tools")

#: (file, rule) pairs allowed, with the reason.
ALLOWED = {
    ("rlbuffers/integrations/sb3/inert_pickle.py", "pickle.Unpickler"):
        "rlbuffers' restricted unpickler: it subclasses the pure-Python pickle._Unpickler to "
        "override its opcodes; find_class returns inert stand-ins (InertObject) or numpy's "
        "own array/dtype paths after checks, so no code named by the pickle runs",
    ("tools/fuzz/fuzz_sb3_kwargs.py", "pickle.Unpickler"):
        "reads back the pointer pickles the fuzzer itself made, through a find_class that "
        "resolves only reopen (to the identity), gymnasium spaces and numpy reconstructors",
    ("tools/bench/bench_peers.py", "pickle.Unpickler"):
        "the peer 'numpy ring + pickle+gzip' is the seed system's own save (pickle.dump into "
        "gzip, what died of ENOMEM): the benchmark times it and reads back only the file it "
        "wrote moments before in its own temporary directory",
    ("tools/bench/profile_sample.py", "exec"):
        "compiles this repository's own source at a git revision (a benchmark of an older "
        "method), never data from a file a user is given",
}

PICKLE_CALLS = {"load", "loads", "Unpickler", "_Unpickler"}
MODULE_RULES = {  # module alias -> (forbidden attributes or None for all, rule name)
    "pickle": (PICKLE_CALLS, "pickle.Unpickler"),
    "_pickle": (PICKLE_CALLS, "pickle.Unpickler"),
    "cPickle": (PICKLE_CALLS, "pickle.Unpickler"),
    "dill": (None, "dill"),
    "cloudpickle": ({"load", "loads"}, "cloudpickle.load"),
    "marshal": ({"load", "loads"}, "marshal.loads"),
    "joblib": ({"load"}, "joblib.load"),
    "shelve": ({"open", "Shelf", "DbfilenameShelf"}, "shelve.open"),
    "yaml": ({"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load",
              "full_load_all", "Loader", "UnsafeLoader", "FullLoader"}, "yaml.load"),
}


def _name(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain ('' otherwise)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _literal(call: ast.Call, key: str) -> object:
    """The literal value of keyword ``key`` of ``call`` (``...`` when absent, ``None`` when
    not a constant)."""
    for kw in call.keywords:
        if kw.arg == key:
            return kw.value.value if isinstance(kw.value, ast.Constant) else None
    return ...


def _rule(node: ast.AST, aliases: dict[str, str]) -> str | None:  # noqa: C901
    """The rule ``node`` breaks (``aliases``: local name -> module or module.attr)."""
    if isinstance(node, ast.ClassDef):
        for base in node.bases:
            full = _resolve(_name(base), aliases)
            if full.rsplit(".", 1)[-1] in {"Unpickler", "_Unpickler"} and "pickle" in full:
                return "pickle.Unpickler"
        return None
    if isinstance(node, ast.Import | ast.ImportFrom):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if any(m.split(".")[0] == "dill" for m in mods):
            return "dill"
        return None
    if not isinstance(node, ast.Call):
        return None
    full = _resolve(_name(node.func), aliases)
    if full in ("eval", "exec", "builtins.eval", "builtins.exec"):
        return full.rsplit(".", 1)[-1]
    if full == "torch.load":
        return None if _literal(node, "weights_only") is True else "torch.load"
    if full in ("numpy.load", "np.load"):
        return None if _literal(node, "allow_pickle") in (False, ...) else "np.load"
    if full in ("pandas.read_pickle", "pd.read_pickle"):
        return "pandas.read_pickle"
    if "." in full:
        mod, attr = full.rsplit(".", 1)
        rule = MODULE_RULES.get(mod)
        if rule is not None and (rule[0] is None or attr in rule[0]):
            return rule[1]
    return None


def _resolve(name: str, aliases: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    base = aliases.get(head, head)
    return f"{base}.{rest}" if rest else base


def _aliases(tree: ast.AST) -> dict[str, str]:
    out = {"np": "numpy", "pd": "pandas"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                    a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def unsafe_loads(root: Path, files: list[Path] | None = None) -> list[tuple[str, int, str]]:
    """``(file relative to root, line, rule)`` of every unsafe read under ``root``'s
    :data:`ROOTS` (or in ``files``), the allowed pairs left out."""
    found = []
    paths = files if files is not None else sorted(
        p for r in ROOTS for p in (root / r).rglob("*.py") if "/." not in str(p))
    for path in paths:
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            rule = _rule(node, aliases)
            if rule is not None and (rel, rule) not in ALLOWED:
                found.append((rel, getattr(node, "lineno", 0), rule))
    return found


def test_no_unsafe_loads_in_the_repository():
    found = unsafe_loads(REPO)
    assert not found, "unsafe reads (file:line rule):\n" + "\n".join(
        f"{f}:{line} {rule}" for f, line, rule in found)


def test_the_allowed_modules_exist_and_still_need_their_entry():
    """An allowance whose module no longer has the call is dropped, not kept."""
    for (rel, rule), _reason in ALLOWED.items():
        path = REPO / rel
        assert path.is_file(), rel
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        assert any(_rule(n, aliases) == rule for n in ast.walk(tree)), (rel, rule)


UNSAFE = [
    ("import torch\ntorch.load(p)\n", "torch.load"),
    ("import torch\ntorch.load(p, weights_only=False)\n", "torch.load"),
    ("import torch\ntorch.load(p, weights_only=flag)\n", "torch.load"),
    ("import torch as T\nT.load(p, map_location='cpu')\n", "torch.load"),
    ("from torch import load\nload(p)\n", "torch.load"),
    ("import pickle\npickle.load(f)\n", "pickle.Unpickler"),
    ("import pickle\npickle.loads(b)\n", "pickle.Unpickler"),
    ("import pickle as pk\npk.Unpickler(f).load()\n", "pickle.Unpickler"),
    ("from pickle import loads\nloads(b)\n", "pickle.Unpickler"),
    ("import pickle\nclass U(pickle.Unpickler):\n    pass\n", "pickle.Unpickler"),
    ("import numpy as np\nnp.load(p, allow_pickle=True)\n", "np.load"),
    ("import numpy\nnumpy.load(p, allow_pickle=x)\n", "np.load"),
    ("import yaml\nyaml.load(s, Loader=yaml.Loader)\n", "yaml.load"),
    ("import yaml\nyaml.unsafe_load(s)\n", "yaml.load"),
    ("import dill\n", "dill"),
    ("import cloudpickle\ncloudpickle.loads(b)\n", "cloudpickle.load"),
    ("import marshal\nmarshal.loads(b)\n", "marshal.loads"),
    ("import joblib\njoblib.load(p)\n", "joblib.load"),
    ("import shelve\nshelve.open(p)\n", "shelve.open"),
    ("eval(text)\n", "eval"),
    ("exec(code, {})\n", "exec"),
    ("import pandas as pd\npd.read_pickle(p)\n", "pandas.read_pickle"),
]
SAFE = ["import torch\ntorch.load(p, weights_only=True)\n",
        "import torch\ntorch.load(p, mmap=True, weights_only=True, map_location='cpu')\n",
        "import numpy as np\nnp.load(p)\n", "import numpy as np\nnp.load(p, allow_pickle=False)\n",
        "import pickle\npickle.dumps(x)\n", "import yaml\nyaml.safe_load(s)\n",
        "model.eval()\n", "import json\njson.loads(s)\n", "import marshal\nmarshal.dumps(x)\n"]


@pytest.mark.parametrize("seed", range(3))
def test_planted_unsafe_calls_are_found_and_safe_ones_are_not(tmp_path, seed):
    """Files of random mixes of the unsafe and safe snippets (behind random indentation in
    functions): the scanner names exactly the unsafe lines, with their rule."""
    rng = random.Random(seed)
    (tmp_path / "trainers").mkdir()
    files, want = [], []
    for i in range(6):
        lines: list[str] = []
        for _ in range(rng.randint(1, 6)):
            wrap = rng.random() < 0.5
            if rng.random() < 0.5:
                code, rule = rng.choice(UNSAFE)
            else:
                code, rule = rng.choice(SAFE), None
            body = code.splitlines()
            if wrap:
                lines.append(f"def f{len(lines)}(p, b, f, s, x, flag, text, code, model):")
                body = ["    " + line for line in body]
            start = len(lines) + 1
            lines += body
            if rule is not None:  # the call (or import / class) is the snippet's last line
                last = start + len(body) - 1 - (rule == "pickle.Unpickler"
                                                and "class" in code)
                want.append((f"trainers/m{i}.py", last, rule))
        path = tmp_path / "trainers" / f"m{i}.py"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    got = unsafe_loads(tmp_path, files)
    assert sorted(got) == sorted(want)
    assert sorted(unsafe_loads(tmp_path)) == sorted(want)  # the walk over ROOTS finds them
