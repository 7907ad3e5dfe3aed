"""The ``rlbuffers`` command line: :mod:`~rlbuffers.cli.main` (parser, entry point, errors) and
one module per command (``inspect``, ``verify``, ``convert``, ``shards``), each importing
what it needs only when it runs."""

from rlbuffers.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
