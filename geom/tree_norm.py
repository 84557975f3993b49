"""The global L2 norm of a pytree in float32, safe from overflow and underflow.

A plain float32 sum of squares overflows to inf once |g| passes about 1e19
and underflows to 0 below about 1e-23, and SAM then divides by it: the
perturbation silently becomes 0 (or NaN) and the detector sees |g| = inf.
Here every element is first multiplied by a power of two 2^-k chosen from
the largest magnitude M (2^(k-1) <= M < 2^k), so the squares summed lie
in [0, 1]. Multiplying by a power of two is exact, and float32 rounding
commutes with it, so wherever the plain sum neither overflows nor
underflows the result is bit for bit the plain one (tested); outside that
range it stays finite and accurate. The price is one more reduction (the
maximum) over the tree. `geom.kernels.sam_perturb` computes the same norm
blockwise.
"""

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ['tree_norm_f32']

# 2^126 and 2^-126 are normal float32 numbers: the scale and its inverse
# stay representable for every M, subnormal M and M near float32's maximum
# included (there the squares lie in [0, 4] instead of [0, 1]).
_MAX_EXPONENT = 126


def tree_norm_f32(tree: Any) -> jax.Array:
  """sqrt(sum of squares) of every element of `tree`, in float32.

  Args:
    tree: a pytree of arrays of any float dtype (bfloat16 leaves are
      accumulated in float32); empty leaves and an empty tree give 0.

  Returns:
    A float32 scalar: inf or NaN only if an element is.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom.tree_norm import tree_norm_f32
    >>> float(tree_norm_f32({'a': jnp.array([3.0]),
    ...                      'b': jnp.array([4.0], jnp.bfloat16)}))
    5.0
    >>> float(tree_norm_f32([jnp.array([3e30, 4e30])]) / 1e30)  # No overflow.
    5.0
  """
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0.0)
                               for x in leaves]))
  _, exponent = jnp.frexp(largest)
  exponent = jnp.clip(exponent, -_MAX_EXPONENT, _MAX_EXPONENT)
  down = jnp.ldexp(jnp.float32(1.0), -exponent)
  total = sum(jnp.sum(jnp.square(x * down)) for x in leaves)
  return jnp.sqrt(total) * jnp.ldexp(jnp.float32(1.0), exponent)
