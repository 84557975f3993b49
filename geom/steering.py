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

Centring (`center=m`, ours): the gate's cosine and the rotation act on
x - m, x' = m + slerp_rotate(x - m, mu, t), for a residual stream whose
tokens all share a component with the direction (on Gemma 3 270M every
token's cosine to it is 0.33-0.72, so the uncentred gate never fires).
`layer_mean` gives m, `cosines` the gate's per-token cosine, and
`calibrate_gate` sets kappa and beta from the contrastive set's cosines.

Computed in float32 and cast back to the input dtype; tokens outside `mask`
and tokens the gate leaves alone come back bit for bit. How the rotation
stays exact from theta = 0 to theta = pi: docs/methods/steering.md.

Which parts are the reference's: the rotation, the vMF gate with kappa,
alpha, beta. Ours: the gate on addition (for the ablation), the
theta-near-pi plane, the rotation of tokens within
1e-4 of the target (the reference leaves them as they are), the exact
pass-through of ungated tokens, the uncentred PCA (below), the centring,
the gate's calibration and the trigger statistics. Of the direction
methods, 'mean_diff' is ActAdd's and CAA's, 'pca_center' repeng's and
'logistic' steering-vectors' (with our feature scale and solver); the
sign rule shared by all of them is ours.

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
  Chanin, steering-vectors, github.com/steering-vectors/steering-vectors.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from geom import validation

__all__ = ['DELTA_BINS', 'DELTA_EDGES', 'DIRECTION_METHODS',
           'GateCalibration', 'LOGISTIC_C', 'LOGISTIC_ITERATIONS', 'METHODS',
           'SteerStats', 'Steering', 'calibrate_gate', 'check_direction',
           'cosines', 'extract_direction', 'gate', 'layer_mean',
           'logistic_direction', 'logistic_weights', 'mean_difference',
           'pca_center_direction', 'pca_direction', 'slerp_rotate', 'unit']

_STEERING = 'geom.steering.Steering'
_EXTRACT = 'geom.steering.extract_direction'
_CALIBRATE = 'geom.steering.calibrate_gate'

#: The methods of `Steering`.
METHODS = ('none', 'addition', 'spherical')
#: The methods of `extract_direction`.
DIRECTION_METHODS = ('mean_diff', 'pca', 'pca_center', 'logistic')
#: `logistic_weights`' inverse regularisation strength: scikit-learn's
#: default C, which steering-vectors' logistic aggregator keeps.
LOGISTIC_C = 1.0
#: Newton steps of `logistic_weights` (converged to float32 well before).
LOGISTIC_ITERATIONS = 30
#: Bins of `SteerStats.delta_hist`: DELTA_BINS equal bins of the gate value
#: delta over [-1, 1], bin i holding DELTA_EDGES[i] <= delta <
#: DELTA_EDGES[i + 1] (the last bin also holds delta = 1). Edges at
#: multiples of 0.1, so the trigger rate at beta = -0.9, ..., 0.9 reads off.
DELTA_BINS = 20
#: The DELTA_BINS + 1 bin edges of `SteerStats.delta_hist` (float64).
DELTA_EDGES = np.linspace(-1.0, 1.0, DELTA_BINS + 1)

# Floor for the norms divided by in the gate and in addition's rescaling.
_MIN_NORM = 1e-12
# |x_hat - c mu| below this many eps of the compute dtype is rounding noise
# (for x = -|x| mu it measures under 0.6 eps): slerp_rotate then uses a fixed
# plane. Above it the measured plane is used, orthogonal to mu however noisy.
_PLANE_NOISE = 4
# beta = -tanh(kappa c*) from calibrate_gate stays this far inside (-1, 1).
_BETA_MARGIN = 1e-6
# Cosines handed to calibrate_gate may exceed 1 by float32 rounding.
_COS_SLACK = 1e-5


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


def _paired(positive, negative, method: str) -> tuple[jax.Array, jax.Array]:
  """Float32 paired (n, dim) activations (any float input, bfloat16
  included) after checking their shapes."""
  positive = jnp.asarray(positive, jnp.float32)
  negative = jnp.asarray(negative, jnp.float32)
  if (positive.shape != negative.shape or positive.ndim != 2
      or positive.shape[0] == 0):
    raise validation.ArgumentError(
        _EXTRACT, 'positive, negative', f'shapes {positive.shape} and '
        f'{negative.shape}: {method} needs paired (n, dim) arrays, n >= 1')
  return positive, negative


def _check_concept(mean_diff: jax.Array, name: str) -> None:
  """Raises ArgumentError naming `name` when a concrete mean difference
  is zero or non-finite (identical sides); traced values pass (jit)."""
  if validation.is_concrete(mean_diff):
    check_direction(mean_diff, name, _EXTRACT)


def _signed_unit(v: jax.Array, mean_diff: jax.Array) -> jax.Array:
  """unit(v), flipped where the mean difference projects negatively."""
  return unit(jnp.where(jnp.dot(v, mean_diff) < 0, -v, v))


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
  _check_concept(diff, 'mean difference of positive and negative')
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
  positive, negative = _paired(positive, negative, 'pca')
  diffs = positive - negative
  _check_concept(diffs.mean(0), 'mean of the paired differences')
  _, _, vt = jnp.linalg.svd(diffs, full_matrices=False)
  return _signed_unit(vt[0], diffs.mean(0))


def pca_center_direction(positive, negative) -> jax.Array:
  """repeng's `pca_center`: PCA of each pair's activations about its midpoint.

  For pair i, c_i = (positive[i] + negative[i]) / 2; the rows
  positive[i] - c_i and negative[i] - c_i of all pairs are stacked into a
  (2n, dim) matrix and its top right-singular vector is the direction
  (repeng's `read_representations(method='pca_center')`; the PCA
  repeng calls also subtracts the rows' mean, zero here up to rounding as
  the rows come in +-pairs, so it is left out). The sign is ours, as for
  every method here: the mean difference projects positively (repeng
  flips by a majority vote of the pairs).

  The rows are +-(positive[i] - negative[i]) / 2, whose Gram matrix is
  half the differences', so the direction is `pca_direction`'s up to
  rounding: repeng's centring per pair is the uncentred PCA of the
  differences (tests/test_steering_directions.py checks both against numpy).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> positive = jnp.array([[2.0, 1.0], [3.0, -1.0]])
    >>> negative = jnp.array([[0.0, 1.0], [0.0, -1.0]])
    >>> [round(float(v), 4)
    ...  for v in steering.pca_center_direction(positive, negative)]
    [1.0, 0.0]
  """
  positive, negative = _paired(positive, negative, 'pca_center')
  mean_diff = (positive - negative).mean(0)
  _check_concept(mean_diff, 'mean of the paired differences')
  center = 0.5 * (positive + negative)
  rows = jnp.concatenate([positive - center, negative - center])
  _, _, vt = jnp.linalg.svd(rows, full_matrices=False)
  return _signed_unit(vt[0], mean_diff)


def _logistic_rows(positive, negative) -> jax.Array:
  """z_i = (positive[i] - negative[i]) / (2 s), s the RMS row norm."""
  half = 0.5 * (positive - negative)
  scale = jnp.sqrt(jnp.mean(jnp.sum(half * half, -1)))
  return half / jnp.where(scale > 0, scale, 1.0)


def logistic_weights(positive, negative, *, c: float = LOGISTIC_C,
                     iterations: int = LOGISTIC_ITERATIONS) -> jax.Array:
  """The weights of an L2-regularised logistic regression, positive vs negative.

  steering-vectors' logistic aggregator: each pair is centred on its
  midpoint, so the rows are +-(positive[i] - negative[i]) / 2 with labels
  +-1, and a logistic regression without intercept is fitted with
  scikit-learn's objective (C = 1); both rows of a pair add the same
  term, so the objective is

      J(w) = |w|^2 / 2 + 2 C sum_i softplus(-<w, z_i>),
      z_i = (positive[i] - negative[i]) / (2 s),

  with s the root-mean-square norm of the (positive[i] - negative[i]) / 2.
  Ours: the scale s (a scalar, so that C weighs the data the same at any
  layer's activation scale; steering-vectors fits the raw activations,
  where C's meaning changes with the norm) and the solver: J is strongly
  convex (its Hessian is >= I), and `iterations` Newton steps from w = 0,
  each solved through the n x n Woodbury form and taken at the largest of
  the step sizes 1, 1/2, ..., 1/2048, 0 that does not raise J (beyond
  float32 rounding), reach its minimiser deterministically, in jnp,
  under jit too.

  Args:
    positive, negative: paired (n, dim) activations, any float dtype.
    c: the inverse regularisation strength C, > 0.
    iterations: Newton steps (static under jit).

  Returns:
    The float32 minimiser w of J, in the scaled coordinates z (unnormalised;
    `logistic_direction` is its unit vector).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> positive = jnp.array([[2.0, 1.0], [2.0, -1.0]])
    >>> negative = jnp.array([[0.0, 1.0], [0.0, -1.0]])
    >>> w = steering.logistic_weights(positive, negative)
    >>> # z_i = (1, 0) for both pairs: w_0 solves w_0 = 4 C sigmoid(-w_0).
    >>> round(float(w[0]), 4), round(float(w[1]), 4)
    (1.0426, 0.0)
  """
  positive, negative = _paired(positive, negative, 'logistic')
  validation.check(_EXTRACT, 'c', c, lambda v: 0 < v < float('inf'),
                   '> 0 and finite')
  _check_concept((positive - negative).mean(0),
                 'mean of the paired differences')
  z = _logistic_rows(positive, negative)
  gram = z @ z.T
  eye = jnp.eye(z.shape[0], dtype=jnp.float32)
  steps = jnp.concatenate([2.0 ** -jnp.arange(12.0), jnp.zeros(1)])

  def objective(w):  # (..., dim) -> (...)
    return (0.5 * jnp.sum(w * w, -1)
            + 2 * c * jnp.sum(jax.nn.softplus(-(w @ z.T)), -1))

  def newton(_, w):
    margin = z @ w
    grad = w - 2 * c * (jax.nn.sigmoid(-margin) @ z)
    # H = I + Z^T D Z; H^-1 = I - Z^T R (I + R Z Z^T R)^-1 R Z, R = D^1/2.
    root = jnp.sqrt(2 * c * jax.nn.sigmoid(margin) * jax.nn.sigmoid(-margin))
    inner = jnp.linalg.solve(eye + root[:, None] * gram * root[None, :],
                             root * (z @ grad))
    move = grad - (root * inner) @ z
    trials = w[None] - steps[:, None] * move[None]
    # The largest step that does not raise J beyond float32 rounding: near
    # the minimum J is flat to rounding and comparing values would stall.
    value = objective(w)
    tolerance = 8 * jnp.finfo(jnp.float32).eps * jnp.abs(value)
    return trials[jnp.argmax(objective(trials) <= value + tolerance)]

  return jax.lax.fori_loop(0, iterations, newton,
                           jnp.zeros(z.shape[1], jnp.float32))


def logistic_direction(positive, negative) -> jax.Array:
  """The unit vector of `logistic_weights` (steering-vectors' logistic
  aggregator, with our scale and solver), signed so that the mean
  difference projects positively.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> positive = jnp.array([[2.0, 1.0], [2.0, -1.0]])
    >>> negative = jnp.array([[0.0, 1.0], [0.0, -1.0]])
    >>> [round(float(v), 4)
    ...  for v in steering.logistic_direction(positive, negative)]
    [1.0, 0.0]
  """
  w = logistic_weights(positive, negative)
  mean_diff = (jnp.asarray(positive, jnp.float32)
               - jnp.asarray(negative, jnp.float32)).mean(0)
  return _signed_unit(w, mean_diff)


def extract_direction(positive, negative, method: str = 'mean_diff') -> jax.Array:
  """A unit direction from contrastive activations, by `method`.

  'mean_diff' (`mean_difference`; pairing not needed), 'pca'
  (`pca_direction`), 'pca_center' (`pca_center_direction`, repeng's) or
  'logistic' (`logistic_direction`, steering-vectors'); the last three
  take paired (n, dim) arrays. Every method is signed so that the mean
  difference projects positively, and works under jit (where inputs with
  no difference give NaN instead of the error).

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
  return {'mean_diff': mean_difference, 'pca': pca_direction,
          'pca_center': pca_center_direction,
          'logistic': logistic_direction}[method](positive, negative)


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


def _check_center(center, dim: int | None, owner: str) -> None:
  """Raises ArgumentError naming 'center' unless a concrete center is a
  finite (dim,) vector; traced centers pass (checked where concrete)."""
  if center is None or not validation.is_concrete(center):
    return
  shape = np.shape(center)
  if len(shape) != 1 or (dim is not None and shape[0] != dim):
    want = f'({dim},)' if dim is not None else '(dim,)'
    raise validation.ArgumentError(
        owner, 'center', f'must be a vector of shape {want}, the '
        f"direction's, got shape {shape}")
  if not np.all(np.isfinite(np.asarray(center, np.float32))):
    raise validation.ArgumentError(owner, 'center', 'has non-finite entries; '
                                   'must be finite')


def _gate_cosine(rel: jax.Array, mu: jax.Array) -> jax.Array:
  """The gate's cosine of float32 (..., dim) `rel` with unit mu (0 at 0)."""
  norm = jnp.linalg.norm(rel, axis=-1)
  return jnp.sum(rel * mu, -1) / jnp.maximum(norm, _MIN_NORM)


def cosines(x, direction, center=None) -> jax.Array:
  """Per token, the cosine that `Steering(direction=.., center=..)`'s gate sees.

  cos(x - center, direction) in float32 with the operator's own arithmetic
  (0 where x - center = 0), so that `calibrate_gate` is fed exactly what
  the gate will compare. Works under jit (values are then not checked).

  Args:
    x: (..., dim) activations, any float dtype (bfloat16 included).
    direction: (dim,) steering direction (normalised here).
    center: optional (dim,) vector subtracted from x first (`layer_mean`).

  Returns:
    float32 array of shape x.shape[:-1], in [-1, 1] up to rounding.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> x = jnp.array([[3.0, 1.0], [1.0, 1.0]])
    >>> [round(float(c), 4) for c in steering.cosines(x, jnp.array([1.0, 0.0]))]
    [0.9487, 0.7071]
    >>> steering.cosines(x, jnp.array([1.0, 0.0]), center=jnp.array([2.0, 1.0])
    ...                  ).tolist()   # x - center: [1, 0] and [-1, 0].
    [1.0, -1.0]
  """
  owner = 'geom.steering.cosines'
  if validation.is_concrete(direction):
    check_direction(direction, owner=owner)
  dim = np.shape(direction)[-1]
  if np.ndim(x) < 1 or np.shape(x)[-1] != dim:
    raise validation.ArgumentError(
        owner, 'x', f"last dimension must be the direction's {dim}, got "
        f'shape {np.shape(x)}')
  _check_center(center, dim, owner)
  rel = jnp.asarray(x).astype(jnp.float32)
  if center is not None:
    rel = rel - jnp.asarray(center, jnp.float32)
  return _gate_cosine(rel, unit(direction))


def layer_mean(activations, mask=None) -> jax.Array:
  """The (dim,) float32 mean of activations over all leading axes: a center.

  Typically over the contrastive set's activations at the steered layer,
  both sides together, so that the centred cosines of the two sides fall
  on either side of 0 (docs/methods/steering.md).

  Args:
    activations: (..., dim) activations with at least one leading axis,
      any float dtype; accumulated in float32.
    mask: optional bool array of shape activations.shape[:-1]: only the
      tokens where it is set are averaged.

  Returns:
    The float32 mean, shape (dim,). Under jit, where an empty mask cannot
    be refused, an empty mask gives NaN.

  Raises:
    ArgumentError: no leading axis or no token ('activations'), a mask of
      another shape or one selecting no token ('mask').

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> h = jnp.array([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [0.0, 0.0]]])
    >>> steering.layer_mean(h).tolist()
    [2.25, 3.0]
    >>> steering.layer_mean(h, jnp.array([[True, True], [True, False]])
    ...                     ).tolist()
    [3.0, 4.0]
  """
  owner = 'geom.steering.layer_mean'
  shape = np.shape(activations)
  if len(shape) < 2 or 0 in shape:
    raise validation.ArgumentError(
        owner, 'activations', 'must be a non-empty (..., dim) array with at '
        f'least one token axis, got shape {shape}')
  x = jnp.asarray(activations).astype(jnp.float32)
  if mask is None:
    return jnp.mean(x.reshape(-1, shape[-1]), axis=0)
  if np.shape(mask) != shape[:-1]:
    raise validation.ArgumentError(
        owner, 'mask', f"must have the activations' leading shape "
        f'{shape[:-1]}, got {np.shape(mask)}')
  if validation.is_concrete(mask) and not np.any(np.asarray(mask, bool)):
    raise validation.ArgumentError(owner, 'mask', 'selects no token; must '
                                   'select at least one')
  mask = jnp.asarray(mask, bool)
  total = jnp.sum(jnp.where(mask[..., None], x, 0.0).reshape(-1, shape[-1]),
                  axis=0)
  return total / jnp.sum(mask, dtype=jnp.float32)


class GateCalibration(NamedTuple):
  """The gate's kappa and beta from `calibrate_gate`, and what set them.

  Attributes:
    kappa: the gate's concentration, width / spread (lower where `capped`).
    beta: -tanh(kappa * threshold): delta > beta exactly when
      cos < threshold.
    threshold: c*, the cosine at which the gate switches: the midpoint of
      the two medians.
    spread: the pooled within-set standard deviation of the cosines.
    positive_median: median cosine of the target side.
    negative_median: median cosine of the other side.
    capped: whether kappa was lowered to atanh(1 - 1e-6) / |threshold| to
      keep |beta| <= 1 - 1e-6.

  Example:

    >>> from geom import steering
    >>> cal = steering.calibrate_gate([0.3, 0.5, 0.4], [-0.2, 0.0, -0.1])
    >>> round(cal.threshold, 4), round(cal.spread, 4), round(cal.kappa, 4)
    (0.15, 0.1, 10.0)
  """
  kappa: float
  beta: float
  threshold: float
  spread: float
  positive_median: float
  negative_median: float
  capped: bool


def _calibration_cosines(values, name: str) -> np.ndarray:
  """`values` flattened to float64 after checking they are usable cosines."""
  v = np.asarray(values).astype(np.float64).ravel()
  problem = None
  if v.size == 0:
    problem = 'is empty; needs at least one cosine'
  elif not np.all(np.isfinite(v)):
    problem = 'has non-finite entries; cosines must be finite'
  elif np.max(np.abs(v)) > 1.0 + _COS_SLACK:
    problem = (f'holds {float(v[np.argmax(np.abs(v))])}; cosines must be in '
               f'[-1, 1] (to {_COS_SLACK} for rounding)')
  if problem:
    raise validation.ArgumentError(_CALIBRATE, name, problem)
  return v


def _medians_and_spread(pos: np.ndarray,
                        neg: np.ndarray) -> tuple[float, float, float]:
  """The two medians and the pooled within-set standard deviation, after
  checking that the target side's median is above and the spread > 0."""
  both = 'positive_cos, negative_cos'
  pos_med, neg_med = float(np.median(pos)), float(np.median(neg))
  if not pos_med > neg_med:
    raise validation.ArgumentError(
        _CALIBRATE, both, f'median {pos_med:.6g} of the target side is not '
        f'above the other side\'s {neg_med:.6g}: no threshold separates them '
        '(identical sets, or a direction of the wrong sign?)')
  dof = pos.size + neg.size - 2
  squares = np.sum((pos - pos.mean()) ** 2) + np.sum((neg - neg.mean()) ** 2)
  spread = float(np.sqrt(squares / dof)) if dof > 0 else 0.0
  if not spread > 0:
    raise validation.ArgumentError(
        _CALIBRATE, both, 'have no spread within the sets (pooled std 0); '
        'kappa = width / spread needs a spread > 0')
  return pos_med, neg_med, spread


def calibrate_gate(positive_cos, negative_cos, *,
                   width: float = 1.0) -> GateCalibration:
  """kappa and beta of the vMF gate from the layer's contrastive cosines.

  The gate is the paper's: delta = -tanh(kappa cos), a token is steered
  when delta > beta. The calibration is ours. The gate switches at the
  threshold c* = (median(positive_cos) + median(negative_cos)) / 2, so
  beta = -tanh(kappa c*) and delta > beta exactly when cos < c* (tanh is
  increasing). The midpoint of the medians rather than the best-separating
  cut: one token cannot move it far and it is defined however much the
  sets overlap, where the best cut is the argmax of a step function, not
  unique when the sets are apart and jumpy when they overlap. kappa =
  width / s, s the pooled within-set standard deviation of the cosines,
  so that delta's transition (tanh's unit scale) spans `1 / width` of the
  layer's spread: with c* near 0, a token one s below c* gets about
  tanh(width) alpha. beta must stay inside (-1, 1): where
  kappa |c*| > atanh(1 - 1e-6), kappa is lowered to that bound
  (`capped`), which keeps the switch at c*, and beta is then clipped to
  [-1 + 1e-6, 1 - 1e-6] against rounding. Near that bound float32 tanh is
  flat and the switch is blurred by about 1e-7 / (kappa (1 - beta^2)) in
  cos, and every delta is close to -beta's sign so t stays tiny: a capped
  calibration says the cosines sit far from 0, centre them first.

  Host-side (numpy float64; any float input, bfloat16 included); feed it
  `cosines(x, direction, center)` with the center the steering will use.

  Args:
    positive_cos: cosines of the target side's activations (any shape).
    negative_cos: cosines of the other side's activations.
    width: kappa times the spread, > 0 (larger: a sharper switch).

  Returns:
    A `GateCalibration` of Python numbers: pass kappa and beta to `Steering`.

  Raises:
    ArgumentError: width not > 0; an empty set or one with non-finite or
      out-of-range cosines (naming it); no positive gap between the medians
      or no spread ('positive_cos, negative_cos').

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> cal = steering.calibrate_gate([0.3, 0.5, 0.4], [-0.2, 0.0, -0.1])
    >>> round(cal.threshold, 4), round(cal.beta, 4)
    (0.15, -0.9051)
    >>> _, t = steering.gate(jnp.array([0.14, 0.16]), alpha=1.0,
    ...                      kappa=cal.kappa, beta=cal.beta)
    >>> [bool(v > 0) for v in t]   # Steered below the threshold only.
    [True, False]
  """
  validation.check(_CALIBRATE, 'width', width,
                   lambda w: 0 < w < float('inf'), '> 0 and finite')
  pos_med, neg_med, spread = _medians_and_spread(
      _calibration_cosines(positive_cos, 'positive_cos'),
      _calibration_cosines(negative_cos, 'negative_cos'))
  threshold = 0.5 * (pos_med + neg_med)
  kappa = width / spread
  bound = float(np.arctanh(1.0 - _BETA_MARGIN))
  capped = kappa * abs(threshold) > bound
  if capped:
    kappa = bound / abs(threshold)
  beta = float(np.clip(-np.tanh(kappa * threshold), -1.0 + _BETA_MARGIN,
                       1.0 - _BETA_MARGIN))
  return GateCalibration(float(kappa), beta, threshold, spread, pos_med,
                         neg_med, bool(capped))


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


# The default histogram of a SteerStats built from the three sums alone
# (read-only: a NamedTuple default is shared by every instance).
_NO_HISTOGRAM = np.zeros(DELTA_BINS, np.float32)
_NO_HISTOGRAM.setflags(write=False)


class SteerStats(NamedTuple):
  """Sums over the steered tokens of one call; add them across calls.

  Every field is a sum, so `jax.tree.map(jnp.add, a, b)` adds two calls.

  Attributes:
    tokens: tokens in the mask.
    triggered: tokens that were changed (t > 0; without the gate, every
      masked token when alpha > 0).
    t_sum: sum of the strength t applied (the rotation fraction, or the
      multiplier of the addition; alpha everywhere without the gate).
    delta_hist: (DELTA_BINS,) float32 counts of the masked tokens by the
      gate value delta = -tanh(kappa cos) (bins `DELTA_EDGES`), for every
      method, gated or not and 'none' included (what the gate would say);
      it sums to `tokens`. Zeros where built from the first three alone
      (`SteerStats(tokens, triggered, t_sum)` still works).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import steering
    >>> s = steering.Steering('spherical', jnp.array([1.0, 0.0]), alpha=1.0)
    >>> x = jnp.array([[-1.0, 0.1], [1.0, 0.1]])   # One token away, one near.
    >>> _, stats = s(x)
    >>> float(stats.tokens), float(stats.triggered), float(stats.trigger_rate)
    (2.0, 1.0, 0.5)
    >>> [int(i) for i in jnp.flatnonzero(stats.delta_hist)]   # delta = +-1.
    [0, 19]
  """
  tokens: jax.Array
  triggered: jax.Array
  t_sum: jax.Array
  delta_hist: jax.Array = _NO_HISTOGRAM

  @property
  def trigger_rate(self) -> jax.Array:
    """The fraction of masked tokens that were changed."""
    return self.triggered / jnp.maximum(self.tokens, 1)


def _delta_histogram(delta: jax.Array, mask: jax.Array) -> jax.Array:
  """(DELTA_BINS,) float32 counts of delta (in [-1, 1]) over masked tokens."""
  index = jnp.clip(jnp.floor((delta + 1.0) * (DELTA_BINS / 2.0)), 0,
                   DELTA_BINS - 1).astype(jnp.int32)
  hits = jax.nn.one_hot(index, DELTA_BINS, dtype=jnp.float32)
  return jnp.sum(jnp.where(mask[..., None], hits, 0.0),
                 axis=tuple(range(mask.ndim)))


def _steer(op: 'Steering', x: jax.Array,
           mask: jax.Array) -> tuple[jax.Array, SteerStats]:
  """Steering.__call__ after its checks: x' and the statistics."""
  tokens = jnp.sum(mask, dtype=jnp.float32)
  mu = unit(op.direction)
  xf = x.astype(jnp.float32)
  center = None if op.center is None else jnp.asarray(op.center, jnp.float32)
  rel = xf if center is None else xf - center   # What the gate and slerp see.
  alpha = jnp.asarray(op.alpha, jnp.float32)
  delta, t = gate(_gate_cosine(rel, mu), alpha=alpha, kappa=op.kappa,
                  beta=op.beta)
  hist = _delta_histogram(delta, mask)
  if op.method == 'none':
    zero = jnp.zeros((), jnp.float32)
    return x, SteerStats(tokens, zero, zero, hist)
  if not op.gate:
    t = jnp.broadcast_to(alpha, mask.shape)
  if op.method == 'addition':
    new = xf + (t * op.coefficient)[..., None] * mu
    if op.renormalize:   # |x' - m| = |x - m|; m = 0 without a center.
      new_rel = new if center is None else new - center
      new = new_rel * (
          jnp.linalg.norm(rel, axis=-1, keepdims=True)
          / jnp.maximum(jnp.linalg.norm(new_rel, axis=-1, keepdims=True),
                        _MIN_NORM))
      new = new if center is None else center + new
  else:
    new = slerp_rotate(rel, mu, t)
    new = new if center is None else center + new
  changed = mask & (t > 0)
  out = jnp.where(changed[..., None], new.astype(x.dtype), x)
  return out, SteerStats(tokens, jnp.sum(changed, dtype=jnp.float32),
                         jnp.sum(jnp.where(changed, t, 0.0)), hist)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Steering:
  """One steering operator, applied as `steering(x, mask) -> (x', SteerStats)`.

  A pytree whose numbers (direction, alpha, kappa, beta, coefficient,
  center) are leaves, so a jitted function taking it as an argument sweeps
  alpha without recompiling; `method`, `gate` and `renormalize` are static.

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
    renormalize: addition only: rescale x' to |x| (with a center, so that
      |x' - center| = |x - center|).
    center: optional finite (dim,) vector m (`layer_mean`): the gate's
      cosine is taken on x - m, 'spherical' gives m + slerp(x - m, mu, t)
      (|x' - m| = |x - m|), 'addition' still adds t coefficient mu. None
      (the default): m = 0, the reference's arithmetic bit for bit.

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
    >>> # Centred: rotates about m = (0, 1, 0), keeping |x' - m|.
    >>> m = jnp.array([0.0, 1.0, 0.0])
    >>> centred = steering.Steering('spherical', mu, alpha=1.0, gate=False,
    ...                             center=m)
    >>> [round(float(v), 4) for v in centred(x)[0][0]]
    [1.0, 1.0, 0.0]
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
  center: jax.Array | None = None

  def __post_init__(self):
    validation.check_choice(_STEERING, 'method', self.method, METHODS,
                            'unknown steering method')
    if self.gate is None:  # Frozen: the resolved default is set once here.
      object.__setattr__(self, 'gate', self.method == 'spherical')
    # Checked when concrete; inside jit the values were checked on entry.
    if validation.is_concrete(self.direction):
      check_direction(self.direction)
    shape = getattr(self.direction, 'shape', None)
    _check_center(self.center, shape[-1] if shape else None, _STEERING)
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
    return _steer(self, x, mask)
