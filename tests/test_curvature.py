"""geom.curvature (and GAS's use of it) against dense, closed-form and
finite-difference references: hvp, power_iteration, hutchinson_trace,
rayleigh, gas.curvature.

Sharpness figures (RESULTS.md) and GAS's alpha come from these estimates,
so each is checked against something that does not share its code:
`jnp.linalg.eigh` and the trace of `jax.hessian` on a small MLP whose
parameters are a pytree, a quadratic whose spectrum is chosen (including
a negative top eigenvalue, where power iteration must return the largest
magnitude), central differences of the gradient; then on an 8-device mesh
with sharded parameters and batch, and at the edges (H = 0, |H v| = 1e20,
no parameters, bfloat16).
"""

import functools

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from geom import curvature
from geom import gas
from geom import validation

SEEDS = (0, 1, 2)
# Enough products that the Rayleigh quotient converges to rtol 1e-3 for
# the MLPs below (their ratios |lambda_2 / lambda_1| are 0.76-0.90).
ITERS = 300


def _mlp_loss(params, data):
  x, y = data
  h = jnp.tanh(x @ params['hidden']['w'] + params['hidden']['b'])
  return 0.5 * jnp.mean(jnp.sum((h @ params['out']['w'] + params['out']['b']
                                 - y) ** 2, -1))


@jax.jit
def _mlp_normals(seed):
  """_mlp's standard normal draws, in one program for all seeds (eagerly,
  each draw and each indexing of the keys compiles for itself)."""
  k = jax.random.split(jax.random.key(seed), 5)
  return [jax.random.normal(key, shape) for key, shape in
          zip(k, ((4, 7), (7,), (7, 2), (16, 4), (16, 2)))]


def _mlp(seed: int, dtype=jnp.float32):
  """A 4-7-2 tanh MLP (51 parameters in a nested dict) and its squared
  error on random data: an indefinite Hessian with a clear top eigenvalue.

  Returns (params, loss, data), loss(params) = _mlp_loss(params, data).
  """
  # The scaling in float32 numpy: the same roundings as jnp's.
  z = [np.asarray(x) for x in _mlp_normals(seed)]
  params = {
      'hidden': {'w': z[0] / np.float32(2),
                 'b': np.float32(0.1) * z[1]},
      'out': {'w': z[2] / np.sqrt(np.float32(7.0)),
              'b': np.zeros(2, np.float32)},
  }
  params = jax.tree.map(lambda x: jnp.asarray(x.astype(dtype)), params)
  data = (jnp.asarray(z[3].astype(dtype)), jnp.asarray(z[4].astype(dtype)))
  return params, functools.partial(_mlp_loss, data=data), data


@functools.partial(jax.jit, static_argnames='num_iters')
def _jitted_power(params, data, key, num_iters):
  """power_iteration under jit, the data an argument: one compile per
  dtype and iteration count for all seeds."""
  return curvature.power_iteration(functools.partial(_mlp_loss, data=data), params,
                             key, num_iters)


@jax.jit
def _logistic_arrays(seed):
  k = jax.random.split(jax.random.key(seed), 4)
  params = {'w': jax.random.normal(k[0], (5, 3)),
            'b': jax.random.normal(k[1], (3,))}
  x = jax.random.normal(k[2], (32, 5))
  labels = jax.random.randint(k[3], (32,), 0, 3)
  return params, (x, labels)


def _logistic_loss(p, data):
  x, labels = data
  logp = jax.nn.log_softmax(x @ p['w'] + p['b'])
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))


def _logistic(seed: int):
  """Softmax regression (a convex loss: a PSD Hessian that varies with the
  parameters), parameters a dict: (params, loss, data), loss(params) =
  _logistic_loss(params, data)."""
  params, data = _logistic_arrays(seed)
  return params, functools.partial(_logistic_loss, data=data), data


