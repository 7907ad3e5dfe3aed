"""Names of a package imported on first use (PEP 562), so importing the package (or a light
submodule such as the command line) does not import zarr, numpy or torch up front."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` (a module path)
    on first access of ``name`` and keeps the value in the package.

    Raises (from the returned function):
        AttributeError: ``name`` is not in ``names``.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
