"""Benchmarks, by subject: sam/, curvature/, rl/, generation/, training/
(speed as ratios against a baseline run in the same process) and
compilation/ (the compilers' estimates for pods and GPU nodes). Each is a
main, `python -m bench.<subject>.<name>`, that writes its section of
BENCHMARKS.md through report.py."""
