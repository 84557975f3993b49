"""Compilation for targets (TPU slices, GPU nodes) from any host: the
targets, and a compiled program's memory and HBM traffic per chip."""