# The references and the estimators under jit, as the product runs the
# estimators (eagerly, each op of the loss, its gradient and its Hessian
# compiles for itself, per shape): `loss(params, data)` is a module-level
# function, so that one compile serves every seed. The tests that are about
# the un-jitted call make it un-jitted.
@functools.partial(jax.jit, static_argnums=0)
def _hessian(loss, params, data):
  flat, unravel = ravel_pytree(params)
  return jax.hessian(lambda f: loss(unravel(f), data))(flat)


def _dense(loss, params, data):
  """The dense Hessian of loss(., data) over the flattened parameters
  (numpy float32)."""
  return np.asarray(_hessian(loss, params, data))


@functools.partial(jax.jit, static_argnums=0)
def _grad(loss, params, data):
  return jax.grad(loss)(params, data)


@functools.partial(jax.jit, static_argnums=0)
def _hvp(loss, params, data, v):
  return curvature.hvp(lambda p: loss(p, data), params, v)


@functools.partial(jax.jit, static_argnums=0)
def _rayleigh(loss, params, data):
  return curvature.rayleigh(lambda p: loss(p, data), params)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _power(loss, params, data, key, num_iters):
  return curvature.power_iteration(lambda p: loss(p, data), params, key,
                                   num_iters)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _hutchinson(loss, params, data, key, num_samples):
  return curvature.hutchinson_trace(lambda p: loss(p, data), params, key,
                                    num_samples)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _gas_curvature(loss, params, data, key, method, num_iters=20):
  return gas.curvature(lambda p: loss(p, data), params, key, method,
                       num_iters)


@jax.jit
def _normal_like(key, params):
  """A standard normal tree like `params` (a key per leaf)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape)
                                      for k, x in zip(keys, leaves)])


def _top(hessian):
  """The eigenvalue of largest magnitude, its unit eigenvector, and the
  ratio |lambda_2 / lambda_1| (how fast power iteration converges), from
  numpy's float64 eigh."""
  w, v = np.linalg.eigh(np.asarray(hessian, np.float64))
  order = np.argsort(-np.abs(w))
  return (float(w[order[0]]), v[:, order[0]],
          float(abs(w[order[1]] / w[order[0]])))


def _flat(tree):
  return ravel_pytree(jax.tree.map(lambda x: x.astype(jnp.float32), tree))[0]


def _np_flat(tree):
  """_flat in numpy (the same order: the tree's leaves, each raveled)."""
  return np.concatenate([np.asarray(x, np.float32).ravel()
                         for x in jax.tree.leaves(tree)])


def _abs_cos(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(np.vdot(a, b)) / (np.linalg.norm(a)
                                        * np.linalg.norm(b)))


@jax.jit
def _quadratic_arrays(eigenvalues, seed):
  n = eigenvalues.shape[0]
  q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(seed), (n, n)))
  a = (q * eigenvalues) @ q.T
  a = 0.5 * (a + a.T)
  return a, q


def _quadratic_loss(x, a):
  f = _flat(x)
  return 0.5 * f @ a @ f


def _quadratic(eigenvalues, seed: int = 0):
  """0.5 x^T A x over a pytree x (leaves (2,) and (n - 2, 1)), with
  A = Q diag(eigenvalues) Q^T for a random orthogonal Q: (A, Q, loss, x0);
  loss(x) = _quadratic_loss(x, A). A and Q are numpy float32."""
  n = len(eigenvalues)
  a, q = _quadratic_arrays(np.asarray(eigenvalues, np.float32), seed)
  a, q = np.asarray(a), np.asarray(q)
  x0 = {'u': np.ones(2, np.float32),
        'v': np.arange(n - 2.0, dtype=np.float32).reshape(-1, 1)}
  return a, q, functools.partial(_quadratic_loss, a=a), x0


def _jit_cases(slow_eager_seeds):
  """(jit, seed) for every seed, jitted and not; the unjitted ones of
  `slow_eager_seeds` marked slow: outside jit the same lax loop compiles
  apart (3.5 s of CPU for power iteration's first), for no other path."""
  return [pytest.param(jit, seed, marks=pytest.mark.slow)
          if not jit and seed in slow_eager_seeds else (jit, seed)
          for jit in (False, True) for seed in SEEDS]


