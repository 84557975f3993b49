"""CONGA (geom/conga.py) against references written here: a float64 numpy
computation of every statistic, closed forms of the cosine, optax's own
wrappers, and the interval on random streams."""

import doctest
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from geom import conga
from geom import method_hooks
from geom import sam
from geom import validation

C = 10
E0 = 0.4 * math.log(C)
STATE_FIELDS = ('rate', 'lower', 'upper', 'confident_fraction', 'snr',
                'progress')


def _tree(x):
  # Reshaped before it becomes a device array: a host vector takes no eager
  # device op, a traced one reshapes in its program.
  return {'a': jnp.asarray(x[:15].reshape(5, 3)), 'b': jnp.asarray(x[15:])}


def _flat(tree):
  return np.concatenate([np.asarray(tree['a'], np.float64).ravel(),
                         np.asarray(tree['b'], np.float64)])


def _reference(us, hs, *, lr, num_classes=C, eta_min=None, eta_max=None,
               margin=0.4, b=0.9, be=0.9, tau=1e-2, total_steps=None):
  """Every step's (c, snr, lower, upper, progress, rate), in float64, from
  the formulation written out directly: EMAs as explicit weighted sums."""
  eta_min = lr / 10 if eta_min is None else eta_min
  eta_max = 10 * lr if eta_max is None else eta_max
  e0 = margin * np.log(num_classes)
  out, batch_means = [], []
  for t, (u, h) in enumerate(zip(us, hs)):
    h = np.asarray(h, np.float64).ravel()
    h = h[np.isfinite(h)]
    c = float(np.mean(h < e0)) if h.size else 0.0
    if h.size:
      batch_means.append(h.mean())
    w = (1 - b) * b ** (t - np.arange(t + 1))
    w = w / w.sum()
    m = sum(wk * uk for wk, uk in zip(w, us[:t + 1]))
    q = sum(wk * np.sum(uk ** 2) for wk, uk in zip(w, us[:t + 1]))
    r = np.sum(m ** 2) / q if q > 0 else 0.0
    n = w.sum() ** 2 / np.sum(w ** 2)
    snr = float(np.clip(r - (1 - r) / (n - 1), 0, 1)) if t > 0 else 0.0
    lower = eta_min + (lr - eta_min) * c
    upper = max(eta_max * snr, lower)
    rms = np.sqrt(np.mean(u ** 2))
    cap = tau / rms if rms > 0 else np.inf
    lower, upper = min(lower, cap), min(upper, cap)
    if total_steps is not None:
      p = t / total_steps
    elif batch_means:
      k = len(batch_means)
      wh = (1 - be) * be ** (k - 1 - np.arange(k))
      p = 1 - np.sum(wh * batch_means) / wh.sum() / batch_means[0]
    else:
      p = 0.0
    p = float(np.clip(p, 0, 1))
    rate = lower + 0.5 * (upper - lower) * (1 + np.cos(np.pi * p))
    out.append(dict(confident_fraction=c, snr=snr, lower=lower, upper=upper,
                    progress=p, rate=rate))
  return out


def _run(tx, us, hs):
  """Steps tx (jitted) over the stream; returns (updates, states)."""
  state = tx.init(_tree(np.zeros(23, np.float32)))
  step = jax.jit(lambda u, s, h: tx.update(u, s, None, entropies=h))
  updates, states = [], []
  for u, h in zip(us, hs):
    new, state = step(_tree(u.astype(np.float32)), state,
                      jnp.asarray(h, jnp.float32))
    updates.append(new)
    states.append(conga.find_state(state))
  return updates, states


def _stream(seed=0):
  """Eight steps: signal plus noise, a zero update, a spike that the cap
  stops; entropies padded with NaN, an empty batch, a rising entropy."""
  rng = np.random.default_rng(seed)
  direction = rng.normal(size=23)
  us = [0.3 * direction + rng.normal(size=23) * s
        for s in (0.1, 1.0, 0.5, 0.2, 0.3, 0.4, 1.0, 0.2)]
  us[3] = np.zeros(23)
  us[5] = us[5] * 100.0  # rms about 100: the cap binds.
  us = [u.astype(np.float32).astype(np.float64) for u in us]
  hs = [rng.uniform(0, math.log(C), size=16) for _ in us]
  hs[1][10:] = np.nan  # A ragged batch padded with NaN.
  hs[2] = np.zeros((0,))  # An empty batch.
  hs[4] = np.full(16, np.nan)  # All padding: also empty.
  hs[6] = hs[6] + 0.8  # Entropy above H_0: progress clips at 0.
  hs = [h.astype(np.float32).astype(np.float64) for h in hs]
  return us, hs


