"""Whole-buffer positional reads and writes on a file descriptor (``os.pwrite`` /
``os.preadv`` return after part of the bytes; these loop until all are done)."""

from __future__ import annotations

import os

import numpy as np


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at byte ``offset`` of ``fd`` (``os.pwrite`` until done)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` with the bytes at ``offset`` of ``fd`` (``os.preadv`` until done).

    Raises:
        OSError: the file ends first.
    """
    view = memoryview(out).cast("B")
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"short read at offset {offset}")
        view, offset = view[n:], offset + n
