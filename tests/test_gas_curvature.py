"""geom.gas's curvature estimators against dense, closed-form and finite
differences: hvp, power_iteration, rayleigh, curvature and fit_alpha.

GAS's alpha is fitted from these estimates, so each is checked against
something that does not share its code: `jnp.linalg.eigh` of
`jax.hessian` on a small MLP whose parameters are a pytree, a quadratic
whose spectrum is chosen (including a negative top eigenvalue, where power
iteration must return the largest magnitude), central differences of the
gradient, and a least-squares slope written out by hand.
"""

import functools

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import pytest

from geom import gas

SEEDS = (0, 1, 2)
# Enough products that the Rayleigh quotient converges to rtol 1e-3 for
# the MLPs below (their ratios |lambda_2 / lambda_1| are 0.76-0.90).
ITERS = 300


def _mlp_loss(params, data):
  x, y = data
  h = jnp.tanh(x @ params['hidden']['w'] + params['hidden']['b'])
  return 0.5 * jnp.mean(jnp.sum((h @ params['out']['w'] + params['out']['b']
                                 - y) ** 2, -1))


def _mlp(seed: int, dtype=jnp.float32):
  """A 4-7-2 tanh MLP (51 parameters in a nested dict) and its squared
  error on random data: an indefinite Hessian with a clear top eigenvalue.

  Returns (params, loss, data), loss(params) = _mlp_loss(params, data).
  """
  k = jax.random.split(jax.random.key(seed), 5)
  params = {
      'hidden': {'w': jax.random.normal(k[0], (4, 7)) / 2,
                 'b': 0.1 * jax.random.normal(k[1], (7,))},
      'out': {'w': jax.random.normal(k[2], (7, 2)) / jnp.sqrt(7.0),
              'b': jnp.zeros(2)},
  }
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  data = (jax.random.normal(k[3], (16, 4)).astype(dtype),
          jax.random.normal(k[4], (16, 2)).astype(dtype))
  return params, functools.partial(_mlp_loss, data=data), data


@functools.partial(jax.jit, static_argnames='num_iters')
def _jitted_power(params, data, key, num_iters):
  """power_iteration under jit, the data an argument: one compile per
  dtype and iteration count for all seeds."""
  return gas.power_iteration(functools.partial(_mlp_loss, data=data), params,
                             key, num_iters)


def _logistic(seed: int):
  """Softmax regression (a convex loss: a PSD Hessian that varies with the
  parameters), parameters a dict."""
  k = jax.random.split(jax.random.key(seed), 4)
  params = {'w': jax.random.normal(k[0], (5, 3)),
            'b': jax.random.normal(k[1], (3,))}
  x = jax.random.normal(k[2], (32, 5))
  labels = jax.random.randint(k[3], (32,), 0, 3)

  def loss(p):
    logp = jax.nn.log_softmax(x @ p['w'] + p['b'])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))

  return params, loss


def _dense(loss, params):
  """(H, unravel): the dense Hessian over the flattened parameters."""
  flat, unravel = ravel_pytree(params)
  return jax.hessian(lambda f: loss(unravel(f)))(flat), unravel


def _top(hessian):
  """The eigenvalue of largest magnitude, its unit eigenvector, and the
  ratio |lambda_2 / lambda_1| (how fast power iteration converges)."""
  w, v = jnp.linalg.eigh(hessian)
  order = np.argsort(-np.abs(np.asarray(w)))
  return (float(w[order[0]]), v[:, order[0]],
          float(abs(w[order[1]] / w[order[0]])))


def _flat(tree):
  return ravel_pytree(jax.tree.map(lambda x: x.astype(jnp.float32), tree))[0]


def _abs_cos(a, b):
  return float(jnp.abs(jnp.vdot(a, b)) / (jnp.linalg.norm(a)
                                          * jnp.linalg.norm(b)))


def _quadratic(eigenvalues, seed: int = 0):
  """0.5 x^T A x over a pytree x (leaves (2,) and (n - 2, 1)), with
  A = Q diag(eigenvalues) Q^T for a random orthogonal Q: (A, Q, loss, x0)."""
  n = len(eigenvalues)
  q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(seed), (n, n)))
  a = (q * jnp.asarray(eigenvalues, jnp.float32)) @ q.T
  a = 0.5 * (a + a.T)
  x0 = {'u': jnp.ones(2), 'v': jnp.arange(n - 2.0).reshape(-1, 1)}

  def loss(x):
    f = _flat(x)
    return 0.5 * f @ a @ f

  return a, q, loss, x0


@pytest.mark.parametrize('seed', SEEDS)
@pytest.mark.parametrize('jit', [False, True])
def test_power_iteration_matches_dense_eigh(seed, jit):
  params, loss, data = _mlp(seed)
  hessian, _ = _dense(loss, params)
  top, vector, ratio = _top(hessian)
  assert ratio < 0.95  # The comparison below converges at ITERS products.
  key = jax.random.key(100 + seed)
  if jit:
    value, v = _jitted_power(params, data, key, num_iters=ITERS)
  else:
    value, v = gas.power_iteration(loss, params, key, num_iters=ITERS)
  assert jax.tree.structure(v) == jax.tree.structure(params)
  np.testing.assert_allclose(float(value), top, rtol=1e-3)
  assert _abs_cos(_flat(v), vector) > 0.99
  np.testing.assert_allclose(float(jnp.linalg.norm(_flat(v))), 1.0, rtol=1e-5)