@pytest.mark.parametrize('kwargs', [
    dict(lr=1e-2),
    dict(lr=1e-2, eta_min=2e-3, eta_max=5e-2, margin=0.5, b=0.8, be=0.5,
         tau=0.05, total_steps=5),
], ids=['defaults_entropy_progress', 'explicit_known_length'])
def test_statistics_and_bounds_match_a_direct_computation(kwargs):
  us, hs = _stream()
  names = dict(lr='learning_rate', eta_min='min_learning_rate',
               eta_max='max_learning_rate', b='grad_decay',
               be='entropy_decay', tau='max_update_rms', margin='margin',
               total_steps='total_steps')
  tx = conga.conga(num_classes=C, **{names[k]: v for k, v in kwargs.items()})
  updates, states = _run(tx, us, hs)
  want = _reference(us, hs, **kwargs)
  for t, (u, new, state, ref) in enumerate(zip(us, updates, states, want)):
    for field in STATE_FIELDS:
      np.testing.assert_allclose(float(getattr(state, field)), ref[field],
                                 rtol=2e-5, atol=2e-6, err_msg=f'{t} {field}')
    np.testing.assert_allclose(_flat(new), -ref['rate'] * u, rtol=2e-5,
                               atol=1e-9, err_msg=str(t))
  # The stream does reach what it is built to: the cap, a clipped
  # progress, an interval that is not a point.
  assert any(r['upper'] < r['lower'] * 1.0001 for r in want[5:6])
  assert max(r['upper'] - r['lower'] for r in want) > 1e-3


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_stream(key, steps, dims=23, batch=16, regime=40):
  """Regimes of `regime` steps, each with its own size of update (1e-8 to
  1e8), signal strength and entropy level; in each, updates along a
  drifting direction plus noise, and entropies with random NaN padding.
  Zeros here and there, and spikes of 1e30 and 3e36 (an element near 1e38,
  a norm past float32's range)."""
  ks = jax.random.split(key, 9)
  regimes = steps // regime + 1
  per = lambda x: jnp.repeat(x, regime, 0)[:steps]
  log_scale = per(jax.random.uniform(ks[0], (regimes, 1), minval=-8,
                                     maxval=8))
  log_scale += 0.05 * jax.random.normal(ks[1], (steps, 1))
  scale = jnp.where(jax.random.uniform(ks[2], (steps, 1)) < 0.05, 0.0,
                    10.0 ** log_scale)
  scale = scale.at[steps // 2].set(1e30).at[3 * steps // 4].set(3e36)
  signal = per(jax.random.uniform(ks[3], (regimes, 1), maxval=3))
  direction = jnp.cumsum(jax.random.normal(ks[4], (steps, dims)) * 0.05,
                         0) + 1
  us = scale * (signal * direction + jax.random.normal(ks[5], (steps, dims)))
  level = per(jax.random.uniform(ks[6], (regimes, 1), minval=0.1, maxval=1))
  hs = level * jax.random.uniform(ks[7], (steps, batch), maxval=math.log(C))
  hs = jnp.where(jax.random.uniform(ks[8], (steps, batch)) < 0.2, jnp.nan, hs)
  return us.astype(jnp.float32), hs


@pytest.mark.parametrize('total_steps', [None, 150])
def test_the_rate_stays_inside_the_interval_on_random_streams(total_steps):
  tau = 1e-2
  tx = conga.conga(3e-3, num_classes=C, total_steps=total_steps,
                   max_update_rms=tau)
  us, hs = _random_stream(jax.random.key(7), 400)
  us_host = np.asarray(us)
  with np.errstate(over='ignore'):
    assert np.isfinite(us_host).all() and not np.isfinite(
        np.sum(np.square(us_host), -1)).all()

  @jax.jit
  def run(us, hs):
    def body(state, xs):
      u, h = xs
      new, state = tx.update(_tree(u), state, None, entropies=h)
      return state, (_flat_jnp(new), state)
    return jax.lax.scan(body, tx.init(_tree(us[0])), (us, hs))[1]

  # One program per tx: run in the scan, then checked on host arrays.
  steps, states = jax.tree.map(np.asarray, run(us, hs))
  rate, lower, upper = states.rate, states.lower, states.upper
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(states))
  assert np.isfinite(steps).all()
  assert (lower >= 0).all() and (lower <= upper).all()
  assert (lower <= rate).all() and (rate <= upper).all()
  for field in ('snr', 'progress', 'confident_fraction'):
    x = getattr(states, field)
    assert ((x >= 0) & (x <= 1)).all(), field
  # The interval moves and the rate uses it, and no step is longer than tau.
  assert float(np.std(rate)) > 0 and bool((rate < upper).any())
  assert bool((upper > lower).any()) and bool((states.snr > 0.5).any())
  rms = np.sqrt(np.mean(np.square(steps), -1))
  assert (rms <= tau * (1 + 1e-5)).all()
  np.testing.assert_allclose(steps, -rate[:, None] * us_host, rtol=1e-6)


