"""Fuzzers of the input rlbuffers reads from disk (``python -m tools.fuzz.<name>
--minutes N``)."""
