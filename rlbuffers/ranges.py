"""The C helpers of sampling (``rlbuffers/_ranges.c``), where the package was built with its
optional extension, else ``None`` and their callers do the same in Python: many byte ranges of
a few buffers copied into one (the ragged gathers of ``rlbuffers/storage/ragged_column.py``),
the row views of packed values (:meth:`rlbuffers.packed.Packed.to_list`, the
``ragged="list"`` format), and the prefix-sum search of a sum tree
(:meth:`rlbuffers.sampling.segment_tree.SegmentTree.find_prefix`, prioritized draws).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    from rlbuffers._ranges import copy_ranges as _copy_ranges
    from rlbuffers._ranges import prefix_search as _prefix_search
    from rlbuffers._ranges import row_views as _row_views
except ImportError:  # installed without a C compiler: the Python paths
    _copy_ranges = _prefix_search = _row_views = None

#: ``copy_ranges(out, sources, source, starts, ends, dst, stops)``, or ``None`` where the C
#: extension is not built. For each ``i``: ``out[dst[i]:dst[i] + n] =
#: sources[source[i]][starts[i]:ends[i]]`` (``n = ends[i] - starts[i]`` bytes), then
#: ``out[dst[i] + n:stops[i]] = 0``. ``out``: a writable C-contiguous buffer (bytes) that may
#: not overlap a source that some row reads; ``sources``: a sequence of C-contiguous buffers;
#: the other five: int64[N]. Every index is checked before a byte is written (``ValueError``
#: naming the argument, the row, the expected range and the value; ``ValueError`` naming
#: ``out`` where it shares memory with such a source; ``TypeError`` for a buffer of the wrong
#: kind), and the copies run with the GIL released. The five vectors are copied once, with
#: the GIL held, and only that copy is checked and used: another thread that changes them
#: during the call cannot make it write outside ``out`` (it copies the values as they were).
copy_ranges: Callable[[Any, Sequence[Any], Any, Any, Any, Any, Any], None] | None = _copy_ranges

#: ``row_views(values, cu_seqlens)``, or ``None`` where the C extension is not built:
#: ``[values[cu_seqlens[i]:cu_seqlens[i + 1]] for i in range(N)]`` (``values`` an ndarray of
#: at least 1 dimension, ``cu_seqlens`` int64[N + 1], non-decreasing, in ``[0,
#: len(values)]``: else ``ValueError`` naming the first bad entry, before any view is made),
#: each view with ``values`` as its base, ~3x faster than slicing in Python.
row_views: Callable[[np.ndarray, np.ndarray], list[np.ndarray]] | None = _row_views

#: ``prefix_search(tree, first, mass, out)``, or ``None`` where the C extension is not built:
#: ``out[i]`` (int64[m]) = the leaf that
#: :meth:`~rlbuffers.sampling.segment_tree.SegmentTree.find_prefix`
#: finds for ``mass[i]`` (float64[m], each >= 0) in the sum tree ``tree`` (float64[2n], root
#: in (0, inf)), its running-sum step at the ``first`` nodes ``[first, 2 first)``; the same
#: floating-point operations in the same order as the numpy path, so the same leaves, each in
#: ``[0, n)``. ``ValueError`` (naming the argument) outside that domain, before anything is
#: written, and for a level ``[first, 2 first)`` whose running sum is NaN or <= 0 (not the
#: nodes of a sum tree of finite leaves >= 0; ``find_prefix`` then searches from the root).
prefix_search: Callable[[np.ndarray, int, np.ndarray, np.ndarray], None] | None = _prefix_search