def test_the_rate_does_not_leave_the_interval_by_rounding():
  # At progress ~0 the rate is lower + (upper - lower), which float32 may
  # round above upper (about 1.5% of these draws would be): over random
  # rates and confident fractions, injected as traced hyperparameters.
  def rates(lr, eta_max, h):
    tx = optax.inject_hyperparams(conga.conga)(
        learning_rate=lr, num_classes=C, max_learning_rate=eta_max,
        max_update_rms=math.inf, total_steps=10**9)
    state = tx.init(jnp.zeros(3))
    for _ in range(2):
      _, state = tx.update(jnp.ones(3), state, entropies=h)
    return state.inner_state

  @jax.jit
  def draw_and_run(key):
    ks = jax.random.split(key, 3)
    n = 4000
    lr = 10 ** jax.random.uniform(ks[0], (n,), minval=-4, maxval=-1)
    eta_max = lr * 10 ** jax.random.uniform(ks[1], (n,), maxval=2)
    h = jax.random.uniform(ks[2], (n, 7), maxval=math.log(C))
    return jax.vmap(rates)(lr, eta_max, h)

  state = jax.tree.map(np.asarray, draw_and_run(jax.random.key(0)))
  assert (state.snr > 0.99).all() and (state.progress < 1e-8).all()
  assert (state.lower <= state.rate).all()
  assert (state.rate <= state.upper).all()


def _flat_jnp(tree):
  return jnp.concatenate([tree['a'].ravel(), tree['b']])


def _cosine(lo, hi, p):
  return lo + 0.5 * (hi - lo) * (1 + np.cos(np.pi * np.clip(p, 0, 1)))


def test_a_clean_confident_stream_follows_the_cosine_in_steps():
  # All samples confident (lower = eta_base), a constant update (SNR 1 from
  # the second step on: upper = eta_max), no cap: the rate is optax's
  # cosine decay from eta_max to eta_base over T steps, and eta_base at
  # the first step (nothing known of the noise) and after T.
  lr, eta_max, total = 1e-3, 5e-3, 12
  tx = conga.conga(lr, num_classes=C, max_learning_rate=eta_max,
                   max_update_rms=math.inf, total_steps=total)
  steps = total + 4
  us = [np.full(23, 0.7)] * steps
  hs = [np.full(8, 0.05)] * steps
  _, states = _run(tx, us, hs)
  got = np.array([float(s.rate) for s in states])
  want = [lr] + [_cosine(lr, eta_max, t / total) for t in range(1, steps)]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  schedule = optax.cosine_decay_schedule(eta_max - lr, total)
  np.testing.assert_allclose(got[1:], [lr + float(schedule(t))
                                       for t in range(1, steps)], rtol=1e-5)


