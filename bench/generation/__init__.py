"""Benchmarks of generation: steered against unsteered, on the steering
LM and on Gemma 3."""
