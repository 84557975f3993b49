"""Two-dimensional objectives on which SAM's behaviour can be seen exactly.

`valley_with_bump` is a curved valley y = 0.3 x^2 (one global minimum) with
a Gaussian bump on its upper wall (a local maximum and a saddle beside it).
From the start (0, 1) with learning rate 0.01, SAM with rho in [0.5, 1.2]
converges to a *hallucinated minimizer* (Park et al., arXiv 2509.21818): a
point x* with |grad f(x*)| between 1.8 and 4.1 where the perturbed point
x* + rho grad f / |grad f| sits on the saddle, so grad f(x+) = 0 and SAM
stops. Plain gradient descent from the same start, or 50 plain steps before
SAM, reaches the valley's minimum instead.

Measured here (float32 and float64, lr 0.005 to 0.02, starts within 0.05 of
(0, 1)): the same interval of rho, the same x*, and x+ on the saddle to
1e-15 in float64. One difference from the paper's picture: x+ lands on the
saddle, not on the bump's top; the top is a repelling fixed point for
SAM's map on this landscape, while the saddle attracts (spectral radius of
the SAM map's Jacobian 0.95-0.97 at lr 0.01).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['CRITICAL_POINTS', 'CriticalPoint', 'MIN_VALUE', 'START', 'grid',
           'valley_with_bump']


class CriticalPoint(NamedTuple):
  """A critical point of `valley_with_bump`: its kind, place and value.

  Example:

    >>> from geom import landscapes
    >>> saddle = landscapes.CRITICAL_POINTS[2]
    >>> saddle.kind, saddle.x, saddle.y
    ('saddle', 0.28521, 1.44471)
  """
  kind: str
  x: float
  y: float
  value: float


# valley: A (y - B x^2)^2 + C x^2; bump: H exp(-|p - (PX, PY)|^2 / (2 S^2)).
_A, _B, _C, _H, _PX, _PY, _S = 1.0, 0.3, 0.2, 2.0, 0.35, 0.95, 0.4
#: The start from which SAM with rho in [0.5, 1.2] stalls at a hallucinated
#: minimizer (learning rate 0.01).
START = (0.0, 1.0)
#: The minimum, the maximum and the saddle of `valley_with_bump`, found with
#: Newton's method from a 61 x 61 grid (the only three).
CRITICAL_POINTS = (
    CriticalPoint('minimum', -0.19012, -0.08206, 0.044668),
    CriticalPoint('maximum', 0.32199, 1.15602, 3.033448),
    CriticalPoint('saddle', 0.28521, 1.44471, 2.952257),
)
#: The global minimum's value.
MIN_VALUE = CRITICAL_POINTS[0].value


def valley_with_bump(p: jax.Array) -> jax.Array:
  """f(p) for p = (x, y); works on any float dtype.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import landscapes
    >>> minimum = landscapes.CRITICAL_POINTS[0]
    >>> p = jnp.array([minimum.x, minimum.y])
    >>> round(float(landscapes.valley_with_bump(p)), 4)
    0.0447
    >>> float(jnp.abs(jax.grad(landscapes.valley_with_bump)(p)).max()) < 1e-4
    True
  """
  x, y = p[..., 0], p[..., 1]
  return (_A * (y - _B * x ** 2) ** 2 + _C * x ** 2
          + _H * jnp.exp(-((x - _PX) ** 2 + (y - _PY) ** 2) / (2 * _S ** 2)))


def grid(xlim=(-1.2, 1.4), ylim=(-0.6, 2.0), n=241):
  """(X, Y, f(X, Y)) on a grid, for contour plots.

  Example:

    >>> from geom import landscapes
    >>> X, Y, Z = landscapes.grid(n=5)
    >>> X.shape, Z.shape
    ((5, 5), (5, 5))
    >>> bool(Z.min() >= landscapes.MIN_VALUE)
    True
  """
  xs, ys = np.linspace(*xlim, n), np.linspace(*ylim, n)
  X, Y = np.meshgrid(xs, ys)
  return X, Y, np.asarray(valley_with_bump(jnp.stack([X, Y], -1)))