def test_a_clean_confident_stream_follows_the_cosine_of_entropy_progress():
  # Progress is the relative reduction of the entropy's (bias-corrected)
  # moving average since the first batch: written here as the weighted
  # mean of the batch means. The entropy falls, then rises above H_0.
  # C = 1000: E0 = 2.76, every batch is confident.
  lr, eta_max, decay = 1e-3, 4e-3, 0.7
  tx = conga.conga(lr, num_classes=1000, max_learning_rate=eta_max,
                   max_update_rms=math.inf, entropy_decay=decay)
  means = [0.9, 0.8, 0.6, 0.5, 0.3, 0.2, 0.1, 0.05, 0.0, 0.0, 2.0, 2.0]
  hs = [np.clip(m + np.array([-0.04, 0.0, 0.04]), 0, None) if m else
        np.zeros(3) for m in means]
  us = [np.linspace(-1, 1, 23)] * len(means)
  _, states = _run(tx, us, hs)
  got = np.array([float(s.rate) for s in states])
  progress = []
  for k in range(len(means)):
    w = decay ** np.arange(k, -1, -1)
    progress.append(1 - np.dot(w, means[:k + 1]) / w.sum() / means[0])
  want = [lr] + [_cosine(lr, eta_max, p) for p in progress[1:]]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  got_p = [float(s.progress) for s in states]
  np.testing.assert_allclose(got_p, np.clip(progress, 0, 1), atol=1e-6)
  assert max(got_p) > 0.8 and got_p[-1] == 0.0


def test_the_snr_estimates_the_signal_fraction_without_small_sample_bias():
  # u = mu + noise with |mu|^2 / (|mu|^2 + E|noise|^2) = f: the SNR
  # averages f, for pure noise (f = 0) as well, at early steps and late.
  dims, steps, runs = 200, 40, 64
  tx = conga.conga(1e-3, num_classes=C)

  @jax.jit
  def mean_snr(fraction, key):
    mu = jnp.full((dims,), jnp.sqrt(fraction / dims))
    noise = jax.random.normal(key, (runs, steps, dims)) * jnp.sqrt(
        (1 - fraction) / dims)

    def one(noise):
      def body(state, n):
        _, state = tx.update(mu + n, state, None, entropies=jnp.zeros(1))
        return state, state.snr
      return jax.lax.scan(body, tx.init(mu), noise)[1]
    return jnp.mean(jax.vmap(one)(noise), 0)

  for fraction in (0.0, 0.3, 0.7, 1.0):
    snr = mean_snr(fraction, jax.random.key(3))
    assert float(snr[0]) == 0.0  # The first step: no evidence.
    np.testing.assert_allclose(snr[1:4].mean(), fraction, atol=0.06)
    np.testing.assert_allclose(snr[-10:].mean(), fraction, atol=0.06)


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
def test_the_update_is_minus_the_rate_times_the_updates_in_their_dtype(dtype):
  params = {'w': jnp.ones((4, 3), dtype), 'b': jnp.zeros((3,), jnp.float32)}
  tx = conga.conga(1e-2, num_classes=C)
  state = tx.init(params)
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  step = jax.jit(lambda g, s: tx.update(g, s, params,
                                        entropies=jnp.array([0.1, 2.0])))
  for i in range(3):
    grads = {'w': jnp.asarray(np.linspace(-1, 2 + i, 12, dtype=np.float32)
                              .reshape(4, 3), dtype),
             'b': jnp.asarray(np.array([0.5, -0.25, 3.0 - i], np.float32))}
    updates, state = step(grads, state)
    rate = float(state.rate)
    assert rate > 0
    assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(
        lambda x: x.dtype, params)
    assert jax.tree.map(lambda x: x.dtype, state) == dtypes
    # To one rounding of the dtype (XLA may fuse the rate into the product).
    # The reference in numpy: a float32 product, rounded to the dtype.
    jax.tree.map(lambda got, g: np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(
            (np.float32(-rate) * np.asarray(g, np.float32)).astype(g.dtype),
            np.float32),
        rtol=1e-6 if g.dtype == jnp.float32 else 2 ** -8), updates, grads)
  assert state.grad_ema['w'].dtype == jnp.float32


