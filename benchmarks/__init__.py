"""Benchmarks: speed claims, each printing ratios against a baseline measured in the same run.

Run one with ``python -m benchmarks.<name>``, all with ``make bench``.
"""
