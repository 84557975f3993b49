"""geom.steering against closed forms and plain loops: slerp, the gate, masks,
extraction, centring, the gate's calibration and its histogram."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geom import steering as st
from geom import validation


def _slerp64(a, b, t):
  """The textbook slerp of unit vectors a, b (float64)."""
  omega = np.arccos(np.clip(np.dot(a, b), -1, 1))
  if omega < 1e-9:
    return a
  return (np.sin((1 - t) * omega) * a + np.sin(t * omega) * b) / np.sin(omega)


def _random(shape, seed):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# The product's functions run jitted (eagerly each of their ops compiles on
# its own): one program per shape and static configuration, shared by every
# test. The operator is a pytree (direction, alpha, ... are leaves).
_slerp = jax.jit(st.slerp_rotate)
_gate = jax.jit(st.gate)
_unit = jax.jit(st.unit)
_apply = jax.jit(lambda op, x: op(x))
_apply_masked = jax.jit(lambda op, x, m: op(x, m))


@pytest.mark.parametrize('t', [0.0, 0.1, 0.5, 0.9, 1.0])
def test_rotation_equals_slerp_and_keeps_the_norm(t):
  x = _random((64, 16), 0) * 3.0
  mu = _random((16,), 1)
  mu /= np.linalg.norm(mu)
  out = np.asarray(_slerp(x, mu, np.full((64,), t, np.float32)))
  norms = np.linalg.norm(x, axis=-1)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), norms, rtol=1e-5)
  for i in range(64):
    ref = norms[i] * _slerp64(x[i].astype(np.float64) / norms[i],
                              mu.astype(np.float64), t)
    np.testing.assert_allclose(out[i], ref, atol=2e-5 * norms[i])


def test_t0_is_identity_and_t1_lands_on_the_target():
  x = jnp.asarray(_random((2, 5, 8), 2))
  mu = jnp.asarray(_random((8,), 3))
  ident, stats = _apply(st.Steering('spherical', mu, alpha=0.0, gate=False), x)
  np.testing.assert_array_equal(ident, x)  # Bit for bit.
  assert float(stats.triggered) == 0
  full, _ = _apply(st.Steering('spherical', mu, alpha=1.0, gate=False), x)
  unit = np.asarray(mu) / np.linalg.norm(mu)
  directions = np.asarray(full) / np.linalg.norm(full, axis=-1, keepdims=True)
  np.testing.assert_allclose(directions, np.broadcast_to(unit, x.shape),
                             atol=1e-5)


def test_gate_equals_the_reference_softmax_and_minus_tanh():
  kappa, alpha, beta = 20.0, 0.7, 0.2
  x = _random((200, 8), 4)
  mu = _random((8,), 5)
  mu /= np.linalg.norm(mu)
  c = (x @ mu) / np.linalg.norm(x, axis=-1)
  # The reference: softmax over [kappa <x, mu_T>, kappa <x, mu_H>], mu_H = -mu_T.
  logits = np.stack([kappa * c, kappa * -c], -1).astype(np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  delta_ref = p[:, 1] - p[:, 0]
  np.testing.assert_allclose(delta_ref, -np.tanh(kappa * c), atol=1e-7)
  delta, t = _gate(c, alpha=alpha, kappa=kappa, beta=beta)
  np.testing.assert_allclose(delta, delta_ref, atol=1e-6)
  t_ref = np.where(delta_ref > beta,
                   np.clip(alpha * (delta_ref - beta) / (1 - beta), 0, 1), 0)
  np.testing.assert_allclose(t, t_ref, atol=1e-6)
  assert 0 < np.mean(t_ref > 0) < 1  # Both branches exercised.
  # The operator rotates by exactly that t and leaves the rest alone.
  out, stats = _apply(st.Steering('spherical', mu, alpha=alpha, kappa=kappa,
                                  beta=beta), x)
  out = np.asarray(out)
  off = t_ref == 0
  np.testing.assert_array_equal(out[off], x[off])
  on = np.flatnonzero(~off)
  ref = np.asarray(_slerp(x[on], mu, t_ref[on].astype(np.float32)))
  np.testing.assert_allclose(out[on], ref, atol=1e-5)
  assert float(stats.triggered) == on.size
  np.testing.assert_allclose(float(stats.t_sum), t_ref.sum(), rtol=1e-5)


@pytest.mark.parametrize('noise', [0.0, 1e-7, 1e-4])
def test_theta_near_pi_is_finite_and_geodesic(noise):
  mu = np.zeros(6, np.float32)
  mu[2] = 1.0
  x = (-2.5 * mu + noise * _random((6,), 6)).astype(np.float32)
  for t in (0.25, 0.5, 1.0):
    out = np.asarray(_slerp(x, mu, np.float32(t)))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(np.linalg.norm(out), np.linalg.norm(x),
                               rtol=1e-5)
    # Angle to the target shrinks to (1 - t) * pi.
    cos = out @ mu / np.linalg.norm(out)
    np.testing.assert_allclose(np.arccos(np.clip(cos, -1, 1)),
                               (1 - t) * np.pi, atol=2e-3)


_EPS32 = float(np.finfo(np.float32).eps)
# bfloat16 keeps 8 significant bits: rounding the output moves each entry by
# at most 2^-9 of itself, so the norm by 2^-9 and the angle by 2^-9 rad.
_BF16_ROUNDING = 2.0 ** -9
_TS = (0.1, 0.25, 0.3, 0.7, 0.5, 1.0)
_ANGLES = (np.pi, np.pi - 1e-4, np.pi - 1e-2, 1e-5, 1e-4, 1e-3, 0.3, 1.0,
           2.0, 3.0)
# Closer to pi than this, x in float32 fixes the rotation plane only to
# about eps / (pi - theta) >= 1%: there the plane-independent quantities
# (norm, angle to mu) are compared, not the vector.
_PLANE_DEFINED = 1e-5


def _rotate_toward64(x, mu, t):
  """(x rotated toward mu by t of their angle, the angle), in float64.

  Built from x's side (the unit tangent at x pointing to mu), not from mu's
  as geom.steering is. At theta = pi any plane holding mu is valid and the
  vector is None.
  """
  x = np.asarray(x, np.float64)
  mu = np.asarray(mu, np.float64)
  mu = mu / np.linalg.norm(mu)
  r = np.linalg.norm(x)
  x_hat = x / r
  w = mu - (mu @ x_hat) * x_hat
  w -= (w @ x_hat) * x_hat
  theta = np.arctan2(np.linalg.norm(w), mu @ x_hat)
  if not np.linalg.norm(w) > 0:
    return None, theta  # x = -r mu exactly: no plane to compare against.
  w /= np.linalg.norm(w)
  return r * (np.cos(t * theta) * x_hat + np.sin(t * theta) * w), theta


def _angle64(y, mu):
  """Angle between y and mu in float64, accurate near 0 and pi (atan2)."""
  y = np.asarray(y, np.float64)
  mu = np.asarray(mu, np.float64) / np.linalg.norm(mu)
  return np.arctan2(np.linalg.norm(y - (y @ mu) * mu), y @ mu)


def _directions(dim):
  """Three random directions and one axis-aligned one (the old tests' kind)."""
  out = [_random((dim,), 100 + seed) for seed in range(3)]
  out.append(np.eye(dim, dtype=np.float32)[dim // 3])
  return out


def _inputs_at_angles(direction, dtype, seed):
  """Rows of x at each of _ANGLES from `direction` (3 random planes each)."""
  rng = np.random.default_rng(seed)
  mu64 = direction.astype(np.float64) / np.linalg.norm(direction)
  rows = []
  for theta in _ANGLES:
    for _ in range(3):
      r = 2.0 ** rng.integers(-2, 6)
      if theta == np.pi:
        # -r * direction is exactly antiparallel in float32 and bfloat16
        # (r is a power of two and the direction is representable).
        rows.append(-r * direction.astype(np.float64))
        continue
      v = rng.normal(size=direction.size)
      v -= (v @ mu64) * mu64
      v /= np.linalg.norm(v)
      rows.append(r * (np.cos(theta) * mu64 + np.sin(theta) * v))
  return jnp.asarray(np.stack(rows), dtype)


# Op by op at the larger sizes is `slow` (docs/slow_tests.md): the same
# ops as at 16 (eager) and at every size under jit, which stay.
@pytest.mark.parametrize('dtype, jit, dim', [
    pytest.param(dtype, jit, dim,
                 id=f"{dtype}-{'jit' if jit else 'eager'}-{dim}",
                 marks=() if jit or dim == 16 else pytest.mark.slow)
    for dtype in ('float32', 'bfloat16') for jit in (False, True)
    for dim in (16, 64, 768)])
def test_spherical_equals_a_float64_slerp_at_every_angle(dtype, jit, dim):
  """Random and axis-aligned directions, theta from 1e-5 to pi exactly.

  Tolerances, per token: float32 (computed in float32 throughout): norm
  within 4 eps relative, angle to mu within 8 eps rad, the vector within
  (4 + 2 / (pi - theta)) eps |x| (the plane's conditioning near pi).
  bfloat16 in, bfloat16 out: the same plus two output roundings (2^-8)
  on each; the reference takes the bfloat16 input and direction as exact.
  """
  dtype = jnp.dtype(dtype)
  rounding = 0.0 if dtype == jnp.float32 else 2 * _BF16_ROUNDING
  apply = lambda op, x: op(x)[0]
  if jit:
    apply = jax.jit(apply)  # Once: direction and alpha are traced leaves.
  for k, direction in enumerate(_directions(dim)):
    # The direction as the operator sees it: representable in the dtype.
    direction = np.asarray(jnp.asarray(direction, dtype), np.float32)
    x = _inputs_at_angles(direction, dtype, seed=dim + k)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    for t in _TS:
      op = st.Steering('spherical', jnp.asarray(direction), alpha=t,
                       gate=False)
      out = apply(op, x)
      assert out.dtype == dtype
      y = np.asarray(out.astype(jnp.float32), np.float64)
      assert np.all(np.isfinite(y))
      for i, xi in enumerate(x64):
        ref, theta = _rotate_toward64(xi, direction, t)
        r = np.linalg.norm(xi)
        where = (f'dim={dim} direction {k} t={t} theta=pi-{np.pi - theta:.3g}'
                 f' (theta={theta:.3g})')
        norm_err = abs(np.linalg.norm(y[i]) - r) / r
        assert norm_err <= 4 * _EPS32 + rounding, f'{where}: norm {norm_err}'
        angle_err = abs(_angle64(y[i], direction) - (1 - t) * theta)
        assert angle_err <= 8 * _EPS32 + rounding, (
            f'{where}: angle to mu off by {angle_err}')
        if np.pi - theta > _PLANE_DEFINED:
          err = np.linalg.norm(y[i] - ref) / r
          tol = (4 + 2 / (np.pi - theta)) * _EPS32 + rounding
          assert err <= tol, f'{where}: |y - slerp| = {err} |x| > {tol}'


@jax.jit
def _slerp_grads(x, t, mu, weights):
  loss = lambda x, t: jnp.sum(st.slerp_rotate(x, mu, t) * weights)
  return jax.grad(loss, argnums=(0, 1))(x, t)


@pytest.mark.parametrize('theta', [0.0, 1e-3, 1.0, np.pi - 1e-4, np.pi])
def test_spherical_gradients_are_finite(theta):
  """Nothing differentiates through steering today; if something does, the
  plane switch, theta = 0 and x = 0 must not give NaN or inf."""
  mu = _random((16,), 20)
  mu /= np.linalg.norm(mu)
  v = _random((16,), 21)
  v -= (v @ mu) * mu
  v /= np.linalg.norm(v)
  x = jnp.asarray(2.0 * (np.cos(theta) * mu + np.sin(theta) * v), jnp.float32)
  if theta == np.pi:
    x = jnp.asarray(-2.0 * mu)
  weights = _random((16,), 22)
  for point in (x, np.zeros(16, np.float32)):
    for t in (0.0, 0.3, 1.0):
      grads = _slerp_grads(point, np.float32(t), mu, weights)
      assert all(np.all(np.isfinite(g)) for g in grads), (theta, t)


def test_zero_activation_stays_zero():
  mu = jnp.ones(4)
  out, _ = _apply(st.Steering('spherical', mu, alpha=1.0, gate=False),
                  np.zeros((1, 4), np.float32))
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize('method,kwargs', [
    ('spherical', dict(gate=True, beta=-0.3)),
    ('spherical', dict(gate=False)),
    ('addition', dict(coefficient=2.0)),
    ('addition', dict(coefficient=2.0, renormalize=True)),
    ('addition', dict(coefficient=2.0, gate=True, beta=-0.3)),
])
def test_vectorised_equals_per_token_loop_with_mask(method, kwargs):
  x = _random((3, 7, 16), 7)
  mask = np.random.default_rng(8).random((3, 7)) < 0.6
  mu = _random((16,), 9)
  op = st.Steering(method, jnp.asarray(mu), alpha=0.6, **kwargs)
  out, stats = _apply_masked(op, x, mask)
  out = np.asarray(out)
  changed = 0
  for b in range(3):
    for s in range(7):
      if not mask[b, s]:
        np.testing.assert_array_equal(out[b, s], x[b, s])
        continue
      one, one_stats = _apply(op, x[b, s])
      np.testing.assert_allclose(out[b, s], one, atol=1e-5)
      changed += int(one_stats.triggered)
  assert float(stats.tokens) == mask.sum()
  assert float(stats.triggered) == changed


def test_addition_and_renormalisation_closed_forms():
  x = _random((10, 8), 10)
  mu = _random((8,), 11)
  unit = mu / np.linalg.norm(mu)
  out, _ = _apply(st.Steering('addition', jnp.asarray(mu), alpha=0.5,
                              coefficient=3.0), x)
  np.testing.assert_allclose(out, x + 1.5 * unit, atol=1e-5)
  out, _ = _apply(st.Steering('addition', jnp.asarray(mu), alpha=0.5,
                              coefficient=3.0, renormalize=True), x)
  new = x + 1.5 * unit
  np.testing.assert_allclose(
      out, new * (np.linalg.norm(x, axis=-1) / np.linalg.norm(new, axis=-1)
                  )[:, None], atol=1e-5)


def test_bfloat16_in_bfloat16_out_computed_in_float32():
  x32 = _random((4, 32), 12) * 50
  x = jnp.asarray(x32, jnp.bfloat16)
  mu = jnp.asarray(_random((32,), 13))
  out, _ = _apply(st.Steering('spherical', mu, alpha=0.5, gate=False), x)
  assert out.dtype == jnp.bfloat16
  ref = _slerp(np.asarray(x, np.float32), _unit(mu),
               np.full((4,), 0.5, np.float32)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(ref, np.float32))
  np.testing.assert_allclose(
      np.linalg.norm(np.asarray(out, np.float32), axis=-1),
      np.linalg.norm(np.asarray(x, np.float32), axis=-1), rtol=1e-2)


def test_alpha_is_a_traced_leaf_no_recompile():
  traces = []

  @jax.jit
  def apply(op, x):
    traces.append(1)
    return op(x)[0]

  x = jnp.asarray(_random((2, 8), 14))
  mu = jnp.asarray(_random((8,), 15))
  outs = [apply(st.Steering('spherical', mu, alpha=a, gate=False), x)
          for a in (0.1, 0.4, 0.9)]
  assert len(traces) == 1
  assert not np.allclose(outs[0], outs[2])


def test_directions_recover_a_planted_concept():
  rng = np.random.default_rng(16)
  concept = rng.normal(size=32)
  concept /= np.linalg.norm(concept)
  base = rng.normal(size=(400, 32))
  pos = base + 2.0 * concept + 0.3 * rng.normal(size=(400, 32))
  neg = base - 2.0 * concept + 0.3 * rng.normal(size=(400, 32))
  md = np.asarray(st.extract_direction(pos, neg, 'mean_diff'))
  ref = pos.mean(0) - neg.mean(0)
  np.testing.assert_allclose(md, ref / np.linalg.norm(ref), atol=1e-5)
  pca = np.asarray(st.extract_direction(pos, neg, 'pca'))
  assert pca @ concept > 0.99  # Sign follows the mean difference.
  assert md @ concept > 0.99


@pytest.mark.parametrize('make,message', [
    (lambda: st.Steering('spherical', jnp.zeros(4)), 'direction: is zero'),
    (lambda: st.Steering('spherical', jnp.array([1.0, np.nan])),
     'direction: has non-finite'),
    (lambda: st.Steering('spherical', jnp.array([1.0, np.inf])),
     'direction: has non-finite'),
    (lambda: st.Steering('spherical', jnp.ones(4), alpha=1.5),
     r'alpha=1.5: must be in \[0, 1\]'),
    (lambda: st.Steering('spherical', jnp.ones(4), alpha=-0.1),
     r'alpha=-0.1: must be in \[0, 1\]'),
    (lambda: st.Steering('spherical', jnp.ones(4), beta=1.0),
     r'beta=1.0: must be in \[-1, 1\)'),
    (lambda: st.Steering('rotate', jnp.ones(4)),
     "method='rotate'.*valid choices: none, addition, spherical"),
    (lambda: st.Steering('spherical', jnp.ones(4))(jnp.ones((2, 5))),
     'direction: hidden size 4 does not match the activations\' 5'),
    (lambda: st.extract_direction(np.ones((3, 4)), np.ones((3, 4))),
     'mean difference of positive and negative: is zero'),
    (lambda: st.extract_direction(np.ones((3, 4)), np.zeros((3, 4)), 'lda'),
     "method='lda'.*valid choices: mean_diff, pca"),
])
def test_bad_input_names_the_argument(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_gated_addition_adds_the_gate_fraction_and_defaults_are_per_method():
  """Addition with the vMF gate: x + t c mu with t from `gate` per token
  (a plain loop over tokens), tokens on the target's side untouched; the
  default gate is on for the rotation and off for addition."""
  rng = np.random.default_rng(21)
  x = rng.normal(size=(40, 8)).astype(np.float32) * 3
  mu = rng.normal(size=8).astype(np.float32)
  unit = mu / np.linalg.norm(mu)
  kappa, beta, alpha, c = 2.0, -0.2, 0.7, 4.0
  op = st.Steering('addition', jnp.asarray(mu), alpha=alpha, kappa=kappa,
                   beta=beta, coefficient=c, gate=True)
  out, stats = _apply(op, x)
  out = np.asarray(out)
  changed = 0
  for i, xi in enumerate(x):
    cos = float(xi @ unit / np.linalg.norm(xi))
    delta = -np.tanh(kappa * cos)
    t = (np.clip(alpha * (delta - beta) / (1 - beta), 0, 1)
         if delta > beta else 0.0)
    np.testing.assert_allclose(out[i], xi + t * c * unit, atol=1e-5)
    if t == 0:
      np.testing.assert_array_equal(out[i], xi)
    changed += t > 0
  assert 0 < changed < len(x)  # The gate really splits this batch.
  assert float(stats.triggered) == changed
  assert st.Steering('spherical', jnp.asarray(mu)).gate is True
  assert st.Steering('addition', jnp.asarray(mu)).gate is False
  # Ungated addition is unchanged: alpha c mu on every token.
  plain, _ = _apply(st.Steering('addition', jnp.asarray(mu), alpha=alpha,
                                coefficient=c), x)
  np.testing.assert_allclose(plain, x + alpha * c * unit, atol=1e-5)


# --- Centring, the calibrated gate and the gate's histogram. ---

_KINDS = [
    ('spherical', dict(gate=True, beta=-0.3)),
    ('spherical', dict(gate=False)),
    ('addition', dict(coefficient=2.0)),
    ('addition', dict(coefficient=2.0, renormalize=True)),
    ('addition', dict(coefficient=2.0, gate=True, beta=-0.3,
                      renormalize=True)),
    ('none', dict()),
]


def _today(op, x, mask):
  """Steering.__call__ as it was before `center` (frozen copy of its body)."""
  mask = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape[:-1])
  tokens = jnp.sum(mask, dtype=jnp.float32)
  if op.method == 'none':
    zero = jnp.zeros((), jnp.float32)
    return x, (tokens, zero, zero)
  mu = st.unit(op.direction)
  xf = x.astype(jnp.float32)
  alpha = jnp.asarray(op.alpha, jnp.float32)
  if op.gate:
    norm = jnp.linalg.norm(xf, axis=-1)
    cos = jnp.sum(xf * mu, -1) / jnp.maximum(norm, 1e-12)
    _, t = st.gate(cos, alpha=alpha, kappa=op.kappa, beta=op.beta)
  else:
    t = jnp.broadcast_to(alpha, mask.shape)
  if op.method == 'addition':
    new = xf + (t * op.coefficient)[..., None] * mu
    if op.renormalize:
      scale = (jnp.linalg.norm(xf, axis=-1, keepdims=True)
               / jnp.maximum(jnp.linalg.norm(new, axis=-1, keepdims=True),
                             1e-12))
      new = new * scale
  else:
    new = st.slerp_rotate(xf, mu, t)
  changed = mask & (t > 0)
  out = jnp.where(changed[..., None], new.astype(x.dtype), x)
  return out, (tokens, jnp.sum(changed, dtype=jnp.float32),
               jnp.sum(jnp.where(changed, t, 0.0)))


@pytest.mark.parametrize('method,kwargs', _KINDS)
@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_center_none_is_todays_output_bit_for_bit(method, kwargs, jit, dtype):
  x = jnp.asarray(_random((3, 7, 16), 40) * 4, dtype)
  mask = np.random.default_rng(41).random((3, 7)) < 0.7
  op = st.Steering(method, jnp.asarray(_random((16,), 42)), alpha=0.6,
                   **kwargs)
  apply = (lambda op, x, m: op(x, m)) if not jit else _apply_masked
  today = _today if not jit else jax.jit(_today)
  out, stats = apply(op, x, mask)
  ref, ref_stats = today(op, x, mask)
  assert out.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(ref, np.float32))
  for got, want in zip(stats[:3], ref_stats):
    np.testing.assert_array_equal(got, want)
  # A zero center is the same arithmetic: x - 0 = x and 0 + y = y exactly;
  # bit for bit op by op, to rounding under jit (another program, which XLA
  # may fuse and so round differently).
  zero = st.Steering(method, op.direction, alpha=0.6,
                     center=jnp.zeros(16), **kwargs)
  out0, stats0 = apply(zero, x, mask)
  out0, out = np.asarray(out0, np.float32), np.asarray(out, np.float32)
  if jit:
    np.testing.assert_allclose(out0, out, rtol=4 * _EPS32, atol=1e-6)
  else:
    np.testing.assert_array_equal(out0, out)
  for got, want in zip(stats0, stats):
    np.testing.assert_allclose(got, want, rtol=0 if not jit else 1e-6)


def _gate64(cos, alpha, kappa, beta):
  """The reference's gate in float64: (delta, t)."""
  delta = -np.tanh(kappa * np.asarray(cos, np.float64))
  t = np.clip(alpha * (delta - beta) / (1 - beta), 0, 1)
  return delta, np.where(delta > beta, t, 0.0)


def _cos64(x, mu, m=0.0):
  """cos(x - m, mu) per row in float64 (0 at x = m)."""
  r = np.asarray(x, np.float64) - np.asarray(m, np.float64)
  mu = np.asarray(mu, np.float64) / np.linalg.norm(mu)
  norm = np.linalg.norm(r, axis=-1)
  return (r @ mu) / np.maximum(norm, 1e-300)


def _centred_case(seed, n=64, dim=16):
  """Activations far from the origin around a center, and a direction."""
  rng = np.random.default_rng(seed)
  m = (5.0 * rng.normal(size=dim)).astype(np.float32)
  x = (m + 2.0 * rng.normal(size=(n, dim))).astype(np.float32)
  mu = rng.normal(size=dim).astype(np.float32)
  return x, m, mu


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('gated', [False, True], ids=['ungated', 'gated'])
def test_centred_rotation_equals_a_float64_slerp_about_the_center(jit, gated):
  x, m, mu = _centred_case(43)
  unit = mu.astype(np.float64) / np.linalg.norm(mu)
  alpha, kappa, beta = 0.8, 3.0, -0.2
  op = st.Steering('spherical', jnp.asarray(mu), alpha=alpha, kappa=kappa,
                   beta=beta, gate=gated, center=jnp.asarray(m))
  out, stats = (_apply if jit else (lambda op, x: op(x)))(op, x)
  out = np.asarray(out, np.float64)
  rel = x.astype(np.float64) - m
  r = np.linalg.norm(rel, axis=-1)
  _, t = _gate64(_cos64(x, mu, m), alpha, kappa, beta)
  t = t if gated else np.full(len(x), alpha)
  for i in range(len(x)):
    if t[i] == 0:
      np.testing.assert_array_equal(out[i], x[i])
      continue
    ref = m + r[i] * _slerp64(rel[i] / r[i], unit, t[i])
    np.testing.assert_allclose(out[i], ref,
                               atol=1e-5 * (r[i] + np.linalg.norm(m)))
  # |x' - m| = |x - m|: the rotation is about the center.
  np.testing.assert_allclose(np.linalg.norm(out - m, axis=-1), r, rtol=1e-5)
  assert float(stats.triggered) == np.sum(t > 0)
  if gated:
    assert 0 < np.sum(t > 0) < len(x)  # Both branches exercised.
  # The uncentred operator would give something else.
  plain, _ = _apply(st.Steering('spherical', jnp.asarray(mu), alpha=alpha,
                                kappa=kappa, beta=beta, gate=gated), x)
  assert not np.allclose(plain, out, atol=1e-3)


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('renormalize', [False, True])
def test_centred_addition_gates_on_the_centred_cosine(jit, renormalize):
  x, m, mu = _centred_case(44)
  unit = mu.astype(np.float64) / np.linalg.norm(mu)
  alpha, kappa, beta, c = 0.7, 2.0, -0.1, 3.0
  op = st.Steering('addition', jnp.asarray(mu), alpha=alpha, kappa=kappa,
                   beta=beta, coefficient=c, gate=True,
                   renormalize=renormalize, center=jnp.asarray(m))
  out, stats = (_apply if jit else (lambda op, x: op(x)))(op, x)
  out = np.asarray(out, np.float64)
  _, t = _gate64(_cos64(x, mu, m), alpha, kappa, beta)
  assert 0 < np.sum(t > 0) < len(x)
  x64 = x.astype(np.float64)
  new = x64 + (t * c)[:, None] * unit
  if renormalize:
    new = m + (new - m) * (np.linalg.norm(x64 - m, axis=-1)
                           / np.linalg.norm(new - m, axis=-1))[:, None]
  off = t == 0
  np.testing.assert_array_equal(out[off], x[off])
  np.testing.assert_allclose(out, new, atol=2e-5 * np.abs(m).max())
  assert float(stats.triggered) == np.sum(~off)
  np.testing.assert_allclose(float(stats.t_sum), t.sum(), rtol=1e-5)


def _shared_component_set(seed=45, n=400, dim=64):
  """Contrastive activations whose every token shares a large component
  with the concept (the Gemma 3 270M case): pos/neg = shared +- y v + noise."""
  rng = np.random.default_rng(seed)
  v = rng.normal(size=dim)
  v /= np.linalg.norm(v)
  w = rng.normal(size=dim)
  w -= (w @ v) * v
  w /= np.linalg.norm(w)
  shared = 4.0 * v + 5.0 * w
  y = 0.8 * (1 + 0.2 * rng.normal(size=(n, 1)))
  pos = shared + y * v + 0.3 * rng.normal(size=(n, dim))
  neg = shared - y * v + 0.3 * rng.normal(size=(n, dim))
  return pos.astype(np.float32), neg.astype(np.float32)


def _calibrate64(pos_cos, neg_cos, width):
  """The calibration rule in float64: (kappa, beta, threshold), uncapped."""
  threshold = (np.median(pos_cos) + np.median(neg_cos)) / 2
  squares = (np.sum((pos_cos - pos_cos.mean()) ** 2)
             + np.sum((neg_cos - neg_cos.mean()) ** 2))
  spread = np.sqrt(squares / (pos_cos.size + neg_cos.size - 2))
  kappa = width / spread
  return kappa, -np.tanh(kappa * threshold), threshold


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
def test_a_shared_component_closes_the_reference_gate_centring_opens_it(jit):
  pos, neg = _shared_component_set()
  both = np.concatenate([pos, neg])
  mu = st.extract_direction(pos, neg, 'mean_diff')
  mu64 = np.asarray(mu, np.float64)
  # Uncentred, every token's cosine is large and positive.
  raw = _cos64(both, mu64)
  assert 0.3 < raw.min() and raw.max() < 0.8, (raw.min(), raw.max())
  apply = _apply if jit else (lambda op, x: op(x))
  reference = st.Steering('spherical', mu, alpha=0.8)  # kappa 20, beta 0.
  _, stats = apply(reference, neg)
  assert float(stats.triggered) == 0  # Never fires on the negative side.
  # The negative side's deltas all sit in the histogram's first bin.
  assert float(stats.delta_hist[0]) == len(neg)
  # Centred on the layer mean and calibrated on the centred cosines.
  m = st.layer_mean(both)
  np.testing.assert_allclose(m, both.astype(np.float64).mean(0), atol=1e-5)
  cal = st.calibrate_gate(st.cosines(pos, mu, m), st.cosines(neg, mu, m))
  m64 = both.astype(np.float64).mean(0)
  pos_cos, neg_cos = _cos64(pos, mu64, m64), _cos64(neg, mu64, m64)
  kappa, beta, threshold = _calibrate64(pos_cos, neg_cos, 1.0)
  np.testing.assert_allclose([cal.kappa, cal.beta, cal.threshold],
                             [kappa, beta, threshold], rtol=1e-4, atol=1e-6)
  calibrated = st.Steering('spherical', mu, alpha=0.8, kappa=cal.kappa,
                           beta=cal.beta, center=m)
  _, neg_stats = apply(calibrated, neg)
  _, pos_stats = apply(calibrated, pos)
  # Against the float64 gate on the float64 centred cosines.
  assert float(neg_stats.triggered) == np.sum(neg_cos < threshold)
  assert float(pos_stats.triggered) == np.sum(pos_cos < threshold)
  # Measured: 397 of the 400 negative-side tokens (99.25%), 1 of the 400
  # positive-side ones (0.25%).
  assert float(neg_stats.trigger_rate) >= 0.98
  assert float(pos_stats.trigger_rate) <= 0.01
  # And by a graded strength: measured mean t 0.75 at alpha 0.8.
  assert float(neg_stats.t_sum / neg_stats.triggered) >= 0.7
  # Calibrated without centring, the gate splits the sides only at the cap
  # (beta = -1 + 1e-6) and moves what it lets through by almost nothing
  # (measured mean t 5e-6).
  raw_cal = st.calibrate_gate(st.cosines(pos, mu), st.cosines(neg, mu))
  assert raw_cal.capped and raw_cal.beta == pytest.approx(-1 + 1e-6)
  _, raw_stats = apply(st.Steering('spherical', mu, alpha=0.8,
                                   kappa=raw_cal.kappa, beta=raw_cal.beta),
                       neg)
  assert float(raw_stats.t_sum / raw_stats.triggered) < 1e-3


def test_calibrate_gate_switches_at_the_threshold_on_a_grid():
  rng = np.random.default_rng(46)
  grid = np.linspace(-1, 1, 20001)
  for case in range(6):
    pos = np.clip(rng.normal(0.3 * rng.random(), 0.05 + 0.2 * rng.random(),
                             50 + case), -1, 1)
    neg = np.clip(rng.normal(-0.4 * rng.random(), 0.05 + 0.2 * rng.random(),
                             70), -1, 1)
    width = [0.5, 1.0, 3.0][case % 3]
    cal = st.calibrate_gate(pos, neg, width=width)
    kappa, beta, threshold = _calibrate64(pos, neg, width)
    assert not cal.capped
    np.testing.assert_allclose([cal.kappa, cal.beta, cal.threshold],
                               [kappa, beta, threshold], rtol=1e-12)
    assert cal.positive_median == np.median(pos)
    assert cal.negative_median == np.median(neg)
    delta = -np.tanh(cal.kappa * grid)
    far = np.abs(grid - threshold) > 1e-9
    np.testing.assert_array_equal((delta > cal.beta)[far],
                                  (grid < threshold)[far])
    # The float32 gate the operator runs: the same away from rounding,
    # which near |beta| = 1 blurs the switch by about
    # 1e-7 / (kappa (1 - beta^2)) in cos (float32 tanh is flat there).
    _, t = _gate(jnp.asarray(grid, jnp.float32), alpha=1.0, kappa=cal.kappa,
                 beta=cal.beta)
    blur = max(1e-5, 2e-7 / (cal.kappa * (1 - cal.beta ** 2)))
    far = np.abs(grid - threshold) > blur
    np.testing.assert_array_equal((np.asarray(t) > 0)[far],
                                  (grid < threshold)[far])


def test_calibrate_gate_caps_kappa_and_keeps_beta_inside_minus_one_one():
  rng = np.random.default_rng(47)
  pos = 0.9 + 0.001 * rng.normal(size=40)   # Far from 0, a tiny spread.
  neg = 0.8 + 0.001 * rng.normal(size=40)
  cal = st.calibrate_gate(pos, neg)
  assert cal.capped
  bound = np.arctanh(1 - 1e-6)
  np.testing.assert_allclose(cal.kappa * abs(cal.threshold), bound,
                             rtol=1e-12)
  assert -1 + 1e-6 <= cal.beta <= 1 - 1e-6
  grid = np.linspace(0.7, 1.0, 3001)
  far = np.abs(grid - cal.threshold) > 1e-9
  np.testing.assert_array_equal(
      (-np.tanh(cal.kappa * grid) > cal.beta)[far],
      (grid < cal.threshold)[far])
  # Negative thresholds cap symmetrically.
  flipped = st.calibrate_gate(-neg, -pos)
  assert flipped.capped and flipped.beta == pytest.approx(-cal.beta)
  # Steering accepts the calibrated numbers.
  st.Steering('spherical', jnp.ones(4), kappa=cal.kappa, beta=cal.beta)


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
def test_cosines_equal_a_float64_reference_and_take_bfloat16(jit):
  x, m, mu = _centred_case(48)
  cos = jax.jit(st.cosines) if jit else st.cosines
  got = cos(x, mu, m)
  assert got.dtype == jnp.float32 and got.shape == (len(x),)
  np.testing.assert_allclose(got, _cos64(x, mu, m), atol=1e-5)
  np.testing.assert_allclose(cos(x, mu), _cos64(x, mu), atol=1e-6)
  xb = jnp.asarray(x, jnp.bfloat16)
  got = cos(xb, mu, m)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(
      got, _cos64(np.asarray(xb, np.float32), mu, m), atol=1e-5)
  # The operator's gate sees exactly these cosines: where they fall below
  # the calibrated threshold, and only there, tokens are steered.
  above = np.asarray(got) > np.median(got)
  cal = st.calibrate_gate(got[above], got[~above])
  op = st.Steering('spherical', jnp.asarray(mu), alpha=1.0, kappa=cal.kappa,
                   beta=cal.beta, center=jnp.asarray(m))
  _, t = _gate(got, alpha=1.0, kappa=cal.kappa, beta=cal.beta)
  out, stats = _apply(op, xb)
  assert out.dtype == jnp.bfloat16
  assert float(stats.triggered) == np.sum(np.asarray(t) > 0)


def _hist64(delta, mask):
  """Counts of the masked deltas in the DELTA_EDGES bins (float64)."""
  return np.histogram(np.asarray(delta, np.float64)[mask],
                      bins=st.DELTA_EDGES)[0]


@pytest.mark.parametrize('method,kwargs', _KINDS)
def test_delta_histogram_counts_the_masked_tokens_and_adds(method, kwargs):
  x = _random((4, 9, 16), 49) + 0.5 * _random((16,), 50)
  mask = np.random.default_rng(51).random((4, 9)) < 0.6
  mu = _random((16,), 50)
  kappa = 1.5
  op = st.Steering(method, jnp.asarray(mu), alpha=0.6, kappa=kappa, **kwargs)
  _, stats = _apply_masked(op, x, mask)
  assert stats.delta_hist.shape == (st.DELTA_BINS,)
  assert stats.delta_hist.dtype == jnp.float32
  delta = -np.tanh(kappa * _cos64(x, mu))
  # No delta within float32 rounding of an edge (so the counts are exact).
  assert np.min(np.abs(delta[..., None] - st.DELTA_EDGES)) > 1e-5
  np.testing.assert_array_equal(stats.delta_hist, _hist64(delta, mask))
  assert float(stats.delta_hist.sum()) == float(stats.tokens) == mask.sum()
  assert np.count_nonzero(stats.delta_hist) > 3  # Spread over bins.
  # Additive: two calls on complementary masks add to one unmasked call.
  _, rest = _apply_masked(op, x, ~mask)
  _, whole = _apply(op, x)
  total = jax.tree.map(jnp.add, stats, rest)
  for got, want in zip(total, whole):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_steer_stats_built_from_three_sums_still_adds():
  """Callers that build SteerStats positionally (train.lm.generate's zero
  statistics, scan carries) keep working: the histogram defaults to zeros
  of the same shape and dtype, so the tree structures match."""
  z = jnp.zeros((), jnp.float32)
  zero = st.SteerStats(z, z, z)
  assert zero.delta_hist.shape == (st.DELTA_BINS,)
  op = st.Steering('spherical', jnp.asarray(_random((8,), 52)), alpha=0.5)
  _, stats = _apply(op, _random((5, 8), 53))
  total = jax.tree.map(jnp.add, zero, stats)
  np.testing.assert_array_equal(total.delta_hist, stats.delta_hist)
  carry = jax.lax.scan(lambda c, _: (jax.tree.map(jnp.add, c, stats), None),
                       zero, None, length=3)[0]
  assert float(carry.delta_hist.sum()) == 15
  with pytest.raises(ValueError):  # The shared default is read-only.
    zero.delta_hist[0] = 1.0


def test_centred_edges_antipode_zero_vector_and_empty_mask():
  rng = np.random.default_rng(54)
  mu = np.zeros(8, np.float32)
  mu[3] = 1.0
  m = rng.normal(size=8).astype(np.float32)
  m[3] = 1.0  # x = m - 2 mu is exact in float32.
  # theta = pi after centring: x - m = -2 mu exactly.
  x = np.stack([m - 2.0 * mu, m]).astype(np.float32)
  op = st.Steering('spherical', jnp.asarray(mu), alpha=0.5, kappa=20.0,
                   beta=-0.5, center=jnp.asarray(m))
  for apply in (_apply, lambda op, x: op(x)):
    out, stats = apply(op, x)
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out))
    rel = out[0] - m
    np.testing.assert_allclose(np.linalg.norm(rel), 2.0, rtol=1e-6)
    np.testing.assert_allclose(_angle64(rel, mu), np.pi / 2, atol=1e-6)
    # x = m (zero centred vector): cos 0, delta 0 > beta, and x' = m + 0.
    np.testing.assert_array_equal(out[1], x[1])
    assert float(stats.triggered) == 2
  # An empty mask: nothing changes, nothing counted.
  out, stats = _apply_masked(op, x, np.zeros(2, bool))
  np.testing.assert_array_equal(out, x)
  assert float(stats.tokens) == 0 and float(stats.trigger_rate) == 0
  np.testing.assert_array_equal(stats.delta_hist, 0)


