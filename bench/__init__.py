"""Benchmarks: they print ratios measured side by side in one run; never run as tests."""
