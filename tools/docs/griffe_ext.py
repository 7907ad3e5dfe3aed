"""Griffe extensions for the API reference (mkdocs.yml).

- :class:`LazyNames`: the names a package imports on first use (PEP 562,
  ``rlbuffers.lazy.lazy_attributes`` over a module-level ``_LAZY`` dict of
  ``{public name: module path}``) become aliases of that package, so the reference names them
  by their public path (``rlbuffers.stream.StreamLoader``) whatever module defines them.
  Griffe reads source statically and cannot see those names; this imports each package that
  has a ``_LAZY`` (cheap: that is the point of lazy names) and reads the dict that
  ``__getattr__`` uses at run time, so the reference and the import cannot disagree.
- :class:`SphinxRoles`: the docstrings' Sphinx roles (``:class:`Sampler```,
  ``:meth:`~Checkpoints.write```) become cross-references (a link where the target is in
  the reference, its name in code otherwise) instead of showing the role as text.
- :class:`QuietDocstrings`: parses the docstrings of the listed source files without
  griffe's warnings, so ``mkdocs build --strict`` passes while their owners fix them. Every
  listed file must exist (a moved file fails the build: fix its entry); the list is meant to
  shrink to nothing.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import griffe

_ROOT = Path(__file__).resolve().parents[2]
#: ``:role:`target``` or ``:py:role:`~target```
_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):`(~?)\.?([^`]+)`")


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


def _canonical(obj: griffe.Object | griffe.Alias) -> str:
    try:
        return obj.final_target.path if isinstance(obj, griffe.Alias) else obj.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return obj.target_path if isinstance(obj, griffe.Alias) else obj.path


def _lookup(scope: griffe.Object, dotted: str) -> griffe.Object | griffe.Alias | None:
    obj: griffe.Object | griffe.Alias = scope
    for part in dotted.split("."):
        try:
            obj = obj.members[part]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return obj


def _resolve(obj: griffe.Object, target: str) -> str:
    """The canonical path ``target`` names where ``obj``'s docstring says it (its own members,
    then each enclosing scope's, then the package's), else ``target`` itself."""
    scope: griffe.Object | None = obj
    while scope is not None:
        if (found := _lookup(scope, target)) is not None:
            return _canonical(found)
        scope = scope.parent
    root = obj.package
    head, _, rest = target.partition(".")
    if head == root.name and rest and (found := _lookup(root, rest)) is not None:
        return _canonical(found)
    return target


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's Sphinx roles as optional autorefs cross-references."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            for obj in _objects(module):
                doc = obj.docstring
                if doc is None or ":`" not in doc.value:
                    continue

                def ref(match: re.Match[str], obj: griffe.Object = obj) -> str:
                    short, target = match[1], match[2]
                    shown = target.rpartition(".")[2] if short else target
                    return (f'<autoref identifier="{_resolve(obj, target)}" optional>'
                            f"<code>{shown}</code></autoref>")

                doc.value = _ROLE.sub(ref, doc.value)
