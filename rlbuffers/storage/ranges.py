"""Many byte ranges of a few buffers copied into one: the copy of the ragged gathers
(``rlbuffers/storage/ragged_column.py``), in C (``rlbuffers/_ranges.c``) where the package was
built with its optional extension, else ``None`` and the gathers join the ranges in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    from rlbuffers._ranges import copy_ranges as _compiled
except ImportError:  # installed without a C compiler: the Python path of the gathers
    _compiled = None

#: ``copy_ranges(out, sources, source, starts, ends, dst, stops)``, or ``None`` where the C
#: extension is not built. For each ``i``: ``out[dst[i]:dst[i] + n] =
#: sources[source[i]][starts[i]:ends[i]]`` (``n = ends[i] - starts[i]`` bytes), then
#: ``out[dst[i] + n:stops[i]] = 0``. ``out``: a writable C-contiguous buffer (bytes);
#: ``sources``: a sequence of C-contiguous buffers; the other five: int64[N]. Every index is
#: checked before a byte is written (``ValueError`` naming the argument, the row, the expected
#: range and the value; ``TypeError`` for a buffer of the wrong kind), and the copies run with
#: the GIL released.
copy_ranges: Callable[[Any, Sequence[Any], Any, Any, Any, Any, Any], None] | None = _compiled
