"""Uses each public method of an installed geom, checked against references.

tests/test_wheel.py copies this file out of the checkout and runs it with
the interpreter of a fresh virtual environment that holds geom's wheel and
its declared dependencies, from a directory outside the checkout, with no
PYTHONPATH (`python -I`). Each check compares with an independent answer
(a closed form, or numpy in float64), not only that the call ran. It
prints one JSON line: the distributions installed and the top-level
modules loaded once every geom module is imported, for the test to check.
With --one-method, only the detector is checked before the imports.

Not a test module of the suite: run only there.
"""

import importlib
import importlib.metadata
import json
import os
import pkgutil
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax

import geom
from geom import conga
from geom import curvature
from geom import gas
from geom import hallucination
from geom import sam
from geom import steering
from geom.kernels import sam_perturb


def close(actual, expected, rtol=1e-5, atol=1e-7, what=''):
  np.testing.assert_allclose(np.asarray(actual, np.float64),
                             np.asarray(expected, np.float64), rtol=rtol,
                             atol=atol, err_msg=what)


def check_installed_copy():
  """geom comes from this environment's site-packages, at its version."""
  purelib = os.path.realpath(sysconfig.get_paths()['purelib'])
  assert os.path.realpath(geom.__file__).startswith(purelib + os.sep), (
      geom.__file__, purelib)
  assert geom.__version__ == importlib.metadata.version('geom'), (
      geom.__version__, importlib.metadata.version('geom'))


# A diagonal quadratic, L(w) = 1/2 sum_i a_i |w_i|^2 over two leaves:
# grad L(w) = a w, so SAM's step has a closed form.
A = {'b': np.array([0.5, 3.0], np.float64),
     'k': np.array([[1.0, 2.0, 0.25], [4.0, 0.5, 1.5]], np.float64)}
W0 = {'b': np.array([1.0, -2.0]),
      'k': np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])}


def quadratic_loss(w):
  return 0.5 * sum(jnp.sum(jnp.asarray(A[k], jnp.float32) * w[k] ** 2)
                   for k in A)


def sam_step_reference(w, lr, rho, scale):
  """w after one SAM step of SGD(lr) followed by optax.scale(scale), and
  |g|, |g+| (numpy, float64)."""
  g = {k: A[k] * w[k] for k in A}
  norm = np.sqrt(sum(np.sum(g[k] ** 2) for k in A))
  g_adv = {k: A[k] * (w[k] + rho * g[k] / norm) for k in A}
  adv_norm = np.sqrt(sum(np.sum(g_adv[k] ** 2) for k in A))
  return ({k: w[k] - scale * lr * g_adv[k] for k in A}, norm, adv_norm)


def check_sam(fused: bool):
  """One jitted SAM step inside optax.chain, with the fused Pallas kernel
  (interpreted on CPU) or without, against the closed form; the
  detector's statistics of the step against |g| and |g+|."""
  lr, rho, scale = 0.1, 0.3, 0.5
  tx = optax.chain(sam.sam(optax.sgd(lr), rho=rho, fused=fused),
                   optax.scale(scale))
  w = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), W0)
  state = tx.init(w)

  @jax.jit
  def step(w, state):
    grad_fn = jax.grad(quadratic_loss)
    updates, state = tx.update(grad_fn(w), state, w, grad_fn=grad_fn)
    return optax.apply_updates(w, updates), state

  new_w, state = step(w, state)
  expected, norm, adv_norm = sam_step_reference(W0, lr, rho, scale)
  for k in A:
    close(new_w[k], expected[k], what=f'SAM step (fused={fused}), {k}')
  d = sam.diagnostics(state)
  assert bool(d['sam_active'])
  close(d['grad_norm'], norm, what='|g|')
  close(d['perturbed_grad_norm'], adv_norm, what='|g+|')
  close(d['grad_ratio'], adv_norm / norm, what='|g+| / |g|')
  return new_w


