"""Benchmarks of SAM: its step against the base step, and its fused
perturbation kernel (time, and HBM traffic from the compilers)."""
