"""Benchmarks: not part of the test suite."""