def check_fused_kernel():
  """The kernel in Pallas's interpreter: w + rho g / |g| and |g|, and
  ASAM's w + rho T^2 g / |T g| with T = |w| + eta."""
  assert sam_perturb.interprets_by_default()  # A CPU backend.
  rng = np.random.default_rng(0)
  w = {'a': rng.normal(size=(3, 5)), 'b': rng.normal(size=(130,))}
  g = {'a': rng.normal(size=(3, 5)), 'b': rng.normal(size=(130,))}
  f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  rho, eta = 0.05, 0.01
  out, norm = sam_perturb.sam_perturb(f32(w), f32(g), rho, interpret=True)
  ref_norm = np.sqrt(sum(np.sum(g[k] ** 2) for k in g))
  close(norm, ref_norm, what='kernel |g|')
  for k in w:
    close(out[k], w[k] + rho * g[k] / ref_norm, what=f'kernel w + e, {k}')
  out, norm = sam_perturb.sam_perturb(f32(w), f32(g), rho, adaptive=True,
                                      eta=eta, interpret=True)
  t = {k: np.abs(w[k]) + eta for k in w}
  ref_norm = np.sqrt(sum(np.sum((t[k] * g[k]) ** 2) for k in g))
  close(norm, ref_norm, what='kernel |T g|')
  for k in w:
    close(out[k], w[k] + rho * t[k] ** 2 * g[k] / ref_norm,
          what=f'kernel ASAM, {k}')


def check_detector():
  """A stall (|g| = 1, |g+| = 0.01) is flagged after exactly `patience`
  SAM steps, with the averaged ratio 0.01; a healthy ratio never is."""
  config = hallucination.DetectorConfig(patience=3)
  update = jax.jit(
      lambda state, sam_step, g, g_adv: hallucination.update(
          state, config, sam_step, g, g_adv, None))
  state = hallucination.init(track_cosine=False)
  flags = []
  for _ in range(4):
    state = update(state, True, 1.0, 0.01)
    flags.append(bool(state.flagged))
  assert flags == [False, False, True, True], flags
  close(state.ratio_ema, 0.01, what='ratio EMA of a constant ratio')
  assert int(state.flagged_steps) == 2 and int(state.sam_steps) == 4
  healthy = hallucination.init(track_cosine=False)
  for _ in range(10):
    healthy = update(healthy, True, 1.0, 0.9)
  assert not bool(healthy.flagged) and int(healthy.streak) == 0
  # A plain step leaves the statistics as they are.
  same = update(state, False, 5.0, 5.0)
  assert int(same.sam_steps) == 4 and bool(same.flagged)


def entropy_reference(logits):
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0),
                 -1)


def check_conga():
  """CONGA's rate from the module's equations, under jit in a chain: step 1
  has SNR 0, so eta = lo = eta_min + (eta_base - eta_min) c; a constant
  update gives SNR 1 at step 2, so eta = hi = eta_max (no progress yet)."""
  base, classes = 1e-3, 10
  logits = jnp.array([[8.0] + [0.0] * 9, [0.0] * 10, [1.0] * 10,
                      [6.0, 5.0] + [0.0] * 8])
  h = conga.entropies_from_logits(logits)
  ref_h = entropy_reference(logits)
  close(h, ref_h, what='entropies')
  c = float(np.mean(ref_h < 0.4 * np.log(classes)))
  assert c == 0.5, c
  tx = optax.chain(optax.identity(), conga.conga(base, num_classes=classes))
  u = jnp.full(4, 1e-3)  # rms 1e-3: the cap tau / rms = 10 is far above.
  state = tx.init(jnp.zeros(4))
  step = jax.jit(lambda u, s: tx.update(u, s, entropies=h))
  updates, state = step(u, state)
  lo = base / 10 + (base - base / 10) * c
  close(updates, -lo * np.asarray(u), what='CONGA step 1 (eta = lo)')
  d = conga.diagnostics(state)
  close(d['conga_confident_fraction'], c, what='confident fraction')
  close(d['conga_snr'], 0.0, what='SNR at step 1')
  updates, state = step(u, state)
  close(conga.diagnostics(state)['conga_snr'], 1.0, what='SNR, constant u')
  close(updates, -10 * base * np.asarray(u), what='CONGA step 2 (eta_max)')


