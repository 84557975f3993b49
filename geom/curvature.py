r"""The loss's curvature from Hessian-vector products: top eigenvalue and trace.

Sharpness in the SAM sense is read from the Hessian H of a loss at the
parameters. H is never formed: every estimator here needs only products
H v, computed forward-over-reverse (one `jax.jvp` of `jax.grad`, about
the cost of two to three gradients), on any parameter pytree::

  hvp(loss, w, v)            H v
  power_iteration(loss, w)   the eigenvalue of largest magnitude and its
                             unit eigenvector (v <- H v / |H v|, with the
                             Rayleigh quotient v^T H v as the estimate)
  lanczos(loss, w)           Ritz values of H from a Krylov space: both
                             ends of the spectrum, the largest *algebraic*
                             eigenvalue even where a negative one is
                             larger in magnitude
  hutchinson_trace(loss, w)  tr H = E[z^T H z] for Rademacher z, with the
                             estimate's standard error
  rayleigh(loss, w)          u^T H u along u = g / |g| (one product): the
                             curvature the gradient step sees

All are pure functions of `(loss_fn, params, key)` and run under `jax.jit`.
Sharded: under `jit` with parameters and batch placed by `NamedSharding`
(for example through the loss's closure over a sharded batch), XLA
partitions each product as it partitions a gradient: data-parallel
batches are reduced across devices and model-sharded weights stay
sharded (tested equal to the unsharded result on an 8-device mesh; the
cost of one product against a gradient is in BENCHMARKS.md).

Numerics: vectors are normalised with `geom.tree_norm.tree_norm_f32` (no
overflow at |H v| = 1e20, no division by zero when H v = 0, which gives
the eigenvalue 0) and inner products accumulate in float32 whatever the
parameters' dtype; the vectors keep each leaf's dtype, so bfloat16
parameters give bfloat16 products.

Power iteration converges at the rate |lambda_2 / lambda_1| per product;
with `tol` it stops early once the Rayleigh quotient changes by less than
`tol` (relative) between two products. It returns the eigenvalue of
largest *magnitude*, which is negative where the loss is concave in some
direction more than it is convex in any: the sign is kept. There
(a pretrained LM on text it was not trained on is one: Gemma 3 270M's
largest-magnitude eigenvalue on Python's documentation is about -2e5),
`lanczos` gives the largest positive curvature as well: its extreme Ritz
values converge to both ends of the spectrum, the ends first, in about
as many products as power iteration needs for one.

Example:

  >>> import jax, jax.numpy as jnp
  >>> from geom import curvature
  >>> loss = lambda w: 0.5 * (3.0 * w['a'][0] ** 2 + w['a'][1] ** 2)
  >>> w = {'a': jnp.ones(2)}
  >>> top = curvature.power_iteration(loss, w, jax.random.key(0), 50)
  >>> round(float(top.eigenvalue), 4)
  3.0
  >>> trace = curvature.hutchinson_trace(loss, w, jax.random.key(1), 64)
  >>> round(float(trace.mean), 4)   # Exact for a diagonal H (z_i^2 = 1).
  4.0

References:
  Pearlmutter, Fast exact multiplication by the Hessian, 1994.
  Hutchinson, A stochastic estimator of the trace of the influence matrix
  for Laplacian smoothing splines, 1989.
  Yao, Gholami, Keutzer & Mahoney, PyHessian: neural networks through the
  lens of the Hessian, 2020 (power iteration and Hutchinson on networks).
  Lanczos, An iteration method for the solution of the eigenvalue problem
  of linear differential and integral operators, 1950; Ghorbani, Krishnan
  & Xiao, An investigation into neural net optimization via Hessian
  eigenvalue density, 2019 (Lanczos on networks).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from geom import tree_norm
from geom import validation

__all__ = ['Spectrum', 'TopEigen', 'TraceEstimate', 'hvp',
           'hutchinson_trace', 'lanczos', 'power_iteration', 'rayleigh',
           'tree_dot']

LossFn = Callable[[Any], jax.Array]


class TopEigen(NamedTuple):
  """The result of `power_iteration`.

  Attributes:
    eigenvalue: v^T H v for the returned unit vector (float32 scalar).
    vector: that unit vector, a pytree like the parameters.
    iterations: Hessian-vector products used (int32; fewer than
      `num_iters` when `tol` stopped it).

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 + w[1] ** 2)   # H = diag(3, 1)
    >>> top = curvature.power_iteration(loss, jnp.ones(2), jax.random.key(0),
    ...                                 num_iters=100, tol=1e-6)
    >>> round(float(top.eigenvalue), 3)
    3.0
    >>> [round(abs(float(x)), 3) for x in top.vector]
    [1.0, 0.0]
    >>> bool(top.iterations < 100)   # Stopped early by `tol`.
    True
  """
  eigenvalue: jax.Array
  vector: Any
  iterations: jax.Array


class TraceEstimate(NamedTuple):
  """The result of `hutchinson_trace` (float32 scalars).

  Attributes:
    mean: the estimate of tr H, the mean of z^T H z over the probes.
    stderr: its standard error, std(z^T H z) / sqrt(num_samples) (0 for
      one probe).

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 + w[1] ** 2)   # H = diag(3, 1)
    >>> trace = curvature.hutchinson_trace(loss, jnp.ones(2), jax.random.key(1),
    ...                                    num_samples=8)
    >>> float(trace.mean), float(trace.stderr)   # Exact for a diagonal H.
    (4.0, 0.0)
  """
  mean: jax.Array
  stderr: jax.Array


class Spectrum(NamedTuple):
  """The result of `lanczos`.

  Attributes:
    ritz_values: the eigenvalues of the Lanczos tridiagonal matrix,
      ascending (float32, `num_steps` of them; after an early breakdown
      the unused ones repeat the first Rayleigh quotient, inside the
      spectrum's range, so the ends stay exact).
    steps: Lanczos steps before the Krylov space was exhausted (int32).

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 - 5.0 * w[1] ** 2)   # diag(3, -5)
    >>> spec = curvature.lanczos(loss, jnp.ones(2), jax.random.key(0), 4)
    >>> round(float(spec.top), 4), round(float(spec.bottom), 4)
    (3.0, -5.0)
  """
  ritz_values: jax.Array
  steps: jax.Array

  @property
  def top(self) -> jax.Array:
    """Largest Ritz value, an estimate of the largest algebraic eigenvalue
    from below."""
    return self.ritz_values[-1]

  @property
  def bottom(self) -> jax.Array:
    """Smallest Ritz value, an estimate of the smallest eigenvalue from
    above."""
    return self.ritz_values[0]


def hvp(loss_fn: LossFn, params: Any, v: Any) -> Any:
  """H v: the Hessian of `loss_fn` at `params` times `v` (a pytree like
  `params`), forward over reverse (one jvp of the gradient).

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 + w[1] ** 2)   # H = diag(3, 1)
    >>> curvature.hvp(loss, jnp.ones(2), jnp.array([1.0, 1.0])).tolist()
    [3.0, 1.0]
  """
  return jax.jvp(jax.grad(loss_fn), (params,), (v,))[1]


def tree_dot(a: Any, b: Any) -> jax.Array:
  """sum over leaves of <a, b>, accumulated in float32.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import curvature
    >>> a = {'w': jnp.array([1.0, 2.0]), 'b': jnp.array(3.0, jnp.bfloat16)}
    >>> float(curvature.tree_dot(a, a))
    14.0
  """
  return sum((jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))),
             jnp.zeros((), jnp.float32))


def _normalise(v: Any) -> Any:
  norm = tree_norm.tree_norm_f32(v)
  inverse = jnp.where(norm > 0, 1.0 / norm, 0.0)
  return jax.tree.map(lambda x: (x.astype(jnp.float32) * inverse
                                 ).astype(x.dtype), v)


def _probes(key: jax.Array, params: Any, sampler) -> Any:
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, max(len(leaves), 1))
  return jax.tree.unflatten(treedef, [
      sampler(k, x.shape).astype(x.dtype) for k, x in zip(keys, leaves)])


def power_iteration(loss_fn: LossFn, params: Any, key: jax.Array,
                    num_iters: int = 20, tol: float | None = None
                    ) -> TopEigen:
  """The Hessian's eigenvalue of largest magnitude, and its eigenvector.

  Args:
    loss_fn: a scalar function of `params`.
    params: where the Hessian is taken (a pytree of float arrays).
    key: for the random (Gaussian) start.
    num_iters: the most Hessian-vector products (>= 1).
    tol: stop once |q_k - q_{k-1}| <= tol |q_k| for the Rayleigh quotients
      q of two successive products; None runs all `num_iters`.

  Returns:
    `TopEigen(eigenvalue, vector, iterations)`: the Rayleigh quotient
    v^T H v of the last unit vector v, v, and the products used.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 + w[1] ** 2)   # H = diag(3, 1)
    >>> key = jax.random.key(0)
    >>> top = curvature.power_iteration(loss, jnp.ones(2), key, 50)
    >>> round(float(top.eigenvalue), 4)
    3.0
    >>> concave = lambda w: -2.0 * w[0] ** 2 + 0.5 * w[1] ** 2
    >>> top = curvature.power_iteration(concave, jnp.ones(2), key, 50)
    >>> round(float(top.eigenvalue), 4)   # Largest magnitude; sign kept.
    -4.0
  """
  owner = 'geom.curvature.power_iteration'
  validation.check(owner, 'num_iters', num_iters,
                   lambda n: isinstance(n, int) and n >= 1,
                   'an integer >= 1')
  if tol is not None:
    validation.check(owner, 'tol', tol, lambda t: 0 <= t < 1,
                     'None or in [0, 1)')
  v = _normalise(_probes(key, params, jax.random.normal))
  zero = jnp.zeros((), jnp.float32)

  def cond(carry):
    i, _, _, q, q_prev = carry
    running = i < num_iters
    if tol is None:
      return running
    converged = (i >= 2) & (jnp.abs(q - q_prev) <= tol * jnp.abs(q))
    return running & ~converged

  def body(carry):
    i, v, _, q, _ = carry
    hv = hvp(loss_fn, params, v)
    return i + 1, _normalise(hv), v, tree_dot(v, hv), q

  # The carry keeps the vector whose quotient is q beside the next one.
  iterations, _, vector, q, _ = jax.lax.while_loop(
      cond, body, (jnp.zeros((), jnp.int32), v, v, zero, zero))
  return TopEigen(q, vector, iterations)


def lanczos(loss_fn: LossFn, params: Any, key: jax.Array,
            num_steps: int = 20) -> Spectrum:
  """Ritz values of the Hessian from `num_steps` Lanczos steps.

  The three-term recurrence w = H v_j - beta_j v_{j-1}, alpha_j = <w,
  v_j>, w -= alpha_j v_j, beta_{j+1} = |w|, v_{j+1} = w / beta_{j+1} from a
  random Gaussian v_1, one product per step, three vectors in memory
  (no reorthogonalisation: lost orthogonality repeats converged Ritz
  values, it does not move the extreme ones). A step whose beta is below
  1e-5 of the recurrence's scale ends the space (an invariant subspace:
  its Ritz values are exact eigenvalues).

  Args:
    loss_fn: a scalar function of `params`.
    params: where the Hessian is taken (a pytree of float arrays).
    key: for the random start.
    num_steps: the most Hessian-vector products (>= 1).

  Returns:
    `Spectrum(ritz_values, steps)`; `.top` and `.bottom` are its ends.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> # A concave direction larger in magnitude than the convex one.
    >>> loss = lambda w: 0.5 * (2.0 * w[0] ** 2 + w[1] ** 2 - 9.0 * w[2] ** 2)
    >>> key = jax.random.key(0)
    >>> round(float(curvature.power_iteration(loss, jnp.ones(3), key,
    ...                                       50).eigenvalue), 3)
    -9.0
    >>> round(float(curvature.lanczos(loss, jnp.ones(3), key, 3).top), 3)
    2.0
  """
  validation.check('geom.curvature.lanczos', 'num_steps', num_steps,
                   lambda n: isinstance(n, int) and n >= 1, 'an integer >= 1')
  zero = jnp.zeros((), jnp.float32)
  axpy = lambda a, x, y: jax.tree.map(
      lambda u, w: (a * u.astype(jnp.float32) + w.astype(jnp.float32)
                    ).astype(w.dtype), x, y)

  def body(j, carry):
    v, v_prev, beta, alive, steps, alphas, betas = carry
    w = axpy(-beta, v_prev, hvp(loss_fn, params, v))
    alpha = tree_dot(w, v)
    w = axpy(-alpha, v, w)
    beta_next = tree_norm.tree_norm_f32(w)
    scale = jnp.abs(alpha) + beta + jnp.finfo(jnp.float32).tiny
    alive_next = alive & (beta_next > 1e-5 * scale)
    # Dead steps take alpha_1 with no coupling: a Ritz value in range.
    alphas = alphas.at[j].set(jnp.where(alive, alpha, alphas[0]))
    betas = betas.at[j].set(jnp.where(alive_next, beta_next, 0.0))
    return (_normalise(w), v, beta_next, alive_next,
            steps + alive.astype(jnp.int32), alphas, betas)

  v = _normalise(_probes(key, params, jax.random.normal))
  init = (v, jax.tree.map(jnp.zeros_like, v), zero, jnp.array(True),
          jnp.zeros((), jnp.int32), jnp.zeros(num_steps, jnp.float32),
          jnp.zeros(num_steps, jnp.float32))
  # Step 0 first, so that dead steps can copy alpha_1.
  carry = jax.lax.fori_loop(1, num_steps, body, body(0, init))
  alphas, betas = carry[-2:]
  off = betas[:-1]
  tridiagonal = jnp.diag(alphas) + jnp.diag(off, 1) + jnp.diag(off, -1)
  return Spectrum(jnp.linalg.eigvalsh(tridiagonal), carry[4])


def rayleigh(loss_fn: LossFn, params: Any) -> jax.Array:
  """u^T H u along u = g / |g|, the gradient's direction (one product;
  0 where g = 0). For a positive semi-definite H it lies between the
  smallest and the largest eigenvalue.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 + w[1] ** 2)   # H = diag(3, 1)
    >>> round(float(curvature.rayleigh(loss, jnp.ones(2))), 4)   # g = (3, 1)
    2.8
  """
  u = _normalise(jax.grad(loss_fn)(params))
  return tree_dot(u, hvp(loss_fn, params, u))


def hutchinson_trace(loss_fn: LossFn, params: Any, key: jax.Array,
                     num_samples: int = 32) -> TraceEstimate:
  """tr H by Hutchinson's estimator with Rademacher probes.

  E[z^T H z] = tr H for z with independent +-1 entries; its variance is
  2 sum_{i != j} H_ij^2 (zero for a diagonal H), lower than Gaussian
  probes' 2 |H|_F^2. The probes run one after another (`lax.fori_loop`),
  so memory is that of one product whatever `num_samples`.

  Args:
    loss_fn: a scalar function of `params`.
    params: where the Hessian is taken.
    key: for the probes.
    num_samples: the number of probes (Hessian-vector products), >= 1.

  Returns:
    `TraceEstimate(mean, stderr)`.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import curvature
    >>> loss = lambda w: 0.5 * (3.0 * w[0] ** 2 + w[1] ** 2)   # H = diag(3, 1)
    >>> trace = curvature.hutchinson_trace(loss, jnp.ones(2), jax.random.key(1))
    >>> round(float(trace.mean), 4)
    4.0
  """
  validation.check('geom.curvature.hutchinson_trace', 'num_samples',
                   num_samples, lambda n: isinstance(n, int) and n >= 1,
                   'an integer >= 1')

  def body(i, sums):
    z = _probes(jax.random.fold_in(key, i), params, jax.random.rademacher)
    s = tree_dot(z, hvp(loss_fn, params, z))
    return sums[0] + s, sums[1] + s * s

  zero = jnp.zeros((), jnp.float32)
  total, squares = jax.lax.fori_loop(0, num_samples, body, (zero, zero))
  mean = total / num_samples
  if num_samples == 1:
    return TraceEstimate(mean, zero)
  variance = jnp.maximum(squares - num_samples * mean * mean, 0.0) / (
      num_samples - 1)
  return TraceEstimate(mean, jnp.sqrt(variance / num_samples))
