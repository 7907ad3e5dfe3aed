"""Fuzzers of the input rlbuffers reads from disk: ``python -m tools.fuzz.NAME --minutes 10``
(NAME: ``fuzz_pickle``, ``fuzz_tar``, ``fuzz_stream_state``, ``manifest``) runs one property
for that long and prints the inputs tried and the findings. The same properties run for a
bounded number of examples in ``tests/test_fuzz.py`` and ``tests/test_manifest_fuzz.py``."""
