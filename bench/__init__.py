"""Benchmarks: speed as ratios against a baseline run in the same process."""
