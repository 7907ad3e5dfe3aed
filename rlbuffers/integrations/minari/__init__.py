"""Minari offline datasets both ways (the ``offline`` extra: ``pip install 'rlbuffers[offline]'``).

- :func:`from_minari`: a Minari dataset (a local id or a directory) as a new buffer, episode by
  episode (``rlbuffers convert minari``).
- :func:`to_minari`: a buffer's episodes as a new local Minari dataset that
  ``minari.load_dataset`` reads (``rlbuffers export minari``).

Modules: ``convert`` (from Minari), ``export`` (to Minari), ``spaces`` (Dict / Tuple values as
dotted fields and back). Importing this package without minari raises an ImportError naming
the extra.
"""

from __future__ import annotations

from rlbuffers.integrations import require

require("minari", "offline")

from rlbuffers.integrations.minari.convert import from_minari, open_dataset  # noqa: E402
from rlbuffers.integrations.minari.export import MinariExport, to_minari  # noqa: E402

__all__ = ["MinariExport", "from_minari", "open_dataset", "to_minari"]
