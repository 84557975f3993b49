"""geom: optimization-geometry methods as Optax-style transformations.

Methods live one per module (see ../shared/design/ARCHITECTURE.md); this
package depends only on jax and optax, never on Flax, data or files.
"""