def check_gas():
  """Budgets floor(s_base exp(-alpha / 2 (d - d_0))), admission, loss
  weights, and the curvature GAS reads, on closed forms."""
  difficulties, s_base, alpha = (1.0, 2.0, 3.0, 5.0), 8, 0.8
  options = gas.GasOptions(difficulties=difficulties, s_base=s_base,
                           alpha=alpha, coupling=0.0)
  state = gas.init(options)
  offsets = np.asarray(difficulties) - difficulties[0]
  expected = np.floor(s_base * np.exp(-alpha / 2 * offsets)).astype(int)
  assert gas.budgets(state, options).tolist() == expected.tolist() == [
      8, 5, 3, 1], gas.budgets(state, options)
  for bucket, budget in enumerate(expected):
    assert gas.admit(state, options, bucket, int(budget))
    assert not gas.admit(state, options, bucket, int(budget) + 1)
    close(gas.loss_weight(state, options, bucket),
          np.exp(-alpha / 2 * offsets[bucket]), what='loss weight')
  # Coupling: a curriculum on the hardest bucket tightens every budget by
  # exp(-coupling lam (dbar - dmean)).
  coupled = gas.GasOptions(difficulties=difficulties, s_base=s_base,
                           alpha=alpha, coupling=1.0)
  probs = np.array([0.0, 0.0, 0.0, 1.0])
  tightened = s_base * np.exp(-alpha / 2 * (offsets[-1] - offsets.mean()))
  assert gas.budgets(gas.init(coupled), coupled, probs).tolist() == (
      np.floor(tightened * np.exp(-alpha / 2 * offsets)).astype(int)
      .tolist())
  # |lambda_max| of 1/2 w^T diag(1, 2, 7) w.
  loss = lambda w: 0.5 * jnp.sum(jnp.array([1.0, 2.0, 7.0]) * w * w)
  close(gas.curvature(loss, jnp.ones(3), jax.random.key(0), num_iters=60),
        7.0, rtol=1e-4, what='GAS curvature')


def check_curvature():
  """Top eigenvalue (power iteration), Hessian-vector products and
  Hutchinson's trace on 1/2 w^T H w, against numpy's."""
  rng = np.random.default_rng(1)
  q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
  h = q @ np.diag([6.0, -2.5, 1.0, 0.5, 0.25]) @ q.T
  hj = jnp.asarray(h, jnp.float32)
  loss = lambda w: 0.5 * w @ hj @ w
  w = jnp.asarray(rng.normal(size=5), jnp.float32)
  v = rng.normal(size=5)
  close(curvature.hvp(loss, w, jnp.asarray(v, jnp.float32)), h @ v,
        rtol=1e-5, atol=1e-5, what='H v')
  eigenvalues = np.linalg.eigvalsh(h)
  top = eigenvalues[np.argmax(np.abs(eigenvalues))]
  result = jax.jit(lambda w: curvature.power_iteration(
      loss, w, jax.random.key(0), num_iters=100))(w)
  close(result.eigenvalue, top, rtol=1e-4, what='top eigenvalue')
  vector = np.asarray(result.vector, np.float64)
  close(h @ vector, top * vector, rtol=1e-3, atol=1e-3, what='eigenvector')
  # Rademacher probes give a diagonal Hessian's trace exactly.
  diagonal = jnp.array([3.0, -1.0, 0.5, 2.0])
  estimate = curvature.hutchinson_trace(
      lambda w: 0.5 * jnp.sum(diagonal * w * w), jnp.zeros(4),
      jax.random.key(2), num_samples=8)
  close(estimate.mean, 4.5, what='trace of a diagonal Hessian')
  close(estimate.stderr, 0.0, atol=1e-6, what='its standard error')
  # A full one: within 4 standard errors of np.trace.
  estimate = curvature.hutchinson_trace(loss, w, jax.random.key(3),
                                        num_samples=256)
  assert abs(float(estimate.mean) - np.trace(h)) <= 4 * float(
      estimate.stderr) + 1e-5, (estimate, np.trace(h))


