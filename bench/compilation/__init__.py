"""Compiler estimates (not timings) of the pod-scale jobs, written to
BENCHMARKS.md."""
