"""Fuzzers of issue 32: ``python -m tools.fuzz.NAME --minutes 10`` (NAME: ``fuzz_pickle``,
``fuzz_tar``, ``fuzz_stream_state``) runs one property for that long in a worker process
under an address-space limit and prints the inputs tried and the findings. The same
properties run for a bounded number of examples in ``tests/test_fuzz.py``."""