def check_steering():
  """Spherical steering keeps |x| and rotates by the fraction t of the
  angle to mu (the slerp), under jit; the gate leaves tokens already on
  the target's side bit for bit."""
  rng = np.random.default_rng(2)
  dim = 16
  mu = rng.normal(size=dim)
  mu /= np.linalg.norm(mu)
  x = rng.normal(size=(2, 3, dim)) * 3.0
  x[0, 0] = 4.0 * mu + 0.1 * rng.normal(size=dim)  # Near the target.
  xj = jnp.asarray(x, jnp.float32)
  apply = jax.jit(lambda s, x: s(x))
  s = steering.Steering(method='spherical', direction=jnp.asarray(mu),
                        alpha=0.25, gate=False)
  y, stats = apply(s, xj)
  y = np.asarray(y, np.float64)
  close(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5,
        what='norm kept')
  angle = lambda a: np.arccos(np.clip(
      a @ mu / np.linalg.norm(a, axis=-1), -1.0, 1.0))
  close(angle(y), 0.75 * angle(x), rtol=1e-4, atol=1e-5,
        what='angle to mu scaled by 1 - t')
  # The slerp, written out: |x| (cos((1-t) th) mu + sin((1-t) th) u).
  x_hat = x / np.linalg.norm(x, axis=-1, keepdims=True)
  perp = x_hat - (x_hat @ mu)[..., None] * mu
  u = perp / np.linalg.norm(perp, axis=-1, keepdims=True)
  th = 0.75 * angle(x)[..., None]
  slerp = np.linalg.norm(x, axis=-1, keepdims=True) * (
      np.cos(th) * mu + np.sin(th) * u)
  close(y, slerp, rtol=1e-4, atol=1e-4, what='slerp')
  assert float(stats.tokens) == 6 and float(stats.triggered) == 6
  gated = steering.Steering(method='spherical', direction=jnp.asarray(mu),
                            alpha=1.0, kappa=20.0, beta=0.0)
  y, stats = apply(gated, xj)
  toward = np.asarray(x @ mu > 0)
  assert toward[0, 0]
  np.testing.assert_array_equal(np.asarray(y)[toward], np.asarray(xj)[toward])
  close(np.linalg.norm(np.asarray(y, np.float64), axis=-1),
        np.linalg.norm(x, axis=-1), rtol=1e-5, what='norm kept (gated)')
  assert float(stats.triggered) == float(np.sum(~toward))


def import_every_module():
  """Imports every module of geom; returns the top-level modules loaded."""
  names = [m.name for m in pkgutil.walk_packages(geom.__path__, 'geom.')]
  assert {'geom.sam', 'geom.kernels.sam_perturb'} <= set(names), names
  for name in names:
    importlib.import_module(name)
  return names, sorted({m.split('.')[0] for m in sys.modules}
                       - set(sys.stdlib_module_names) - {'__main__'})


def main(argv):
  check_installed_copy()
  if '--one-method' in argv:
    # test_wheel's default test: one method (the cheapest, jitted), then
    # the imports; each method's compiles took 16 s of CPU in all.
    check_detector()
  else:
    plain = check_sam(fused=False)
    fused = check_sam(fused=True)
    for k in A:
      close(fused[k], plain[k], rtol=1e-6, what=f'fused against plain, {k}')
    check_fused_kernel()
    check_detector()
    check_conga()
    check_gas()
    check_curvature()
    check_steering()
  modules, loaded = import_every_module()
  dists = {d.metadata['Name']: d.requires or []
           for d in importlib.metadata.distributions()}
  print(json.dumps({'modules': modules, 'loaded': loaded,
                    'distributions': dists, 'sys_path': sys.path}))


if __name__ == '__main__':
  main(sys.argv[1:])
