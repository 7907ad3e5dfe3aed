"""The C helpers of ragged fields (``rlbuffers/_ranges.c``), where the package was built with
its optional extension, else ``None`` and their callers do the same in Python: many byte
ranges of a few buffers copied into one (the ragged gathers of
``rlbuffers/storage/ragged_column.py``) and the row views of packed values
(:meth:`rlbuffers.packed.Packed.to_list`, the ``ragged="list"`` format).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    from rlbuffers._ranges import copy_ranges as _copy_ranges
    from rlbuffers._ranges import row_views as _row_views
except ImportError:  # installed without a C compiler: the Python paths
    _copy_ranges = _row_views = None

#: ``copy_ranges(out, sources, source, starts, ends, dst, stops)``, or ``None`` where the C
#: extension is not built. For each ``i``: ``out[dst[i]:dst[i] + n] =
#: sources[source[i]][starts[i]:ends[i]]`` (``n = ends[i] - starts[i]`` bytes), then
#: ``out[dst[i] + n:stops[i]] = 0``. ``out``: a writable C-contiguous buffer (bytes);
#: ``sources``: a sequence of C-contiguous buffers; the other five: int64[N]. Every index is
#: checked before a byte is written (``ValueError`` naming the argument, the row, the expected
#: range and the value; ``TypeError`` for a buffer of the wrong kind), and the copies run with
#: the GIL released.
copy_ranges: Callable[[Any, Sequence[Any], Any, Any, Any, Any, Any], None] | None = _copy_ranges

#: ``row_views(values, cu_seqlens)``, or ``None`` where the C extension is not built:
#: ``[values[cu_seqlens[i]:cu_seqlens[i + 1]] for i in range(N)]`` (``values`` an ndarray of
#: at least 1 dimension, ``cu_seqlens`` int64[N + 1], non-decreasing, in ``[0,
#: len(values)]``: else ``ValueError`` naming the first bad entry, before any view is made),
#: each view with ``values`` as its base, ~3x faster than slicing in Python.
row_views: Callable[[np.ndarray, np.ndarray], list[np.ndarray]] | None = _row_views
