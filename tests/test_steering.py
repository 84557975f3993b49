"""geom.steering against closed forms and plain loops: slerp, the gate, masks, extraction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geom import steering as st


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


@pytest.mark.parametrize('dim', [16, 64, 768])
@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
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
