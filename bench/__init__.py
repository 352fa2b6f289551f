"""Benchmarks: measured side by side in one run, reported as medians and spreads. Not tests."""