def test_layer_mean_masked_bfloat16_and_under_jit():
  x = _random((3, 5, 8), 55) + 10
  mask = np.random.default_rng(56).random((3, 5)) < 0.5
  ref = x.astype(np.float64)[mask].mean(0)
  np.testing.assert_allclose(st.layer_mean(x, mask), ref, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(st.layer_mean)(x, mask), ref, rtol=1e-6)
  np.testing.assert_allclose(st.layer_mean(x),
                             x.astype(np.float64).reshape(-1, 8).mean(0),
                             rtol=1e-6)
  xb = jnp.asarray(x, jnp.bfloat16)
  got = st.layer_mean(xb, mask)
  assert got.dtype == jnp.float32 and got.shape == (8,)
  np.testing.assert_allclose(
      got, np.asarray(xb, np.float64)[mask].mean(0), rtol=1e-6)
  # Calibration takes bfloat16 cosines: the same as their float32 values.
  pos = jnp.asarray([0.5, 0.25, 0.375], jnp.bfloat16)
  neg = jnp.asarray([-0.5, 0.0, -0.25], jnp.bfloat16)
  assert st.calibrate_gate(pos, neg) == st.calibrate_gate(
      np.asarray(pos, np.float32), np.asarray(neg, np.float32))


def test_a_centred_operator_is_a_pytree_a_jitted_sweep_reuses_it():
  traces = []

  @jax.jit
  def apply(op, x):
    traces.append(1)
    return op(x)[0]

  x, m, mu = _centred_case(57)
  op = st.Steering('spherical', jnp.asarray(mu), alpha=0.5, gate=False,
                   center=jnp.asarray(m))
  assert any(leaf is op.center for leaf in jax.tree.leaves(op))
  outs = [apply(dataclasses.replace(op, center=jnp.asarray(m) * s), x)
          for s in (1.0, 0.5)]
  assert len(traces) == 1
  assert not np.allclose(outs[0], outs[1])