def test_zero_tiny_and_huge_updates_stay_finite_and_the_cap_holds():
  tau = 1e-2
  tx = conga.conga(1e-3, num_classes=C, max_update_rms=tau)
  state = tx.init(jnp.zeros(5))
  step = jax.jit(lambda u, s: tx.update(u, s, None,
                                        entropies=jnp.array([0.1, 0.2])))
  finite = lambda tree: all(np.isfinite(np.asarray(x)).all()
                            for x in jax.tree.leaves(tree))
  zeros = np.zeros(5, np.float32)
  for _ in range(3):  # Zero: no NaN, no step, no evidence of signal.
    new, state = step(zeros, state)
    assert (np.asarray(new) == 0).all() and float(state.snr) == 0.0
    assert finite(state)
  # (At 1e38 the norm of u passes float32's maximum: the step is 0.)
  for scale in (1e-30, 1e30, 1e38, 1.0, 1e20):
    u = np.array([1.0, -2.0, 0.5, 1.0, 3.0], np.float32) * np.float32(scale)
    new, state = step(u.astype(np.float32), state)
    assert finite(state), scale
    assert finite(new), scale
    rms = float(np.sqrt(np.mean(np.square(np.asarray(new, np.float64)))))
    assert rms <= tau * (1 + 1e-5), scale
    if scale in (1e20, 1e30):  # The cap binds: the step is tau long.
      np.testing.assert_allclose(rms, tau, rtol=1e-4)
  new, state = step(zeros, state)  # And back to zero.
  assert (np.asarray(new) == 0).all() and np.isfinite(float(state.snr))
  # The statistics see a spike at a norm of 1e18: two equal spikes are
  # signal, two opposite ones noise (their squares would overflow).
  d = np.array([1.0, -2.0, 0.5, 1.0, 3.0], np.float32) * np.float32(1e30)
  for second, snr in ((d, 1.0), (-d, 0.0)):
    _, state = step(second, step(d, tx.init(d))[1])
    np.testing.assert_allclose(float(state.snr), snr, atol=1e-5)


def test_empty_padded_and_shaped_entropies():
  tx = conga.conga(1e-3, num_classes=C)
  u = jnp.asarray(np.arange(6.0, dtype=np.float32))
  update = jax.jit(lambda s, h: tx.update(u, s, entropies=h)[1])
  host = lambda state: jax.tree.map(np.asarray, state)
  state = update(tx.init(u), np.array([0.5, 2.0, 0.1], np.float32))
  ema = tuple(np.asarray(x) for x in (
      state.entropy_ema, state.entropy_batches, state.initial_entropy))
  for empty in (np.zeros((0,), np.float32), np.full((4,), np.nan,
                                                    np.float32)):
    after = host(update(state, empty))
    assert float(after.confident_fraction) == 0.0
    assert (after.entropy_ema, after.entropy_batches,
            after.initial_entropy) == ema
    assert float(after.lower) == pytest.approx(1e-4)
  h = np.array([[0.5, 2.0], [0.1, 3.0]], np.float32)
  shaped = host(update(state, h))
  padded = host(update(state, np.concatenate(
      [h.ravel(), np.array([np.nan, np.inf], np.float32)])))
  for field in STATE_FIELDS + ('entropy_ema',):
    assert getattr(shaped, field) == getattr(padded, field), field
  assert float(shaped.confident_fraction) == 0.5


def test_inject_hyperparams_changes_the_base_rate_mid_run():
  kw = dict(learning_rate=1e-3, num_classes=C, max_update_rms=math.inf)
  injected = optax.inject_hyperparams(conga.conga)(**kw)
  params = jnp.zeros(4)
  h = jnp.array([0.1, 0.2, 2.0, 2.1])  # c = 0.5.
  step = jax.jit(lambda tx, u, s: tx.update(u, s, entropies=h),
                 static_argnums=0)
  state = injected.init(params)
  assert state.hyperparams['num_classes'].dtype == jnp.int32
  for _ in range(2):
    _, state = step(injected, jnp.ones(4), state)
  state.hyperparams['learning_rate'] = jnp.asarray(4e-3, jnp.float32)
  got, new = step(injected, jnp.ones(4), state)
  want, ref = step(conga.conga(**{**kw, 'learning_rate': 4e-3}), jnp.ones(4),
                   state.inner_state)
  np.testing.assert_array_equal(got, want)
  old, _ = step(conga.conga(**kw), jnp.ones(4), state.inner_state)
  assert float(new.inner_state.lower) == pytest.approx(
      4e-4 + 0.5 * (4e-3 - 4e-4))
  assert float(ref.lower) == float(new.inner_state.lower)
  assert not np.allclose(got, old)