# Unjitted power iteration runs by default on the quadratics below
# (test_power_iteration_stops_early_at_tol compares it with its jitted
# run's iterations).
@pytest.mark.parametrize('jit, seed', _jit_cases(SEEDS))
def test_power_iteration_matches_dense_eigh(seed, jit):
  params, loss, data = _mlp(seed)
  hessian = _dense(_mlp_loss, params, data)
  top, vector, ratio = _top(hessian)
  assert ratio < 0.95  # The comparison below converges at ITERS products.
  key = jax.random.key(100 + seed)
  if jit:
    value, v, _ = _jitted_power(params, data, key, num_iters=ITERS)
  else:
    value, v, _ = curvature.power_iteration(loss, params, key, num_iters=ITERS)
  assert jax.tree.structure(v) == jax.tree.structure(params)
  np.testing.assert_allclose(float(value), top, rtol=1e-3)
  assert _abs_cos(_np_flat(v), vector) > 0.99
  np.testing.assert_allclose(float(np.linalg.norm(_np_flat(v))), 1.0,
                             rtol=1e-5)


@pytest.mark.parametrize('eigenvalues', [
    (4.0, -3.0, 1.0, 0.5, 0.25, 0.1),    # Top eigenvalue positive.
    (-5.0, 3.0, 2.0, 1.0, -0.5, 0.2),    # Top magnitude negative.
])
def test_power_iteration_on_a_quadratic_with_known_spectrum(eigenvalues):
  a, q, _, x0 = _quadratic(eigenvalues)
  top = max(eigenvalues, key=abs)
  index = eigenvalues.index(top)
  value, v, _ = _power(_quadratic_loss, x0, a, jax.random.key(3), 200)
  np.testing.assert_allclose(float(value), top, rtol=1e-4)
  assert _abs_cos(_np_flat(v), q[:, index]) > 0.999
  # curvature reports the magnitude; the rayleigh proxy too.
  np.testing.assert_allclose(
      float(_gas_curvature(_quadratic_loss, x0, a, jax.random.key(3), 'power',
                           200)),
      abs(top), rtol=1e-4)
  g = a @ _np_flat(x0)
  expected = float(g @ a @ g / (g @ g))
  np.testing.assert_allclose(
      float(_gas_curvature(_quadratic_loss, x0, a, jax.random.key(3),
                           'rayleigh')),
      abs(expected), rtol=1e-4)


