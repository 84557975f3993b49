"""Spherical steering of activations, with addition baselines behind one interface.

Spherical steering (chili-lab/Spherical-Steering) moves a hidden state x
along the great circle from its direction x/|x| toward a unit target mu,
keeping |x|::

    c      = <x/|x|, mu>,   theta = angle(x, mu)
    t      = fraction of the way to rotate (see the gate below)
    x'     = |x| (cos((1 - t) theta) mu + sin((1 - t) theta) u),
    u      = (x/|x| - c mu) / |x/|x| - c mu|

which is slerp(x/|x|, mu; t) scaled by |x|: t = 0 is the identity, t = 1
lands on mu. The gate is a von Mises-Fisher comparison of x against the
target and its antipode: softmax([kappa c, -kappa c]) gives p_T, p_H and
delta = p_H - p_T = -tanh(kappa c). A token is steered only when
delta > beta, by t = clip(alpha (delta - beta) / (1 - beta), 0, 1): tokens
already on the target's side are left alone. Without the gate every token
rotates by t = alpha.

Addition (ActAdd / CAA): x' = x + alpha * coefficient * mu, optionally
renormalised to |x| (repeng's option). `coefficient` sets the scale of
alpha, e.g. the mean activation norm at the layer, so that alpha in [0, 1]
means comparable strengths for every method. Addition can take the same
gate (`gate=True`): x' = x + t * coefficient * mu with t from the gate, so
that the gate and the geometry can be ablated separately (gate on/off x
rotation/addition). By default the rotation is gated and addition is not.

Computed in float32 and cast back to the input dtype; tokens outside `mask`
and tokens the gate leaves alone come back bit for bit. How the rotation
stays exact from theta = 0 to theta = pi: docs/methods/steering.md.

Which parts are the reference's: the rotation, the vMF gate with kappa,
alpha, beta. Ours: the gate on addition (for the ablation), the
theta-near-pi plane, the rotation of tokens within
1e-4 of the target (the reference leaves them as they are), the exact
pass-through of ungated tokens, the uncentred PCA (below) and the trigger
statistics.

Example:

  >>> import jax.numpy as jnp
  >>> from geom import steering
  >>> mu = jnp.array([1.0, 0.0, 0.0])
  >>> s = steering.Steering(method='spherical', direction=mu, alpha=1.0,
  ...                       gate=False)
  >>> x = jnp.array([[[0.0, 2.0, 0.0]]])
  >>> y, stats = s(x)
  >>> [round(float(v), 4) for v in y[0, 0]]
  [2.0, 0.0, 0.0]

References:
  Spherical Steering: geodesic activation steering with a confidence gate
    (2026), code: github.com/chili-lab/Spherical-Steering.
  Turner et al., Activation Addition (ActAdd), arXiv 2308.10248.
  Rimsky et al., Steering Llama 2 via Contrastive Activation Addition
    (CAA), arXiv 2312.06681.
  Vogel, repeng (representation engineering), github.com/vgel/repeng.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from geom import validation

__all__ = ['DIRECTION_METHODS', 'METHODS', 'SteerStats', 'Steering',
           'check_direction', 'extract_direction', 'gate', 'mean_difference',
           'pca_direction', 'slerp_rotate', 'unit']

_STEERING = 'geom.steering.Steering'
_EXTRACT = 'geom.steering.extract_direction'

#: The methods of `Steering`.
METHODS = ('none', 'addition', 'spherical')
#: The methods of `extract_direction`.
DIRECTION_METHODS = ('mean_diff', 'pca')

# Floor for the norms divided by in the gate and in addition's rescaling.
_MIN_NORM = 1e-12
# |x_hat - c mu| below this many eps of the compute dtype is rounding noise
# (for x = -|x| mu it measures under 0.6 eps): slerp_rotate then uses a fixed
# plane. Above it the measured plane is used, orthogonal to mu however noisy.
_PLANE_NOISE = 4


def check_direction(direction, name: str = 'direction',
                    owner: str = 'geom.steering.Steering') -> np.ndarray:
  """The direction as float32 numpy after checking it is usable (a vector,
  finite, non-zero); raises ArgumentError naming `name` otherwise.

  Example:

    >>> import numpy as np
    >>> from geom import steering
    >>> steering.check_direction([3.0, 4.0]).dtype
    dtype('float32')
    >>> try:
    ...   steering.check_direction(np.zeros(3))
    ... except ValueError as e:   # geom.ArgumentError
    ...   print(e.argument, '|', e.problem)
    direction | is zero; a steering direction needs a non-zero vector
  """
  d = np.asarray(direction, np.float32)
  problem = None
  if d.ndim != 1 or d.size == 0:
    problem = f'must be a non-empty vector, got shape {d.shape}'
  elif not np.all(np.isfinite(d)):
    problem = 'has non-finite entries'
  elif not np.linalg.norm(d.astype(np.float64)) > 0:
    problem = 'is zero; a steering direction needs a non-zero vector'
  if problem:
    raise validation.ArgumentError(owner, name, problem)
  return d


def unit(direction) -> jax.Array:
  """direction / |direction| in float32.

  Example:

    >>> from geom import steering
    >>> steering.unit([3.0, 4.0]).tolist()
    [0.6000000238418579, 0.800000011920929]
  """
  d = jnp.asarray(direction, jnp.float32)
  return d / jnp.linalg.norm(d)


def mean_difference(positive, negative) -> jax.Array:
  """normalize(mean(positive) - mean(negative)); inputs are (n, dim) activations.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> positive = jnp.array([[2.0, 1.0], [2.0, -1.0]])
    >>> negative = jnp.array([[0.0, 1.0], [0.0, -1.0]])
    >>> steering.mean_difference(positive, negative).tolist()
    [1.0, 0.0]
  """
  positive = jnp.asarray(positive, jnp.float32)
  negative = jnp.asarray(negative, jnp.float32)
  if positive.ndim != 2 or negative.shape[1:] != positive.shape[1:]:
    raise validation.ArgumentError(
        _EXTRACT, 'positive, negative', f'shapes {positive.shape} and '
        f'{negative.shape}: need (n, dim) arrays of one dim')
  diff = positive.mean(0) - negative.mean(0)
  check_direction(diff, 'mean difference of positive and negative', _EXTRACT)
  return unit(diff)


def pca_direction(positive, negative) -> jax.Array:
  """First principal direction of the paired differences positive[i] - negative[i].

  Uncentred (the top right-singular vector of the difference matrix): the
  differences share their mean, which is the concept itself, and
  centring would remove it. The sign is chosen so that the mean difference
  projects positively.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> positive = jnp.array([[2.0, 1.0], [3.0, -1.0]])
    >>> negative = jnp.array([[0.0, 1.0], [0.0, -1.0]])
    >>> [round(float(v), 4) for v in steering.pca_direction(positive, negative)]
    [1.0, 0.0]
  """
  positive = jnp.asarray(positive, jnp.float32)
  negative = jnp.asarray(negative, jnp.float32)
  if positive.shape != negative.shape or positive.ndim != 2:
    raise validation.ArgumentError(
        _EXTRACT, 'positive, negative', f'shapes {positive.shape} and '
        f'{negative.shape}: pca needs paired (n, dim) arrays')
  diffs = positive - negative
  check_direction(diffs.mean(0), 'mean of the paired differences', _EXTRACT)
  _, _, vt = jnp.linalg.svd(diffs, full_matrices=False)
  top = vt[0]
  return unit(jnp.where(jnp.dot(top, diffs.mean(0)) < 0, -top, top))


def extract_direction(positive, negative, method: str = 'mean_diff') -> jax.Array:
  """A unit direction from contrastive activations: 'mean_diff' or 'pca'.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> positive = jnp.array([[2.0, 1.0], [2.0, -1.0]])
    >>> negative = jnp.array([[0.0, 1.0], [0.0, -1.0]])
    >>> steering.extract_direction(positive, negative, 'mean_diff').tolist()
    [1.0, 0.0]
  """
  validation.check_choice(_EXTRACT, 'method', method, DIRECTION_METHODS,
                          'unknown direction method')
  if method == 'mean_diff':
    return mean_difference(positive, negative)
  return pca_direction(positive, negative)


def gate(cos: jax.Array, *, alpha, kappa, beta) -> tuple[jax.Array, jax.Array]:
  """The vMF gate: (delta, t) with delta = -tanh(kappa cos) and the fraction t.

  delta is p_H - p_T of softmax([kappa cos, -kappa cos]); t = 0 where
  delta <= beta, else clip(alpha (delta - beta) / (1 - beta), 0, 1).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> cos = jnp.array([-1.0, 0.0, 1.0])   # Away from, across, on the target.
    >>> delta, t = steering.gate(cos, alpha=0.5, kappa=20.0, beta=0.0)
    >>> [round(float(v), 4) for v in t]
    [0.5, 0.0, 0.0]
  """
  delta = -jnp.tanh(kappa * cos)
  t = jnp.clip(alpha * (delta - beta) / (1.0 - beta), 0.0, 1.0)
  return delta, jnp.where(delta > beta, t, 0.0)


def _orthogonal_unit(mu: jax.Array) -> jax.Array:
  """A fixed unit vector orthogonal to mu (Gram-Schmidt of mu's smallest axis)."""
  e = jax.nn.one_hot(jnp.argmin(jnp.abs(mu)), mu.shape[-1], dtype=mu.dtype)
  v = e - jnp.dot(e, mu) * mu
  return v / jnp.linalg.norm(v)


def _safe_norm(v: jax.Array) -> jax.Array:
  """|v| over the last axis (keepdims), 0 at v = 0 with a zero gradient there."""
  sq = jnp.sum(v * v, axis=-1, keepdims=True)
  positive = sq > 0
  # The inner where keeps sqrt's infinite slope at 0 out of the gradient.
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def slerp_rotate(x: jax.Array, mu: jax.Array, t: jax.Array) -> jax.Array:
  """x rotated by fraction t of its angle toward unit mu, norm kept.

  The exact slerp for every angle, theta = 0 included (no pass-through
  below a threshold). The rotation plane is spanned by mu and the part of
  x orthogonal to it; that part is projected off mu twice, because near
  theta = pi one subtraction leaves rounding noise that lies mostly along
  mu and would tilt the plane (and so change the norm and the angle).
  Where that part is below `_PLANE_NOISE` eps of the compute dtype, x is
  antiparallel to mu to working precision, the plane is only noise and a
  fixed one orthogonal to mu is used: the norm and the angle to mu, which
  are all the exact answer fixes there, come out right either way.

  Accuracy in float32 against a float64 slerp (tests/test_steering.py):
  the norm and the angle to mu to a few eps at every angle; the vector to
  a few eps |x| except near theta = pi, where the plane is ill-conditioned
  and the error grows as eps / (pi - theta) |x| (measured: 4e-4 |x| at
  pi - 1e-4), the plane's own uncertainty given x in float32.

  Args:
    x: (..., dim) activations, any float dtype.
    mu: (dim,) unit target direction.
    t: rotation fraction, broadcasting against x[..., 0]; 0 keeps x's
      direction, 1 lands on mu.

  Returns:
    The rotated activations in x's dtype promoted to at least float32.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> mu = jnp.array([1.0, 0.0])
    >>> x = jnp.array([0.0, 2.0])   # 90 degrees from mu, norm 2.
    >>> [round(float(v), 4) for v in steering.slerp_rotate(x, mu, 0.5)]
    [1.4142, 1.4142]
    >>> [round(float(v), 4) for v in steering.slerp_rotate(x, mu, 1.0)]
    [2.0, 0.0]
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(dtype)
  mu = mu.astype(dtype)
  norm = _safe_norm(x)
  x_hat = x / jnp.where(norm > 0, norm, 1.0)
  c = jnp.sum(x_hat * mu, axis=-1, keepdims=True)
  perp = x_hat - c * mu
  # Second projection (see the docstring); c absorbs what it removes.
  residual = jnp.sum(perp * mu, axis=-1, keepdims=True)
  perp = perp - residual * mu
  c = c + residual
  sin = _safe_norm(perp)
  # x = 0 comes back 0 whatever theta is; theta = 0 keeps atan2's gradient
  # at (0, 0) out of it.
  theta = jnp.arctan2(sin, jnp.where(norm > 0, c, 1.0))
  in_plane = sin > _PLANE_NOISE * jnp.finfo(dtype).eps
  u = jnp.where(in_plane, perp / jnp.where(in_plane, sin, 1.0),
                _orthogonal_unit(mu))
  new_theta = (1.0 - jnp.asarray(t, dtype)[..., None]) * theta
  return norm * (jnp.cos(new_theta) * mu + jnp.sin(new_theta) * u)


class SteerStats(NamedTuple):
  """Sums over the steered tokens of one call; add them across calls.

  Attributes:
    tokens: tokens in the mask.
    triggered: tokens that were changed (t > 0; without the gate, every
      masked token when alpha > 0).
    t_sum: sum of the strength t applied (the rotation fraction, or the
      multiplier of the addition; alpha everywhere without the gate).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> s = steering.Steering('spherical', jnp.array([1.0, 0.0]), alpha=1.0)
    >>> x = jnp.array([[-1.0, 0.1], [1.0, 0.1]])   # One token away, one near.
    >>> _, stats = s(x)
    >>> float(stats.tokens), float(stats.triggered), float(stats.trigger_rate)
    (2.0, 1.0, 0.5)
  """
  tokens: jax.Array
  triggered: jax.Array
  t_sum: jax.Array

  @property
  def trigger_rate(self) -> jax.Array:
    """The fraction of masked tokens that were changed."""
    return self.triggered / jnp.maximum(self.tokens, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Steering:
  """One steering operator, applied as `steering(x, mask) -> (x', SteerStats)`.

  A pytree whose numbers (direction, alpha, kappa, beta, coefficient) are
  leaves, so a jitted function taking it as an argument sweeps alpha
  without recompiling; `method`, `gate` and `renormalize` are static.

  Attributes:
    method: 'spherical', 'addition' or 'none'.
    direction: (dim,) target direction (normalised here).
    alpha: strength in [0, 1]: the rotation fraction (gated: its maximum)
      or the addition coefficient's multiplier.
    kappa: vMF concentration of the gate (reference: 20).
    beta: gate threshold in [-1, 1): steer only where delta > beta.
    coefficient: addition scale (e.g. the mean activation norm).
    gate: gate the rotation or the addition by the vMF gate (else t =
      alpha everywhere); None (the default): gated for 'spherical', not for
      'addition', as in the reference and the addition literature.
    renormalize: addition only: rescale x' to |x|.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import steering
    >>> mu = jnp.array([1.0, 0.0, 0.0])
    >>> x = jnp.array([[0.0, 2.0, 0.0], [0.0, 0.0, -3.0]])
    >>> rotate = steering.Steering('spherical', mu, alpha=0.5, gate=False)
    >>> y, _ = rotate(x)
    >>> [round(float(v), 4) for v in jnp.linalg.norm(y, axis=-1)]   # Norms kept.
    [2.0, 3.0]
    >>> add = steering.Steering('addition', mu, alpha=0.5, coefficient=2.0)
    >>> add(x)[0][0].tolist()
    [1.0, 2.0, 0.0]
    >>> # A pytree: a jitted function sweeps alpha without recompiling.
    >>> f = jax.jit(lambda s, x: s(x)[0])
    >>> y = f(steering.Steering('spherical', mu, alpha=0.2, gate=False), x)
  """
  method: str = dataclasses.field(metadata=dict(static=True))
  direction: jax.Array
  alpha: float | jax.Array = 0.5
  kappa: float | jax.Array = 20.0
  beta: float | jax.Array = 0.0
  coefficient: float | jax.Array = 1.0
  gate: bool | None = dataclasses.field(default=None,
                                        metadata=dict(static=True))
  renormalize: bool = dataclasses.field(default=False,
                                        metadata=dict(static=True))

  def __post_init__(self):
    validation.check_choice(_STEERING, 'method', self.method, METHODS,
                            'unknown steering method')
    if self.gate is None:  # Frozen: the resolved default is set once here.
      object.__setattr__(self, 'gate', self.method == 'spherical')
    # Checked when concrete; inside jit the values were checked on entry.
    if validation.is_concrete(self.direction):
      check_direction(self.direction)
    check = functools.partial(validation.check, _STEERING)
    check('alpha', self.alpha, lambda v: 0.0 <= v <= 1.0, 'in [0, 1]')
    check('beta', self.beta, lambda v: -1.0 <= v < 1.0, 'in [-1, 1)')
    check('kappa', self.kappa, lambda v: v >= 0, '>= 0')
    check('coefficient', self.coefficient, lambda v: v >= 0, '>= 0')

  @property
  def hidden_size(self) -> int:
    """The direction's dimension, which the activations' last must match."""
    return int(np.shape(self.direction)[-1])

  def __call__(self, x: jax.Array,
               mask: jax.Array | None = None) -> tuple[jax.Array, SteerStats]:
    """Steers x: (..., dim) where `mask` (x.shape[:-1], bool) is set.

    Raises:
      ArgumentError: x's last dimension differs from the direction's.
    """
    if x.shape[-1] != self.hidden_size:
      raise validation.ArgumentError(
          _STEERING, 'direction', f'hidden size {self.hidden_size} does not '
          f'match the activations\' {x.shape[-1]} (shape {x.shape})')
    mask = (jnp.ones(x.shape[:-1], bool) if mask is None
            else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape[:-1]))
    tokens = jnp.sum(mask, dtype=jnp.float32)
    if self.method == 'none':
      zero = jnp.zeros((), jnp.float32)
      return x, SteerStats(tokens, zero, zero)
    mu = unit(self.direction)
    xf = x.astype(jnp.float32)
    alpha = jnp.asarray(self.alpha, jnp.float32)
    if self.gate:
      norm = jnp.linalg.norm(xf, axis=-1)
      cos = jnp.sum(xf * mu, -1) / jnp.maximum(norm, _MIN_NORM)
      _, t = gate(cos, alpha=alpha, kappa=self.kappa, beta=self.beta)
    else:
      t = jnp.broadcast_to(alpha, mask.shape)
    if self.method == 'addition':
      new = xf + (t * self.coefficient)[..., None] * mu
      if self.renormalize:
        scale = (jnp.linalg.norm(xf, axis=-1, keepdims=True)
                 / jnp.maximum(jnp.linalg.norm(new, axis=-1, keepdims=True),
                               _MIN_NORM))
        new = new * scale
    else:
      new = slerp_rotate(xf, mu, t)
    changed = mask & (t > 0)
    out = jnp.where(changed[..., None], new.astype(x.dtype), x)
    return out, SteerStats(tokens, jnp.sum(changed, dtype=jnp.float32),
                           jnp.sum(jnp.where(changed, t, 0.0)))

