"""Pallas kernels for geom's methods, each beside its plain-jnp reference."""
