"""Pallas kernels for geom's methods, each beside its plain-jnp reference."""

from geom.kernels import sam_perturb

__all__ = ['sam_perturb']