@pytest.mark.parametrize('make,message', [
    (lambda: st.Steering('spherical', jnp.ones(4), center=jnp.ones(3)),
     r'Steering.center: must be a vector of shape \(4,\).*got shape \(3,\)'),
    (lambda: st.Steering('spherical', jnp.ones(4), center=jnp.ones((1, 4))),
     r'center: must be a vector of shape \(4,\)'),
    (lambda: st.Steering('spherical', jnp.ones(4),
                         center=jnp.array([0.0, np.nan, 0.0, 0.0])),
     'center: has non-finite entries'),
    (lambda: st.cosines(np.ones((2, 3)), np.ones(4)),
     "cosines: x: last dimension must be the direction's 4"),
    (lambda: st.cosines(np.ones((2, 4)), np.ones(4), np.ones(5)),
     r'cosines: center: must be a vector of shape \(4,\)'),
    (lambda: st.cosines(np.ones((2, 4)), np.zeros(4)),
     'cosines: direction: is zero'),
    (lambda: st.layer_mean(np.ones(4)), 'layer_mean: activations: must be a '
     r'non-empty \(..., dim\) array'),
    (lambda: st.layer_mean(np.ones((0, 4))), 'layer_mean: activations: must'),
    (lambda: st.layer_mean(np.ones((2, 3, 4)), np.ones((2, 4), bool)),
     r"layer_mean: mask: must have the activations' leading shape \(2, 3\)"),
    (lambda: st.layer_mean(np.ones((2, 4)), np.zeros(2, bool)),
     'layer_mean: mask: selects no token'),
    (lambda: st.calibrate_gate([], [0.1]),
     'calibrate_gate: positive_cos: is empty'),
    (lambda: st.calibrate_gate([0.1], np.zeros((3, 0))),
     'calibrate_gate: negative_cos: is empty'),
    (lambda: st.calibrate_gate([0.5, np.nan], [0.1]),
     'positive_cos: has non-finite'),
    (lambda: st.calibrate_gate([0.5, 1.5], [0.1]),
     r'positive_cos: holds 1.5; cosines must be in \[-1, 1\]'),
    (lambda: st.calibrate_gate([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]),
     'positive_cos, negative_cos: median 0.2 .* not above .*identical sets'),
    (lambda: st.calibrate_gate([-0.5, -0.4], [0.4, 0.5]),
     'positive_cos, negative_cos: median -0.45 .* wrong sign'),
    (lambda: st.calibrate_gate([0.5, 0.5], [0.1, 0.1]),
     'positive_cos, negative_cos: have no spread'),
    (lambda: st.calibrate_gate([0.5], [0.1]),
     'positive_cos, negative_cos: have no spread'),
    (lambda: st.calibrate_gate([0.5, 0.6], [0.1, 0.2], width=0.0),
     'calibrate_gate: width=0.0: must be > 0 and finite'),
    (lambda: st.calibrate_gate([0.5, 0.6], [0.1, 0.2], width=np.inf),
     'width=inf: must be > 0 and finite'),
])
def test_bad_centring_and_calibration_arguments_name_the_field(make, message):
  with pytest.raises(validation.ArgumentError, match=message):
    make()
