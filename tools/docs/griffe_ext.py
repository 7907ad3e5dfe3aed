"""Griffe extensions for the API reference (mkdocs.yml).

- :class:`LazyNames`: the names a package imports on first use (PEP 562,
  ``rlbuffers.lazy.lazy_attributes`` over a module-level ``_LAZY`` dict of
  ``{public name: module path}``) become aliases of that package, so the reference names them
  by their public path (``rlbuffers.stream.StreamLoader``) whatever module defines them.
  Griffe reads source statically and cannot see those names; this imports each package that
  has a ``_LAZY`` (cheap: that is the point of lazy names) and reads the dict that
  ``__getattr__`` uses at run time, so the reference and the import cannot disagree.
- :class:`QuietDocstrings`: parses the docstrings of the listed source files without
  griffe's warnings, so ``mkdocs build --strict`` passes while their owners fix them. Every
  listed file must exist (a moved file fails the build: fix its entry); the list is meant to
  shrink to nothing.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import griffe

_ROOT = Path(__file__).resolve().parents[2]


def _modules(module: griffe.Module) -> list[griffe.Module]:
    out = [module]
    for member in module.modules.values():
        if isinstance(member, griffe.Module):   # not an alias: a submodule
            out.extend(_modules(member))
    return out


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    out = [obj]
    for member in obj.members.values():
        if isinstance(member, griffe.Object):   # not an alias: defined here
            out.extend(_objects(member))
    return out


class LazyNames(griffe.Extension):
    """Adds an alias per ``_LAZY`` entry of every module of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            if "_LAZY" not in module.members:
                continue
            lazy = importlib.import_module(module.path)._LAZY
            for name, target in lazy.items():
                if name not in module.members:
                    module.set_member(name, griffe.Alias(name, f"{target}.{name}"))


class QuietDocstrings(griffe.Extension):
    """Parses every docstring of ``files`` (paths from the repository root) with warnings off.

    The parse is cached on the docstring, so it holds whatever options mkdocstrings sets later.
    """

    def __init__(self, files: list[str]) -> None:
        missing = [f for f in files if not (_ROOT / f).is_file()]
        if missing:
            raise FileNotFoundError(f"QuietDocstrings (mkdocs.yml): no such file {missing}")
        self.files = {(_ROOT / f).resolve() for f in files}

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            if not isinstance(module.filepath, Path) or module.filepath.resolve() not in self.files:
                continue
            for obj in _objects(module):
                doc = obj.docstring
                if doc is not None and doc.parser is not None:
                    options = {**doc.parser_options, "warnings": False}
                    doc.__dict__["parsed"] = doc.parse(doc.parser, **options)