def test_hvp_of_a_quadratic_is_a_times_v():
  a, _, _, x0 = _quadratic((4.0, -3.0, 1.0, 0.5, 0.25, 0.1))
  v = jax.tree.map(lambda x: np.cos(np.float32(3.0) * x + np.float32(1.0)),
                   x0)
  np.testing.assert_allclose(_np_flat(_hvp(_quadratic_loss, x0, a, v)),
                             a @ _np_flat(v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('seed', SEEDS)
def test_hvp_matches_finite_differences_of_the_gradient(seed):
  params, _, data = _mlp(seed)
  v = jax.device_get(_normal_like(jax.random.key(7 + seed), params))
  grad = lambda p: _grad(_mlp_loss, p, data)
  eps = 1e-2
  shifted = lambda s: jax.tree.map(
      lambda p, d: np.asarray(p) + np.float32(s * eps) * d, params, v)
  fd = (_np_flat(grad(shifted(1.0))) - _np_flat(grad(shifted(-1.0)))) / (
      np.float32(2 * eps))
  got = _np_flat(_hvp(_mlp_loss, params, data, v))
  # Central differences: O(eps^2) truncation plus float32 rounding.
  scale = float(np.linalg.norm(fd))
  assert float(np.linalg.norm(got - fd)) < 2e-3 * scale
  # And against the dense Hessian, tightly.
  hessian = _dense(_mlp_loss, params, data)
  np.testing.assert_allclose(got, hessian @ _np_flat(v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('seed', SEEDS)
def test_rayleigh_is_the_gradients_quotient(seed):
  params, loss, data = _mlp(seed)
  hessian = _dense(_mlp_loss, params, data)
  g = _np_flat(_grad(_mlp_loss, params, data))
  expected = float(g @ hessian @ g / (g @ g))
  np.testing.assert_allclose(float(curvature.rayleigh(loss, params)), expected,
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(_rayleigh(_mlp_loss, params, data)),
                             expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('seed', SEEDS)
def test_rayleigh_is_at_most_lambda_max_for_a_psd_hessian(seed):
  params, _, data = _logistic(seed)
  hessian = _dense(_logistic_loss, params, data)
  w = np.linalg.eigvalsh(np.asarray(hessian, np.float64))
  assert w.min() > -1e-5  # The premise: convex, so PSD.
  proxy = float(_rayleigh(_logistic_loss, params, data))
  assert w.min() - 1e-6 <= proxy <= w.max() * (1 + 1e-5)
  power = float(_gas_curvature(_logistic_loss, params, data,
                               jax.random.key(seed), 'power', 100))
  np.testing.assert_allclose(power, w.max(), rtol=1e-3)


@pytest.mark.parametrize('seed', SEEDS)
def test_power_iteration_in_bfloat16(seed):
  params32, _, data32 = _mlp(seed)
  params16, _, data16 = _mlp(seed, jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params16))
  key = jax.random.key(100 + seed)
  value32, _, _ = _jitted_power(params32, data32, key, num_iters=ITERS)
  value16, v16, _ = _jitted_power(params16, data16, key, num_iters=ITERS)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(v16))
  assert np.isfinite(float(value16))
  np.testing.assert_allclose(float(value16), float(value32), rtol=5e-2)


@pytest.mark.parametrize('seed', SEEDS)
def test_hutchinson_trace_matches_the_dense_trace(seed):
  params, _, data = _mlp(seed)
  hessian = _dense(_mlp_loss, params, data)
  exact = float(np.trace(hessian))
  n = 2000
  estimate = _hutchinson(_mlp_loss, params, data, jax.random.key(seed), n)
  # The estimator's own spread, from the dense H: var z^T H z =
  # 2 sum_{i != j} H_ij^2 for Rademacher z.
  h = np.asarray(hessian, np.float64)
  sigma = np.sqrt(2 * (np.sum(h * h) - np.sum(np.diag(h) ** 2)) / n)
  assert abs(float(estimate.mean) - exact) < 4 * sigma
  np.testing.assert_allclose(float(estimate.stderr), sigma, rtol=0.15)
  del data


def test_hutchinson_trace_is_exact_for_a_diagonal_hessian():
  """z_i^2 = 1: every probe gives tr H, so the standard error is 0."""
  d = np.asarray([3.0, -1.0, 0.5, 2.0, 7.0], np.float32)
  loss = lambda w, d: 0.5 * jnp.sum(d * w['x'] ** 2) + jnp.sum(w['y'] ** 2)
  w = {'x': np.ones(5, np.float32), 'y': np.ones((2, 3), np.float32)}
  est = _hutchinson(loss, w, d, jax.random.key(0), 8)
  np.testing.assert_allclose(float(est.mean), float(d.sum()) + 12.0,
                             rtol=1e-6)
  assert float(est.stderr) == pytest.approx(0.0, abs=1e-5)
  one = _hutchinson(loss, w, d, jax.random.key(0), 1)
  assert float(one.stderr) == 0.0


def test_power_iteration_stops_early_at_tol():
  a, _, loss, x0 = _quadratic((10.0, 1.0, 0.5, 0.25, 0.1, 0.05))
  full = curvature.power_iteration(loss, x0, jax.random.key(1), 200)
  early = curvature.power_iteration(loss, x0, jax.random.key(1), 200,
                                    tol=1e-6)
  assert int(full.iterations) == 200
  assert 2 <= int(early.iterations) < 60
  np.testing.assert_allclose(float(early.eigenvalue), 10.0, rtol=1e-5)
  jitted = jax.jit(lambda x, k: curvature.power_iteration(
      loss, x, k, 200, tol=1e-6))(x0, jax.random.key(1))
  assert int(jitted.iterations) == int(early.iterations)
  del a


def test_power_iteration_runs_exactly_num_iters_products():
  calls = []
  a, _, loss, x0 = _quadratic((4.0, 1.0, 0.5, 0.25, 0.1, 0.05))

  def counted(x):
    jax.debug.callback(lambda: calls.append(1))
    return loss(x)

  # The loss runs once per product (the jvp of its gradient).
  top = curvature.power_iteration(counted, x0, jax.random.key(0), 7)
  jax.effects_barrier()
  assert int(top.iterations) == 7 and len(calls) == 7
  del a


def _sharded_problem():
  """A 2-layer MLP on a (4, 2) mesh: the batch split over 'data', the
  hidden layer over 'model'; and the same unsharded."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2),
                           ('data', 'model'))
  k = jax.random.split(jax.random.key(5), 4)
  params = {'w1': jax.random.normal(k[0], (6, 16)) / 3,
            'w2': jax.random.normal(k[1], (16, 3)) / 4}
  x = jax.random.normal(k[2], (32, 6))
  y = jax.random.normal(k[3], (32, 3))
  specs = {'w1': P(None, 'model'), 'w2': P('model', None)}
  sharded = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                         params, specs)
  xs = jax.device_put(x, NamedSharding(mesh, P('data', None)))
  ys = jax.device_put(y, NamedSharding(mesh, P('data', None)))

  def loss(p, x, y):
    return 0.5 * jnp.mean(jnp.sum((jnp.tanh(x @ p['w1']) @ p['w2'] - y) ** 2,
                                  -1))

  return mesh, params, (x, y), sharded, (xs, ys), loss


def test_estimators_on_a_sharded_mesh_equal_the_unsharded_ones():
  mesh, params, (x, y), sharded, (xs, ys), loss = _sharded_problem()
  assert len(sharded['w1'].sharding.device_set) == 8

  @jax.jit
  def estimates(p, x, y, key):
    f = lambda q: loss(q, x, y)
    top = curvature.power_iteration(f, p, key, 100)
    return (top.eigenvalue, top.vector,
            curvature.hutchinson_trace(f, p, key, 16).mean,
            curvature.rayleigh(f, p),
            curvature.hvp(f, p, jax.tree.map(jnp.ones_like, p)))

  key = jax.random.key(0)
  want = estimates(params, x, y, key)
  got = estimates(sharded, xs, ys, key)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4,
                               atol=1e-6)
  hessian = _dense(lambda p, data: loss(p, *data), params, (x, y))
  np.testing.assert_allclose(float(got[0]), _top(hessian)[0], rtol=1e-3)
  # The products stay on the mesh (the same devices as the parameters).
  for leaf in jax.tree.leaves(got[4]):
    assert len(leaf.sharding.device_set) == 8
  del mesh


def test_a_zero_hessian_gives_zero_not_nan():
  loss = lambda w, data: jnp.sum(3.0 * w['a']) + 2.0
  w = {'a': np.ones((3, 2), np.float32)}
  top = _power(loss, w, None, jax.random.key(0), 5)
  assert float(top.eigenvalue) == 0.0
  assert all(np.all(np.isfinite(np.asarray(x)))
             for x in jax.tree.leaves(top.vector))
  assert float(_rayleigh(loss, w, None)) == 0.0
  assert float(_hutchinson(loss, w, None, jax.random.key(0), 4).mean) == 0.0


def test_huge_curvature_and_gradient_do_not_overflow():
  """|H v| and |g| about 1e20: a plain float32 norm overflows there."""
  scale = 1e20
  a, _, _, x0 = _quadratic((4.0, 1.0, 0.5, 0.25, 0.1, 0.05))
  big = lambda x, a: scale * _quadratic_loss(x, a)
  top = _power(big, x0, a, jax.random.key(0), 200)
  np.testing.assert_allclose(float(top.eigenvalue), 4.0 * scale, rtol=1e-4)
  g = a @ _np_flat(x0)
  np.testing.assert_allclose(float(_rayleigh(big, x0, a)),
                             scale * float(g @ a @ g / (g @ g)), rtol=1e-4)


def test_no_parameters():
  loss = lambda w: jnp.zeros(())
  top = curvature.power_iteration(loss, {}, jax.random.key(0), 3)
  assert float(top.eigenvalue) == 0.0 and top.vector == {}
  assert float(curvature.hutchinson_trace(loss, {}, jax.random.key(0), 2).mean
               ) == 0.0


@pytest.mark.parametrize('call, field', [
    (lambda f, w: curvature.power_iteration(f, w, jax.random.key(0), 0),
     'num_iters'),
    (lambda f, w: curvature.power_iteration(f, w, jax.random.key(0), 2.5),
     'num_iters'),
    (lambda f, w: curvature.power_iteration(f, w, jax.random.key(0), 5,
                                            tol=1.5), 'tol'),
    (lambda f, w: curvature.hutchinson_trace(f, w, jax.random.key(0), 0),
     'num_samples'),
])
def test_bad_arguments_name_the_field(call, field):
  with pytest.raises(validation.ArgumentError, match=field):
    call(lambda w: jnp.sum(w ** 2), jnp.ones(3))


def test_hutchinson_in_bfloat16():
  params32, _, data32 = _mlp(0)
  params16, _, data16 = _mlp(0, jnp.bfloat16)
  exact = float(np.trace(_dense(_mlp_loss, params32, data32)))
  est = _hutchinson(_mlp_loss, params16, data16, jax.random.key(0), 400)
  assert est.mean.dtype == jnp.float32
  assert abs(float(est.mean) - exact) < 4 * float(est.stderr) + 0.05 * abs(exact)


def _bilinear(w, data):
  del data
  return w[0] * w[1]


@pytest.mark.parametrize('n', [2, 3, 5])
def test_hutchinson_stderr_is_the_sample_standard_error(n):
  """loss = w0 w1: every probe gives z^T H z = 2 z0 z1 = +-2, so the mean
  fixes how many were +2, and with it the exact sample standard error."""
  for seed in range(6):
    est = _hutchinson(_bilinear, np.ones(2, np.float32), None,
                      jax.random.key(seed), n)
    plus = round(n * (float(est.mean) / 2 + 1) / 2)
    values = np.array([2.0] * plus + [-2.0] * (n - plus))
    np.testing.assert_allclose(float(est.mean), values.mean(), atol=1e-6)
    np.testing.assert_allclose(float(est.stderr),
                               values.std(ddof=1) / np.sqrt(n), atol=1e-5)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _lanczos(loss, params, data, key, num_steps):
  return curvature.lanczos(lambda p: loss(p, data), params, key, num_steps)


@pytest.mark.parametrize('jit, seed', _jit_cases(SEEDS[1:]))
def test_lanczos_ends_match_dense_eigh_on_the_mlp(seed, jit):
  # 51 parameters, 30 steps: both ends of an indefinite spectrum.
  params, loss, data = _mlp(seed)
  eigenvalues = np.linalg.eigvalsh(np.asarray(_dense(_mlp_loss, params, data),
                                              np.float64))
  key = jax.random.key(200 + seed)
  spec = (_lanczos(_mlp_loss, params, data, key, 30) if jit
          else curvature.lanczos(loss, params, key, 30))
  scale = np.abs(eigenvalues).max()
  assert float(spec.top) == pytest.approx(eigenvalues[-1], abs=1e-3 * scale)
  assert float(spec.bottom) == pytest.approx(eigenvalues[0],
                                             abs=1e-3 * scale)
  # Ritz values lie inside the spectrum (interlacing).
  ritz = np.asarray(spec.ritz_values)
  assert np.all(np.diff(ritz) >= 0)
  assert ritz[0] >= eigenvalues[0] - 1e-3 * scale
  assert ritz[-1] <= eigenvalues[-1] + 1e-3 * scale


@pytest.mark.parametrize('eigenvalues', [
    (-9.0, 2.0, 1.0, 0.5, -0.5, 0.1),    # Power iteration finds -9.
    (4.0, -3.0, 1.0, 0.5, 0.25, 0.1),
])
def test_lanczos_finds_the_largest_positive_eigenvalue(eigenvalues):
  a, _, _, x0 = _quadratic(eigenvalues)
  spec = _lanczos(_quadratic_loss, x0, a, jax.random.key(4), 6)
  np.testing.assert_allclose(float(spec.top), max(eigenvalues), rtol=1e-4)
  np.testing.assert_allclose(float(spec.bottom), min(eigenvalues), rtol=1e-4)
  np.testing.assert_allclose(np.asarray(spec.ritz_values),
                             np.sort(eigenvalues), rtol=1e-3, atol=1e-4)
  top = _power(_quadratic_loss, x0, a, jax.random.key(4), 200)
  assert float(top.eigenvalue) == pytest.approx(max(eigenvalues, key=abs),
                                                rel=1e-4)


def test_lanczos_stops_when_the_krylov_space_is_exhausted():
  # Three distinct eigenvalues: the space ends after 3 steps; the 7 steps
  # left add no spurious value outside the spectrum (no 0 here).
  a, _, _, x0 = _quadratic((3.0, 3.0, 2.0, 2.0, 5.0, 5.0))
  spec = _lanczos(_quadratic_loss, x0, a, jax.random.key(0), 10)
  assert int(spec.steps) == 3
  np.testing.assert_allclose(float(spec.top), 5.0, rtol=1e-4)
  np.testing.assert_allclose(float(spec.bottom), 2.0, rtol=1e-4)
  assert np.all(np.asarray(spec.ritz_values) >= 2.0 - 1e-4)


def test_lanczos_at_the_edges():
  zero = lambda w, data: jnp.sum(3.0 * w['a']) + 2.0
  spec = _lanczos(zero, {'a': np.ones((3, 2), np.float32)}, None,
                  jax.random.key(0), 5)
  assert np.all(np.asarray(spec.ritz_values) == 0.0)
  a, _, _, x0 = _quadratic((4.0, -1.0, 0.5, 0.25, 0.1, 0.05))
  big = lambda x, a: 1e20 * _quadratic_loss(x, a)
  spec = _lanczos(big, x0, a, jax.random.key(0), 6)
  np.testing.assert_allclose(float(spec.top), 4e20, rtol=1e-4)
  np.testing.assert_allclose(float(spec.bottom), -1e20, rtol=1e-4)
  assert float(curvature.lanczos(lambda w: jnp.zeros(()), {},
                                 jax.random.key(0), 3).top) == 0.0
  # bfloat16 parameters: the vectors keep the dtype, the ends are close.
  params, _, data = _mlp(0)
  half = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
  eigenvalues = np.linalg.eigvalsh(np.asarray(_dense(_mlp_loss, params, data),
                                              np.float64))
  spec = _lanczos(_mlp_loss, half, data, jax.random.key(1), 30)
  assert spec.ritz_values.dtype == jnp.float32
  assert float(spec.top) == pytest.approx(eigenvalues[-1], rel=0.1)
  with pytest.raises(validation.ArgumentError, match='num_steps'):
    curvature.lanczos(lambda w: jnp.sum(w ** 2), jnp.ones(3),
                      jax.random.key(0), 0)
