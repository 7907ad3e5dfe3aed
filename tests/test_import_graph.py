"""The project's own modules import each other without cycles, and trainer packages depend
only on the shared layers.

The import graph is built statically with :mod:`ast` (nothing is imported). Every ``import``
and ``from ... import`` counts as an edge, at module level and inside functions alike: a
function-level import only defers a circular dependency to the first call, it does not remove
it (``rlbuffers.cli`` <-> ``rlbuffers.cli.verify`` was such a cycle). Imports under
``if TYPE_CHECKING:`` are left out: they never run and exist for annotations only.
``from pkg import name`` is an edge to ``pkg.name`` when that is one of the project's modules,
else to ``pkg`` (its ``__init__``); importing ``a.b.c`` does not add edges to ``a`` and ``a.b``
(Python imports the parents too, but that is how packages work, not a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]
#: The top-level packages whose modules must form no cycle.
CHECKED = ["rlbuffers", "tools", "trainers"]
#: What a trainer package (trainers/<name>/) may import from the project: itself, these
#: shared layers of trainers/ (the LLM parts, the run lifecycle, the config base, the curve,
#: the per-phase figures, the closing summary), and the library.
SHARED_TRAINER_LAYERS = {"llm", "common", "config", "curves", "phases", "summary", "statistics"}
#: The most lines a module of trainers/ may have (one concept per module, read in one go).
MAX_TRAINER_MODULE_LINES = 500


def module_name(root: Path, path: Path) -> str:
    """``a/b/c.py`` -> ``a.b.c``; ``a/b/__init__.py`` -> ``a.b`` (relative to ``root``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: list[str]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file under ``root/<package>`` for each package."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            out[module_name(root, path)] = path
    return out


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if _type_checking_block(node):
            todo.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules (names in ``known``) that module ``name`` at ``path`` imports."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a module in a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, over every module of ``packages``."""
    files = modules(root, packages)
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component of more than one module:
    the shortest through the component's first module (by name); sorted."""
    g = nx.DiGraph([(a, b) for a, bs in graph.items() for b in bs])
    found = []
    for component in nx.strongly_connected_components(g):
        if len(component) > 1:
            first = min(component)
            sub = g.subgraph(component)
            back = min(sorted(p for p in sub.predecessors(first)),
                       key=lambda p: nx.shortest_path_length(sub, first, p))
            found.append(nx.shortest_path(sub, first, back) + [first])
    return sorted(found)


def trainer_layering_violations(root: Path) -> list[str]:
    """Imports that break the trainers' layering, as ``"importer -> imported"``: a trainer
    package ``trainers.<name>`` (a directory with ``__init__.py``, ``<name>`` not a shared
    layer) may import only itself, ``trainers.llm``, ``trainers.common`` and ``rlbuffers``
    from the project (not another trainer package, flat ``trainers/*.py`` module or
    ``tools``); the shared layers may not import a trainer package. Flat modules of
    ``trainers/`` are outside the rule until they become packages."""
    trainers = root / "trainers"
    if not trainers.is_dir():
        return []
    packages = sorted(p.name for p in trainers.iterdir() if (p / "__init__.py").is_file())
    graph = import_graph(root, [p for p in ("rlbuffers", "tools", "trainers")
                                if (root / p).is_dir()])
    bad = []
    for importer, imported in sorted(graph.items()):
        parts = importer.split(".")
        if parts[0] != "trainers" or len(parts) < 2 or parts[1] not in packages:
            continue
        own = parts[1]
        for target in sorted(imported):
            t = target.split(".")
            if t[0] == "rlbuffers":
                continue
            if t[0] == "trainers" and len(t) > 1 and (t[1] == own
                                                      or t[1] in SHARED_TRAINER_LAYERS):
                continue
            bad.append(f"{importer} -> {target}")
    return bad


@pytest.mark.parametrize("package", CHECKED)
def test_no_import_cycle(package):
    found = [c for c in cycles(import_graph(REPO, ["rlbuffers", "tools", "trainers"]))
             if any(m == package or m.startswith(package + ".") for m in c)]
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_trainer_packages_import_only_shared_layers():
    assert trainer_layering_violations(REPO) == []


def test_every_trainer_is_a_package_and_no_trainer_module_is_long():
    packages = {p.name for p in (REPO / "trainers").iterdir() if (p / "__init__.py").is_file()}
    assert {"erl", "grpo", "crsp", "guidance", "llm"} <= packages
    for name in ("erl", "grpo", "crsp", "guidance"):  # python -m trainers.NAME
        assert {"__main__.py", "config.py", "train.py"} <= {
            p.name for p in (REPO / "trainers" / name).iterdir()}, name
    long = {str(p.relative_to(REPO)): n for p in (REPO / "trainers").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_TRAINER_MODULE_LINES}
    assert long == {}, f"modules over {MAX_TRAINER_MODULE_LINES} lines: {long}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_cycles_are_found_and_named_whatever_the_import_form(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",                      # a -> b
        "pkg/b.py": "def f():\n    from .sub import c\n",        # b -> pkg.sub.c (relative,
        "pkg/sub/__init__.py": "",                               #   in a function)
        "pkg/sub/c.py": "import pkg.a as a\n",                   # c -> a: cycle a, b, c
        "pkg/d.py": "from pkg.e import thing\n",                 # d -> e
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from pkg import d\n",                   # annotations only: no edge
        "pkg/f.py": "import pkg.g\n",                            # f <-> g
        "pkg/g.py": "from . import f\n",
    })
    graph = import_graph(root, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.e"] == set() and graph["pkg.d"] == {"pkg.e"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"],
                             ["pkg.f", "pkg.g", "pkg.f"]]


def test_an_acyclic_tree_has_no_cycles(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n",
                            "pkg/a.py": "import os\nfrom pkg import b\n",
                            "pkg/b.py": "import numpy\n"})
    assert cycles(import_graph(root, ["pkg"])) == []


def test_trainer_packages_may_import_only_themselves_the_shared_layers_and_the_library(
        tmp_path):
    root = _tree(tmp_path, {
        "rlbuffers/__init__.py": "",
        "tools/__init__.py": "",
        "trainers/__init__.py": "",
        "trainers/flat.py": "from trainers.grpo import loss\n",  # flat: outside the rule
        "trainers/llm/__init__.py": "from trainers.common import seed\n",
        "trainers/common/__init__.py": "seed = 0\n",
        "trainers/erl/__init__.py": "from trainers.erl import loop\nfrom trainers import llm\n"
                                    "import rlbuffers\nimport numpy\n",
        "trainers/erl/loop.py": "from trainers.common import seed\n",
        "trainers/grpo/__init__.py": "def f():\n    from trainers.erl import loop\n",
        "trainers/grpo/loss.py": "import tools\nfrom trainers import flat\n",
        "trainers/common/bad.py": "from trainers.guidance import x\n",
        "trainers/guidance/__init__.py": "x = 1\n",
    })
    assert trainer_layering_violations(root) == [
        "trainers.common.bad -> trainers.guidance",
        "trainers.grpo -> trainers.erl.loop",
        "trainers.grpo.loss -> tools",
        "trainers.grpo.loss -> trainers.flat",
    ]