def test_num_classes_is_a_hyperparameter_or_static_under_inject():
  # An int is injected as an int32 hyperparameter (E0 follows it); with
  # static_args it stays a Python int. Both step as the plain one.
  h = jnp.array([0.5, 0.8, 1.2, 2.0])  # E0 = 0.4 ln C: 0.55, 0.92, 1.38.
  kw = dict(learning_rate=1e-3, num_classes=10, total_steps=20)
  plain = conga.conga(**kw)
  injected = optax.inject_hyperparams(conga.conga)(**kw)
  static = optax.inject_hyperparams(
      conga.conga, static_args=('num_classes', 'total_steps'))(**kw)
  u = jnp.ones(3)
  want, _ = jax.jit(lambda u: plain.update(u, plain.init(u), entropies=h))(u)
  for tx in (injected, static):
    got, state = jax.jit(lambda u, s, tx=tx: tx.update(u, s, entropies=h))(
        u, tx.init(u))
    np.testing.assert_array_equal(got, want)
  assert 'num_classes' not in static.init(u).hyperparams
  fractions = []
  for classes in (4, 10, 40):
    state = injected.init(u)
    state.hyperparams['num_classes'] = jnp.asarray(classes, jnp.int32)
    _, state = jax.jit(injected.update)(u, state, entropies=h)
    fractions.append(
        float(conga.diagnostics(state)['conga_confident_fraction']))
  assert fractions == [0.25, 0.5, 0.75]


def test_a_learning_rate_schedule_goes_through_inject_hyperparams():
  tx = optax.inject_hyperparams(conga.conga)(
      learning_rate=optax.linear_schedule(1e-3, 2e-3, 4), num_classes=C)
  state = tx.init(jnp.zeros(2))
  step = jax.jit(lambda s: tx.update(jnp.ones(2), s, entropies=jnp.zeros(3)))
  lowers = []
  for _ in range(4):
    _, state = step(state)
    lowers.append(float(state.inner_state.lower))
  np.testing.assert_allclose(lowers, [1e-3, 1.25e-3, 1.5e-3, 1.75e-3],
                             rtol=1e-6)


@pytest.mark.parametrize('kwargs,argument', [
    (dict(learning_rate=-1e-3), 'learning_rate'),
    (dict(learning_rate=math.nan), 'learning_rate'),
    (dict(learning_rate=optax.constant_schedule(1e-3)), 'learning_rate'),
    (dict(num_classes=1), 'num_classes'),
    (dict(num_classes=2.5), 'num_classes'),
    (dict(min_learning_rate=-1e-4), 'min_learning_rate'),
    (dict(min_learning_rate=2e-3), 'min_learning_rate'),
    (dict(max_learning_rate=5e-4), 'max_learning_rate'),
    (dict(max_learning_rate=math.inf), 'max_learning_rate'),
    (dict(margin=0.0), 'margin'),
    (dict(margin=1.5), 'margin'),
    (dict(grad_decay=0.0), 'grad_decay'),
    (dict(grad_decay=1.0), 'grad_decay'),
    (dict(entropy_decay=1.0), 'entropy_decay'),
    (dict(entropy_decay=-0.1), 'entropy_decay'),
    (dict(max_update_rms=0.0), 'max_update_rms'),
    (dict(total_steps=0), 'total_steps'),
    (dict(total_steps=10.5), 'total_steps'),
])
def test_bad_arguments_raise_an_argument_error_naming_them(kwargs, argument):
  full = {'learning_rate': 1e-3, 'num_classes': C, **kwargs}
  with pytest.raises(validation.ArgumentError) as info:
    conga.conga(**full)
  assert info.value.argument == argument
  assert info.value.owner == 'geom.conga.conga'
  assert str(info.value).startswith(f'geom.conga.conga: {argument}')
  if not callable(kwargs.get('learning_rate')):
    # Under inject_hyperparams the values are checked at init.
    with pytest.raises(validation.ArgumentError, match=argument):
      optax.inject_hyperparams(conga.conga)(**full).init(jnp.zeros(2))


