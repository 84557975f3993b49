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
  """A critical point of `valley_with_bump`: its kind, place and value."""
  kind: str
  x: float
  y: float
  value: float


# valley: A (y - B x^2)^2 + C x^2; bump: H exp(-|p - (PX, PY)|^2 / (2 S^2)).
A, B, C, H, PX, PY, S = 1.0, 0.3, 0.2, 2.0, 0.35, 0.95, 0.4
START = (0.0, 1.0)
# Found with Newton's method from a 61 x 61 grid (the only three).
CRITICAL_POINTS = (
    CriticalPoint('minimum', -0.19012, -0.08206, 0.044668),
    CriticalPoint('maximum', 0.32199, 1.15602, 3.033448),
    CriticalPoint('saddle', 0.28521, 1.44471, 2.952257),
)
MIN_VALUE = CRITICAL_POINTS[0].value


def valley_with_bump(p: jax.Array) -> jax.Array:
  """f(p) for p = (x, y); works on any float dtype."""
  x, y = p[..., 0], p[..., 1]
  return (A * (y - B * x ** 2) ** 2 + C * x ** 2
          + H * jnp.exp(-((x - PX) ** 2 + (y - PY) ** 2) / (2 * S ** 2)))


def grid(xlim=(-1.2, 1.4), ylim=(-0.6, 2.0), n=241):
  """(X, Y, f(X, Y)) on a grid, for contour plots."""
  xs, ys = np.linspace(*xlim, n), np.linspace(*ylim, n)
  X, Y = np.meshgrid(xs, ys)
  return X, Y, np.asarray(valley_with_bump(jnp.stack([X, Y], -1)))
