"""Benchmarks of the curvature estimates: a Hessian-vector product
against a gradient."""