@pytest.mark.parametrize('eigenvalues', [
    (4.0, -3.0, 1.0, 0.5, 0.25, 0.1),    # Top eigenvalue positive.
    (-5.0, 3.0, 2.0, 1.0, -0.5, 0.2),    # Top magnitude negative.
])
def test_power_iteration_on_a_quadratic_with_known_spectrum(eigenvalues):
  a, q, loss, x0 = _quadratic(eigenvalues)
  top = max(eigenvalues, key=abs)
  index = eigenvalues.index(top)
  value, v = gas.power_iteration(loss, x0, jax.random.key(3), num_iters=200)
  np.testing.assert_allclose(float(value), top, rtol=1e-4)
  assert _abs_cos(_flat(v), q[:, index]) > 0.999
  # curvature reports the magnitude; the rayleigh proxy too.
  np.testing.assert_allclose(
      float(gas.curvature(loss, x0, jax.random.key(3), 'power', 200)),
      abs(top), rtol=1e-4)
  g = a @ _flat(x0)
  expected = float(g @ a @ g / (g @ g))
  np.testing.assert_allclose(
      float(gas.curvature(loss, x0, jax.random.key(3), 'rayleigh')),
      abs(expected), rtol=1e-4)


def test_hvp_of_a_quadratic_is_a_times_v():
  a, _, loss, x0 = _quadratic((4.0, -3.0, 1.0, 0.5, 0.25, 0.1))
  v = jax.tree.map(lambda x: jnp.cos(3.0 * x + 1.0), x0)
  np.testing.assert_allclose(_flat(gas.hvp(loss, x0, v)), a @ _flat(v),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('seed', SEEDS)
def test_hvp_matches_finite_differences_of_the_gradient(seed):
  params, loss, _ = _mlp(seed)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(7 + seed), len(leaves))
  v = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape)
                                   for k, x in zip(keys, leaves)])
  grad = jax.grad(loss)
  eps = 1e-2
  shifted = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, params, v)
  fd = (_flat(grad(shifted(1.0))) - _flat(grad(shifted(-1.0)))) / (2 * eps)
  got = _flat(gas.hvp(loss, params, v))
  # Central differences: O(eps^2) truncation plus float32 rounding.
  scale = float(jnp.linalg.norm(fd))
  assert float(jnp.linalg.norm(got - fd)) < 2e-3 * scale
  # And against the dense Hessian, tightly.
  hessian, _ = _dense(loss, params)
  np.testing.assert_allclose(got, hessian @ _flat(v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('seed', SEEDS)
def test_rayleigh_is_the_gradients_quotient(seed):
  params, loss, _ = _mlp(seed)
  hessian, _ = _dense(loss, params)
  g = _flat(jax.grad(loss)(params))
  expected = float(g @ hessian @ g / (g @ g))
  np.testing.assert_allclose(float(gas.rayleigh(loss, params)), expected,
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(jax.jit(functools.partial(
      gas.rayleigh, loss))(params)), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('seed', SEEDS)
def test_rayleigh_is_at_most_lambda_max_for_a_psd_hessian(seed):
  params, loss = _logistic(seed)
  hessian, _ = _dense(loss, params)
  w = np.linalg.eigvalsh(np.asarray(hessian, np.float64))
  assert w.min() > -1e-5  # The premise: convex, so PSD.
  proxy = float(gas.rayleigh(loss, params))
  assert w.min() - 1e-6 <= proxy <= w.max() * (1 + 1e-5)
  power = float(gas.curvature(loss, params, jax.random.key(seed), 'power',
                              100))
  np.testing.assert_allclose(power, w.max(), rtol=1e-3)


def test_fit_alpha_recovers_the_slope():
  d = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
  for c, alpha in ((0.3, 0.7), (-2.0, -0.25), (1.0, 0.0)):
    assert gas.fit_alpha(d, c + alpha * d) == pytest.approx(alpha, abs=1e-12)
  # Unmeasured (NaN) buckets are left out of the fit.
  y = -1.0 + 0.9 * d
  y[[1, 3]] = np.nan
  assert gas.fit_alpha(d, y) == pytest.approx(0.9, abs=1e-12)
  # Unequal spacing: the least-squares slope, not an endpoint difference.
  d2 = np.array([1.0, 2.0, 4.0])
  y2 = np.array([0.0, 1.0, 1.0])
  dc = d2 - d2.mean()
  assert gas.fit_alpha(d2, y2) == pytest.approx(
      float(dc @ (y2 - y2.mean()) / (dc @ dc)), abs=1e-12)


@pytest.mark.parametrize('log_curvature', [
    [np.nan] * 5, [np.nan, 2.0, np.nan, np.nan, np.nan], [1.0], []])
def test_fit_alpha_is_nan_with_fewer_than_two_buckets(log_curvature):
  d = np.arange(1.0, len(log_curvature) + 1)
  assert np.isnan(gas.fit_alpha(d, log_curvature))


@pytest.mark.parametrize('seed', SEEDS)
def test_power_iteration_in_bfloat16(seed):
  params32, _, data32 = _mlp(seed)
  params16, _, data16 = _mlp(seed, jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params16))
  key = jax.random.key(100 + seed)
  value32, _ = _jitted_power(params32, data32, key, num_iters=ITERS)
  value16, v16 = _jitted_power(params16, data16, key, num_iters=ITERS)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(v16))
  assert np.isfinite(float(value16))
  np.testing.assert_allclose(float(value16), float(value32), rtol=5e-2)
