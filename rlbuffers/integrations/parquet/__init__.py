"""Parquet both ways, in the tabular layout LeRobot v3 uses (the ``offline`` extra).

- :func:`to_parquet`: a buffer as ``data/chunk-NNN/file-NNN.parquet`` files of at most
  ~100 MB plus ``meta/info.json`` (fields, shapes, dtypes, episode offsets), which
  ``datasets.load_dataset("parquet", ...)`` reads (``rlbuffers export parquet``).
- :func:`from_parquet`: such an export back into a new buffer (``rlbuffers convert parquet``).

Modules: ``columns`` (fields as Arrow columns and back), ``export``, ``load``. Importing this
package without pyarrow raises an ImportError naming the extra.
"""

from __future__ import annotations

from rlbuffers.integrations import require

require("pyarrow", "offline")

from rlbuffers.integrations.parquet.export import to_parquet  # noqa: E402
from rlbuffers.integrations.parquet.load import from_parquet, read_info  # noqa: E402

__all__ = ["from_parquet", "read_info", "to_parquet"]
