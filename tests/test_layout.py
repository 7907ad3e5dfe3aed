"""The library's house: rooms (concept folders, each saying what it holds; few modules left
directly in ``rlbuffers/``), sizes (``buffer.py`` a thin face; no long module), arrows that
point down only (the library never imports its consumers; ``stream``, ``memory`` and
``sampling`` import no storage; storage imports no buffer, sampler or command), and a wheel
that claims only the ``rlbuffers`` name. Import cycles: ``tests/test_import_graph.py``.
The intended layering is written in ``docs/internals.md`` ("Layout")."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_import_graph import import_graph

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "rlbuffers"
#: Most modules directly in rlbuffers/ (``__init__.py`` not counted).
MAX_TOP_LEVEL_MODULES = 16
MAX_BUFFER_LINES = 300
MAX_MODULE_LINES = 450

#: importer package -> project packages it must not import (prefix match on module names).
FORBIDDEN = {
    "rlbuffers": ["trainers", "tools", "tests"],
    "rlbuffers.stream": ["rlbuffers.storage", "rlbuffers.buffer", "rlbuffers.core",
                         "rlbuffers.sampling", "rlbuffers.cli", "rlbuffers.integrations"],
    "rlbuffers.memory": ["rlbuffers.storage", "rlbuffers.buffer", "rlbuffers.core",
                         "rlbuffers.sampling", "rlbuffers.stream", "rlbuffers.cli",
                         "rlbuffers.integrations"],
    "rlbuffers.sampling": ["rlbuffers.storage", "rlbuffers.buffer", "rlbuffers.core",
                           "rlbuffers.stream", "rlbuffers.memory", "rlbuffers.cli",
                           "rlbuffers.integrations", "rlbuffers.maintenance"],
    "rlbuffers.storage": ["rlbuffers.buffer", "rlbuffers.core", "rlbuffers.sampling",
                          "rlbuffers.maintenance", "rlbuffers.cli", "rlbuffers.integrations",
                          "rlbuffers.rollouts", "rlbuffers.stream"],
    "rlbuffers.core": ["rlbuffers.cli", "rlbuffers.integrations", "rlbuffers.maintenance"],
    "rlbuffers.buffer": ["rlbuffers.cli", "rlbuffers.integrations", "rlbuffers.maintenance"],
    "rlbuffers.maintenance": ["rlbuffers.cli", "rlbuffers.integrations"],
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for every import that :data:`FORBIDDEN` rules out."""
    bad = []
    for importer, imported in sorted(graph.items()):
        for package, banned in FORBIDDEN.items():
            if not _within(importer, package):
                continue
            bad += [f"{importer} -> {t}" for t in sorted(imported)
                    if any(_within(t, b) for b in banned)]
    return bad


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_few_modules_directly_in_the_package_and_every_folder_says_what_it_holds():
    top = sorted(p.name for p in LIB.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules in rlbuffers/: {top}"
    folders = sorted(p.parent for p in LIB.rglob("__init__.py"))
    assert {LIB / n for n in ("sampling", "storage", "cli", "core", "stream", "memory",
                              "integrations", "integrations/sb3")} <= set(folders)
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 5, f"{folder.relative_to(REPO)}: no docstring"
    loose = [p for p in LIB.rglob("*.py") if p.parent not in folders and p.parent != LIB]
    assert loose == [], f"modules in a folder without __init__.py: {loose}"


def test_buffer_is_a_thin_face_and_no_module_is_long():
    assert _lines(LIB / "buffer.py") <= MAX_BUFFER_LINES
    long = {str(p.relative_to(REPO)): n for root in ("rlbuffers", "trainers")
            for p in (REPO / root).rglob("*.py") if (n := _lines(p)) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_arrows_point_down_only():
    graph = import_graph(REPO, ["rlbuffers", "tools", "trainers", "tests"])
    assert upward_imports({m: t for m, t in graph.items() if _within(m, "rlbuffers")}) == []


def test_upward_imports_are_found(tmp_path):
    """The rule finds what it forbids, in any import form (the check is not vacuous)."""
    files = {"rlbuffers/__init__.py": "", "rlbuffers/storage/__init__.py": "",
             "rlbuffers/storage/a.py": "def f():\n    from rlbuffers.sampling import s\n",
             "rlbuffers/sampling/__init__.py": "", "rlbuffers/sampling/s.py": "",
             "rlbuffers/cli.py": "import trainers.plot\n",
             "trainers/__init__.py": "", "trainers/plot.py": ""}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, ["rlbuffers", "trainers"])
    assert upward_imports(graph) == ["rlbuffers.cli -> trainers.plot",
                                     "rlbuffers.storage.a -> rlbuffers.sampling.s"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel .`` builds from this checkout's tracked files, copied elsewhere
    (offline: the build requirements, setuptools and numpy, are those installed)."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):  # the checkout's files, built away from it (no build/)
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "--no-cache-dir", "-q", "-w", str(out),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("rlbuffers-*.whl")
    return whl


def test_the_wheel_claims_only_the_rlbuffers_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"rlbuffers"}, sorted(top)
    assert "rlbuffers/buffer.py" in names and "rlbuffers/cli/main.py" in names
    assert not any(n.startswith(("trainers/", "tests/", "tools/")) for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "rlbuffers = rlbuffers.cli:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()