def test_update_without_entropies_is_an_argument_error():
  tx = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=C))
  with pytest.raises(validation.ArgumentError) as info:
    # Raised while tracing: nothing is compiled.
    jax.jit(tx.update)(jnp.ones(2), jax.jit(tx.init)(jnp.zeros(2)),
                       jnp.zeros(2))
  assert info.value.argument == 'entropies'


def _numpy_entropy(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  with np.errstate(divide='ignore', invalid='ignore'):
    return -np.where(p > 0, p * np.log(p), 0.0).sum(-1)


def test_entropies_from_logits_match_numpy_and_are_stable():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, C)) * 3
  # The product function jitted (eager, each of its ops compiles apart).
  entropies = jax.jit(conga.entropies_from_logits)
  got = entropies(logits.astype(np.float32))
  assert got.shape == (2, 5) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, _numpy_entropy(logits.astype(np.float32)),
                             rtol=1e-5, atol=1e-6)
  extreme = np.array([[1e4, 0.0, -1e4], [0.0, 0.0, 0.0],
                      [-np.inf, 1.0, 2.0], [3e38, 3e38, -3e38]], np.float32)
  got = entropies(extreme)
  np.testing.assert_allclose(got, _numpy_entropy(extreme), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(got[1], math.log(3), rtol=1e-6)
  bf16 = jnp.asarray(logits[0], jnp.bfloat16)
  got = entropies(bf16)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, _numpy_entropy(np.asarray(bf16, np.float32)),
                             rtol=1e-5, atol=1e-6)
  # The entropy is a TTA loss too: its gradient is finite at -inf logits.
  grad = jax.jit(jax.grad(lambda z: conga.entropies_from_logits(z).sum()))(
      jnp.asarray(extreme[2:3]))
  assert np.isfinite(np.asarray(grad)).all()


def test_diagnostics_find_the_state_in_any_optax_state():
  base = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=C))
  txs = {
      'chain': base,
      'inject': optax.inject_hyperparams(conga.conga)(1e-3, num_classes=C),
      'multi_steps': optax.MultiSteps(base, every_k_schedule=2),
      'sam': sam.sam(base, rho=0.05, detector=None),
  }
  params = jnp.zeros(3)
  grad_fn = lambda p: p - 1.0
  for name, tx in txs.items():
    step = jax.jit(lambda s, tx=tx: tx.update(
        grad_fn(params), s, params, entropies=jnp.array([0.1, 2.0]),
        grad_fn=grad_fn)[1])
    state = step(step(tx.init(params)))
    d = conga.diagnostics(state)
    assert set(d) == {'conga_rate', 'conga_lower', 'conga_upper',
                      'conga_confident_fraction', 'conga_snr',
                      'conga_progress'}, name
    assert float(d['conga_confident_fraction']) == 0.5, name
    assert float(d['conga_rate']) > 0, name
  assert conga.find_state(optax.sgd(0.1).init(params)) is None
  with pytest.raises(validation.ArgumentError, match='no geom.conga'):
    conga.diagnostics(optax.sgd(0.1).init(params))


def test_hooks_ask_for_entropies_and_report_the_rate():
  hooks = conga.hooks()
  assert hooks.name == 'conga' and hooks.update_arguments == ('entropies',)
  assert 'entropies' in method_hooks.UPDATE_ARGUMENTS
  tx = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=C))
  state = tx.init(jnp.zeros(2))
  assert set(hooks.console) <= set(hooks.diagnostics(state))
  both = method_hooks.combine(sam.hooks(sam.SAMOptions()), hooks)
  assert both.update_arguments == ('grad_fn', 'entropies')
  assert 'conga_rate' in both.console


def test_docstring_examples_run():
  result = doctest.testmod(conga, verbose=False)
  assert result.attempted > 0 and result.failed == 0
