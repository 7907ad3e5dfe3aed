"""The optional C extension ``rlbuffers._ranges`` (``rlbuffers/_ranges.c``: the ragged gathers'
byte-range copy, the list format's row views and the prioritized sum-tree search;
``rlbuffers/ranges.py``). Everything else of
the package is in ``pyproject.toml``; this file exists because the extension's include path
comes from numpy. ``optional=True``: without a C compiler (or numpy's headers) the install
still succeeds and ``rlbuffers.ranges`` falls back to Python."""

from setuptools import Extension, setup


def extensions() -> list[Extension]:
    try:
        import numpy
    except ImportError:  # a build without numpy (e.g. --no-build-isolation): no extension
        return []
    return [Extension("rlbuffers._ranges", ["rlbuffers/_ranges.c"],
                      include_dirs=[numpy.get_include()], optional=True)]


setup(ext_modules=extensions())
