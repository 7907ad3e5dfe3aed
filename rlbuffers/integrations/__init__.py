"""Integrations of rlbuffers with other RL libraries.

- :mod:`rlbuffers.integrations.sb3`: drop-in Stable-Baselines3 / CleanRL replay buffers whose
  transitions live in an rlbuffers buffer on disk (the ``sb3`` extra).

Each integration imports its library when it is imported, and raises an ``ImportError`` that
names the extra to install when the library is missing; ``import rlbuffers`` imports none.
"""

from __future__ import annotations

import importlib


def require(module: str, extra: str) -> None:
    """Import ``module`` or raise an ImportError naming the rlbuffers ``extra`` that installs it.

    Raises:
        ImportError: ``module`` cannot be imported.
    """
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this rlbuffers integration needs {module!r}, which is not installed ({e}); "
            f"install it with: pip install 'rlbuffers[{extra}]'") from e
