"""geom.sam against independent references: optax's SAM, hand-written ASAM and m-sharpness."""

import doctest
import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from geom import hallucination
from geom import sam
from tests import transformation_battery as battery


def _mlp():
  params, loss, batch = battery.problem()
  return params, lambda p: loss(p, batch), batch


def _trajectory(tx, params, loss_fn, steps, jit=True, **extra):
  grad = jax.grad(loss_fn)

  def one(p, s):
    u, s = tx.update(grad(p), s, p, grad_fn=grad, **extra)
    return optax.apply_updates(p, u), s

  one = jax.jit(one) if jit else one
  state = tx.init(params)
  for _ in range(steps):
    params, state = one(params, state)
  return params, state


def _max_diff(a, b):
  # On host arrays (float32 differences, as before): no eager device ops.
  return max(float(np.max(np.abs(np.asarray(x).astype(np.float32) -
                                 np.asarray(y).astype(np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_equals_optax_contrib_sam_in_opaque_mode():
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  base = lambda: optax.sgd(0.05, momentum=0.9)
  ours, _ = _trajectory(sam.sam(base(), rho=0.1), params, loss, 20)
  ref_tx = optax.contrib.sam(
      base(), optax.chain(optax.contrib.normalize(), optax.sgd(0.1)),
      opaque_mode=True)
  p, s = params, ref_tx.init(params)
  @jax.jit
  def step(p, s):
    u, s = ref_tx.update(grad(p), s, p, grad_fn=lambda q, i: grad(q))
    return optax.apply_updates(p, u), s

  for _ in range(20):
    p, s = step(p, s)
  assert _max_diff(ours, p) < 1e-6


@pytest.mark.parametrize('mode', ['opaque', 'two_call'])
def test_rho_zero_is_the_base_optimizer_exactly(mode):
  # Op by op (no jit): one jitted program may round differently from another
  # even for the same arithmetic, which says nothing about the method.
  params, loss, _ = _mlp()
  base = lambda: optax.adamw(1e-2, weight_decay=1e-3)
  want, _ = _trajectory(optax.with_extra_args_support(base()), params, loss,
                        4, jit=False)
  if mode == 'opaque':
    got, state = _trajectory(sam.sam(base(), rho=0.0), params, loss, 4,
                             jit=False)
  else:
    got, state = _two_call_trajectory(sam.sam(base(), rho=0.0,
                                              mode='two_call'),
                                      params, loss, 4, jit=False)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert not bool(sam.diagnostics(state)['sam_active'])


def test_a_rho_schedule_that_reaches_zero_gives_plain_steps():
  params, loss, _ = _mlp()
  schedule = optax.linear_schedule(0.1, 0.0, 3)  # 0.1, 0.067, 0.033, 0, 0 ...
  tx = sam.sam(optax.sgd(0.05), rho=schedule)
  _, state = _trajectory(tx, params, loss, 5)
  assert not bool(state.sam_active) and float(state.rho) == 0.0
  _, state = _trajectory(tx, params, loss, 2)
  assert bool(state.sam_active)
  np.testing.assert_allclose(float(state.rho), 0.1 * 2 / 3, rtol=1e-6)


def test_asam_matches_a_hand_written_reference():
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  rho, eta, lr = 0.5, 0.01, 0.05
  got, _ = _trajectory(sam.sam(optax.sgd(lr), rho=rho, adaptive=True,
                               eta=eta), params, loss, 5)
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  for _ in range(5):
    g = jax.tree.map(lambda x: np.asarray(x, np.float64),
                     grad(jax.tree.map(jnp.float32, p)))
    t = jax.tree.map(lambda w: np.abs(w) + eta, p)
    norm = np.sqrt(sum(np.sum((ti * gi) ** 2)
                       for ti, gi in zip(jax.tree.leaves(t),
                                         jax.tree.leaves(g))))
    adv = jax.tree.map(lambda w, ti, gi: w + rho * ti * ti * gi / norm, p, t,
                       g)
    g_adv = grad(jax.tree.map(jnp.float32, adv))
    p = jax.tree.map(lambda w, ga: w - lr * np.asarray(ga, np.float64), p,
                     g_adv)
  assert _max_diff(got, jax.tree.map(jnp.float32, p)) < 1e-5


def _per_device_trajectory(tx, params, loss_fn, batch, steps):
  """`steps` updates inside shard_map over 8 devices, each with its rows."""
  mesh = jax.make_mesh((8,), ('batch',),
                       axis_types=(jax.sharding.AxisType.Auto,))

  @functools.partial(
      jax.shard_map, mesh=mesh,
      in_specs=(P(), P(), P('batch')), out_specs=(P(), P()))
  def step(p, s, b):
    # The gradient at the device-varying copy of p is this device's own; at
    # the replicated p, shard_map would already sum it over the axis.
    grad = lambda q: jax.grad(loss_fn)(q, b)
    local_p = jax.lax.pcast(p, 'batch', to='varying')
    u, s = tx.update(grad(local_p), s, p, grad_fn=grad)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  for _ in range(steps):
    params, state = jax.jit(step)(params, state, batch)
  return params


def test_m_sharpness_matches_a_per_device_loop():
  params, loss_fn, batch = battery.problem()
  rho, lr = 0.1, 0.05
  tx = sam.sam(optax.sgd(lr), rho=rho, batch_axis_name='batch')
  got = _per_device_trajectory(tx, params, loss_fn, batch, 3)

  want = params
  shards = [jax.tree.map(lambda x: x[i * 8:(i + 1) * 8], batch)
            for i in range(8)]

  @jax.jit  # The reference step, written out; jitted as one program.
  def reference_step(want, shards):
    perturbed_grads = []
    for b in shards:
      g = jax.grad(loss_fn)(want, b)
      norm = optax.tree.norm(g)
      adv = jax.tree.map(lambda w, gi: w + rho * gi / norm, want, g)
      perturbed_grads.append(jax.grad(loss_fn)(adv, b))
    mean = jax.tree.map(lambda *gs: sum(gs) / 8, *perturbed_grads)
    return jax.tree.map(lambda w, g: w - lr * g, want, mean)

  for _ in range(3):
    want = reference_step(want, shards)
  assert _max_diff(got, want) < 1e-5
  # And it differs from global SAM (the point of m-sharpness).
  global_sam, _ = _trajectory(sam.sam(optax.sgd(lr), rho=rho), params,
                              lambda p: loss_fn(p, batch), 3)
  assert _max_diff(global_sam, want) > 1e-4


def test_bfloat16_params_are_perturbed_in_float32():
  params, loss, _ = _mlp()
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  grad = jax.grad(lambda p: loss(jax.tree.map(jnp.float32, p)))
  seen = []

  def grad_fn(p):
    jax.debug.callback(lambda q: seen.append(q), p)  # The values, not tracers.
    return grad(p)

  tx = sam.sam(optax.sgd(0.05), rho=0.05)
  g = grad(params)
  updates, _ = tx.update(g, tx.init(params), params, grad_fn=grad_fn)
  jax.effects_barrier()
  assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
  g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g)
  norm = np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in
                     jax.tree.leaves(g32)))
  want = jax.tree.map(
      lambda w, gi: (w.astype(jnp.float32) + 0.05 * gi / norm).astype(
          jnp.bfloat16), params, g32)
  jax.tree.map(np.testing.assert_array_equal, seen[-1], want)


def test_warmup_steps_do_not_compute_the_second_gradient():
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  calls = []

  def counted_grad_fn(p):
    jax.debug.callback(lambda: calls.append(1))
    return grad(p)

  tx = sam.sam(optax.sgd(0.05), rho=0.05, warmup_steps=3)

  @jax.jit
  def step(p, s):
    u, s = tx.update(grad(p), s, p, grad_fn=counted_grad_fn)
    return optax.apply_updates(p, u), s

  p, s = params, tx.init(params)
  active = []
  for _ in range(5):
    p, s = step(p, s)
    active.append(bool(s.sam_active))
  jax.effects_barrier()
  assert active == [False, False, False, True, True]
  assert len(calls) == 2  # Executed on the two SAM steps only.
  # And the warm-up steps are the base optimizer's, exactly.
  want, _ = _trajectory(optax.with_extra_args_support(optax.sgd(0.05)),
                        params, loss, 3, jit=False)
  got, _ = _trajectory(tx, params, loss, 3, jit=False)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_window_limits_sam_to_its_steps():
  params, loss, _ = _mlp()
  tx = sam.sam(optax.sgd(0.05), rho=0.05, window=(2, 4))
  grad = jax.grad(loss)
  step = jax.jit(lambda p, s: tx.update(grad(p), s, p, grad_fn=grad))
  p, s, active = params, tx.init(params), []
  for _ in range(6):
    u, s = step(p, s)
    p = optax.apply_updates(p, u)
    active.append(bool(s.sam_active))
  assert active == [False, False, True, True, False, False]


def _perturbation_points(tx, params, loss, steps):
  """Runs `tx` jitted; per step (w, g at w, the point grad_fn was asked at,
  None on a plain step) and the states after each step."""
  grad = jax.grad(loss)
  asked = []

  def recording_grad_fn(p):
    jax.debug.callback(lambda q: asked.append(jax.tree.map(np.asarray, q)), p)
    return grad(p)

  step = jax.jit(lambda p, s: tx.update(grad(p), s, p,
                                        grad_fn=recording_grad_fn))
  state, out, states = tx.init(params), [], []
  for _ in range(steps):
    asked.clear()
    updates, state = step(params, state)
    jax.effects_barrier()
    assert len(asked) <= 1
    out.append((params, grad(params), asked[0] if asked else None))
    states.append(state)
    params = optax.apply_updates(params, updates)
  return out, states


@pytest.mark.parametrize('threshold,flags,scales', [
    # Every SAM step is suspicious (|g+|/|g| is near 1 < 10): with patience
    # 2 the detector fires on steps 1, 3 and 5, and rho halves after each.
    (10.0, [0, 1, 1, 2, 2, 3], [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]),
    # No step is suspicious: rho is never touched.
    (1e-3, [0] * 6, [1.0] * 6),
])
def test_shrink_rho_halves_rho_after_each_flag_only(threshold, flags, scales):
  params, loss, _ = _mlp()
  tx = sam.sam(optax.sgd(0.05), rho=0.08, response='shrink_rho',
               shrink_factor=0.5, detector=hallucination.DetectorConfig(
                   patience=2, ratio_threshold=threshold))
  points, states = _perturbation_points(tx, params, loss, len(scales))
  for (w, g, asked), scale in zip(points, scales):
    # The point SAM evaluates g+ at, against w + rho g / |g| by hand.
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
    norm = np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(g)))
    want = jax.tree.map(lambda wi, gi: wi + 0.08 * scale * gi / norm, w, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                 asked, want)
  assert [int(s.detector.flagged_steps) for s in states] == flags
  np.testing.assert_allclose([float(s.rho) for s in states],
                             [0.08 * s for s in scales], rtol=1e-6)


def _two_call_trajectory(tx, params, loss, steps, jit=True):
  grad = jax.grad(loss)

  def update(params, state):
    updates, state = tx.update(grad(params), state, params)
    return optax.apply_updates(params, updates), state

  if jit:
    update = jax.jit(update)
  state = tx.init(params)
  done = 0
  while done < steps:
    params, state = update(params, state)
    done = int(state.count)
  return params, state


def test_two_call_mode_follows_the_opaque_trajectory():
  params, loss, _ = _mlp()
  kw = dict(rho=0.1, warmup_steps=2)
  opaque, s1 = _trajectory(sam.sam(optax.sgd(0.05, momentum=0.9), **kw),
                           params, loss, 6)
  two, s2 = _two_call_trajectory(
      sam.sam(optax.sgd(0.05, momentum=0.9), mode='two_call', **kw), params,
      loss, 6)
  assert _max_diff(opaque, two) < 1e-5
  d1, d2 = sam.diagnostics(s1), sam.diagnostics(s2)
  np.testing.assert_allclose(d1['grad_ratio'], d2['grad_ratio'], rtol=1e-4)


def test_inject_hyperparams_changes_lr_and_rho_mid_run():
  params, loss, _ = _mlp()
  tx = optax.inject_hyperparams(sam.sam)(
      base_optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
      rho=0.05)
  p, s = _trajectory(tx, params, loss, 3)
  s.hyperparams['rho'] = jnp.asarray(0.2)
  s.inner_state.base_state.hyperparams['learning_rate'] = jnp.asarray(0.01)
  grad = jax.grad(loss)
  u, s = tx.update(grad(p), s, p, grad_fn=grad)
  got = optax.apply_updates(p, u)
  e, _ = sam.perturbation(grad(p), p, 0.2)
  want = jax.tree.map(lambda w, g: w - 0.01 * g, p,
                      grad(sam.perturbed_params(p, e)))
  assert _max_diff(got, want) < 1e-6


def test_multisteps_accumulates_g_then_perturbs_with_the_mean():
  params, loss_fn, batch = battery.problem()
  micro = [jax.tree.map(lambda x: x[i * 16:(i + 1) * 16], batch)
           for i in range(3)]
  tx = optax.MultiSteps(sam.sam(optax.sgd(0.05), rho=0.1),
                        every_k_schedule=3)

  @jax.jit  # One program for the three micro-steps (the batch is traced).
  def step(p, s, b):
    grad = lambda q: jax.grad(loss_fn)(q, b)
    u, s = tx.update(grad(p), s, p, grad_fn=grad)
    return optax.apply_updates(p, u), s

  s, p = tx.init(params), params
  for b in micro:
    p, s = step(p, s, b)

  @jax.jit  # The reference, as before, in one program.
  def reference(params, micro):
    mean_g = jax.tree.map(lambda *g: sum(g) / 3,
                          *[jax.grad(loss_fn)(params, b) for b in micro])
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(mean_g)))
    adv = jax.tree.map(lambda w, g: w + 0.1 * g / norm, params, mean_g)
    # grad_fn of the last micro-step evaluates the perturbed gradient.
    g_adv = jax.grad(loss_fn)(adv, micro[-1])
    return jax.tree.map(lambda w, g: w - 0.05 * g, params, g_adv)

  want = reference(params, micro)
  assert _max_diff(p, want) < 1e-6


def test_apply_if_finite_skips_a_nan_step():
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  tx = optax.apply_if_finite(sam.sam(optax.sgd(0.05), rho=0.05), 3)
  s = tx.init(params)
  nan_grads = jax.tree.map(lambda g: np.asarray(g) * np.nan,
                           jax.jit(grad)(params))
  u, s = jax.jit(lambda g, s, p: tx.update(g, s, p, grad_fn=lambda q: g))(
      nan_grads, s, params)
  assert all(float(np.max(np.abs(np.asarray(x)))) == 0
             for x in jax.tree.leaves(u))
  assert int(s.notfinite_count) == 1
  u, s = jax.jit(lambda s, p: tx.update(grad(p), s, p, grad_fn=grad))(
      s, params)
  assert int(s.notfinite_count) == 0
  assert float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(u)))) > 0


def test_zero_gradient_gives_no_nan():
  params, _, _ = _mlp()
  zeros = jax.tree.map(jnp.zeros_like, params)
  for adaptive in (False, True):
    tx = sam.sam(optax.sgd(0.1), rho=0.05, adaptive=adaptive)
    u, s = tx.update(zeros, tx.init(params), params, grad_fn=lambda p: zeros)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
    assert all(bool(jnp.isfinite(v)) for v in sam.diagnostics(s).values())


def test_diagnostics_report_the_step():
  params, loss, _ = _mlp()
  with_cosine = hallucination.DetectorConfig(track_cosine=True)
  _, state = _trajectory(sam.sam(optax.sgd(0.05), rho=0.05,
                                 detector=with_cosine), params, loss, 3)
  d = sam.diagnostics(optax.chain(optax.identity()).init(params) + (state,))
  for key in ('grad_norm', 'perturbed_grad_norm', 'hallucination',
              'hallucination_steps', 'sam_active', 'grad_ratio', 'cosine',
              'rho'):
    assert key in d
  assert bool(d['sam_active']) and not bool(d['hallucination'])
  assert float(d['grad_norm']) > 0 and 0.9 < float(d['cosine']) <= 1.0
  with pytest.raises(ValueError, match='contains no geom.sam.sam state'):
    sam.diagnostics(optax.sgd(0.1).init(params))


@pytest.mark.parametrize('kwargs,match', [
    (dict(rho=-0.1), r'rho=-0.1: must be finite and >= 0'),
    (dict(rho=float('inf')), r'rho=inf: must be finite and >= 0'),
    (dict(warmup_steps=-1), r'warmup_steps=-1: must be >= 0'),
    (dict(window=(5, 5)), r'window=\(5, 5\): empty'),
    (dict(window=(5, 2)), r'window=\(5, 2\): empty'),
    (dict(adaptive=True, eta=0.0), r'eta=0.0: must be finite and > 0'),
    (dict(response='panic'), r"response='panic'; valid choices: flag, "
     r'warm_restart, shrink_rho'),
    (dict(mode='lazy'), r"mode='lazy'; valid choices: opaque, two_call"),
    (dict(shrink_factor=1.5), r'shrink_factor=1.5: must be in \(0, 1\)'),
    (dict(response='shrink_rho', detector=None), r'needs a detector'),
])
def test_bad_arguments_are_named_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sam.sam(optax.sgd(0.1), **kwargs)


def test_missing_grad_fn_is_named_at_the_first_call():
  params, loss, _ = _mlp()
  tx = sam.sam(optax.sgd(0.1))
  with pytest.raises(ValueError, match=r'needs grad_fn='):
    tx.update(jax.grad(loss)(params), tx.init(params), params)


def test_detector_config_validates_its_fields():
  with pytest.raises(ValueError, match=r'DetectorConfig.patience=0'):
    hallucination.DetectorConfig(patience=0)


@pytest.mark.parametrize('adaptive', [False, True])
def test_cosine_from_the_applied_perturbation_matches_the_direct_one(
    adaptive):
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  tx = sam.sam(optax.sgd(0.05), rho=0.05, adaptive=adaptive,
               detector=hallucination.DetectorConfig(track_cosine=True))
  g = grad(params)
  _, state = tx.update(g, tx.init(params), params, grad_fn=grad)
  e, _ = sam.perturbation(g, params, 0.05, adaptive=adaptive)
  g_adv = grad(sam.perturbed_params(params, e))
  want = float(optax.tree.vdot(g, g_adv) /
               (optax.tree.norm(g) * optax.tree.norm(g_adv)))
  got = sam.diagnostics(state)
  np.testing.assert_allclose(float(got['cosine']), want, atol=1e-4)
  np.testing.assert_allclose(float(got['grad_norm']),
                             float(optax.tree.norm(g)), rtol=1e-5)


def test_default_detector_omits_the_cosine():
  params, loss, _ = _mlp()
  cfg = hallucination.DetectorConfig()
  _, state = _trajectory(sam.sam(optax.sgd(0.05), rho=0.05, detector=cfg),
                         params, loss, 3)
  d = sam.diagnostics(state)
  assert 'cosine' not in d and 'cosine_ema' not in d
  assert float(d['grad_ratio']) > 0 and int(d['sam_steps']) == 3


def test_docstring_example_runs():
  result = doctest.testmod(sam, verbose=False)
  assert result.attempted > 0 and result.failed == 0


def test_sam_step_fixes_the_branch_at_trace_time():
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  tx = sam.sam(optax.sgd(0.05), rho=0.1, warmup_steps=1)
  state = tx.init(params)
  g = grad(params)
  free, s_free = jax.jit(lambda p, s: tx.update(grad(p), s, p,
                                                grad_fn=grad))(params, state)
  plain, s_plain = tx.update(g, state, params, grad_fn=grad, sam_step=False)
  _close = lambda a, b: jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
      a, b)
  _close(plain, free)  # Step 0 is a warm-up step either way.
  assert not bool(s_plain.sam_active) and not bool(s_free.sam_active)
  sam_updates, s_sam = tx.update(grad(params), s_plain, params, grad_fn=grad,
                                 sam_step=True)
  free, s_free = jax.jit(lambda p, s: tx.update(grad(p), s, p,
                                                grad_fn=grad))(params, s_free)
  _close(sam_updates, free)
  assert bool(s_sam.sam_active) and int(s_sam.detector.sam_steps) == 1
  warm = sam.SAMOptions(rho=0.1, warmup_steps=1)
  assert sam.is_sam_step(warm, 0) is False and sam.is_sam_step(warm, 1) is True
  with pytest.raises(ValueError, match="sam_step.*is for mode='opaque'"):
    two = sam.sam(optax.sgd(0.1), mode='two_call')
    two.update(g, two.init(params), params, sam_step=True)


def _optax_trajectory(tx, params, loss, steps, grad_fn_of):
  grad = jax.grad(loss)
  step = jax.jit(lambda p, s: tx.update(grad(p), s, p,
                                        grad_fn=grad_fn_of(grad)))
  state = tx.init(params)
  for _ in range(steps):
    u, state = step(params, state)
    params = optax.apply_updates(params, u)
  return params, state


def test_grad_fn_in_optax_form_is_accepted():
  # One grad_fn, written for optax.contrib.sam (params, i), drives both.
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  optax_grad_fn = lambda p, i: grad(p)
  ref_tx = optax.contrib.sam(
      optax.sgd(0.05), optax.chain(optax.contrib.normalize(), optax.sgd(0.1)),
      opaque_mode=True)
  want, _ = _optax_trajectory(ref_tx, params, loss, 5, lambda g: optax_grad_fn)
  got, _ = _optax_trajectory(sam.sam(optax.sgd(0.05), rho=0.1), params, loss,
                             5, lambda g: optax_grad_fn)
  assert _max_diff(got, want) < 1e-6
  # jax.grad of a two-argument loss keeps its signature: also recognised.
  two_args = jax.grad(lambda p, i: loss(p))
  got2, _ = _optax_trajectory(sam.sam(optax.sgd(0.05), rho=0.1), params,
                              loss, 5, lambda g: two_args)
  assert _max_diff(got2, want) < 1e-6


@pytest.mark.parametrize('reset', [True, False])
@pytest.mark.parametrize('adversary', ['sgd', 'adam'])
def test_ascent_transformation_equals_optax_adv_optimizer(adversary, reset):
  # optax's own SAM tests use an sgd and an adam adversary; with
  # ascent=adv_opt and rho=1, geom follows optax's trajectory.
  params, loss, _ = _mlp()
  make_adv = lambda: optax.chain(
      optax.contrib.normalize(),
      optax.sgd(0.1) if adversary == 'sgd' else optax.adam(0.02))
  base = lambda: optax.sgd(0.05, momentum=0.9)
  ref_tx = optax.contrib.sam(base(), make_adv(), opaque_mode=True,
                             reset_state=reset)
  want, ref_state = _optax_trajectory(ref_tx, params, loss, 8,
                                      lambda g: lambda p, i: g(p))
  ours = sam.sam(base(), rho=1.0, ascent=make_adv(), reset_ascent=reset)
  got, state = _trajectory(ours, params, loss, 8)
  assert _max_diff(got, want) < 1e-6
  # Not a vacuous match: the adversary's state is kept or reset as asked.
  adam_count = lambda s: [x for x in jax.tree.leaves(s)
                          if x.dtype == jnp.int32]
  if adversary == 'adam':
    assert [int(c) for c in adam_count(state.ascent_state)] == (
        [0] if reset else [8])
    assert [int(c) for c in adam_count(ref_state.adv_state)] == (
        [0] if reset else [8])


def test_ascent_changes_the_step_and_its_default_is_the_normalized_one():
  params, loss, _ = _mlp()
  plain, _ = _trajectory(sam.sam(optax.sgd(0.05), rho=0.1), params, loss, 4)
  normalized, _ = _trajectory(
      sam.sam(optax.sgd(0.05), rho=0.1,
              ascent=optax.chain(optax.contrib.normalize(),
                                 optax.scale(-1.0))), params, loss, 4)
  assert _max_diff(plain, normalized) < 1e-6
  adam, _ = _trajectory(
      sam.sam(optax.sgd(0.05), rho=0.1,
              ascent=optax.chain(optax.contrib.normalize(), optax.adam(1.0))),
      params, loss, 4)
  assert _max_diff(plain, adam) > 1e-4


def test_ascent_in_two_call_mode_follows_optax_transparent_mode():
  params, loss, _ = _mlp()
  make_adv = lambda: optax.chain(optax.contrib.normalize(), optax.adam(0.02))
  ref_tx = optax.contrib.sam(optax.sgd(0.05), make_adv(), sync_period=2)
  grad = jax.grad(loss)
  p, s = params, ref_tx.init(params)
  step = jax.jit(lambda p, s: ref_tx.update(grad(p), s, p))
  for _ in range(12):
    u, s = step(p, s)
    p = optax.apply_updates(p, u)
  got, state = _two_call_trajectory(
      sam.sam(optax.sgd(0.05), rho=1.0, ascent=make_adv(), mode='two_call'),
      params, loss, 6)
  assert int(state.count) == 6
  assert _max_diff(got, p) < 1e-6


def test_ascent_optimises_optax_parabola():
  # optax's contrib/_sam_test.py: the adam adversary, 2 x 25000 steps.
  target = jnp.array([1.0, -1.0, 1.0])
  grad = jax.grad(lambda p: jnp.sum(jnp.square(p - target)))
  tx = sam.sam(optax.sgd(1e-3), rho=1.0,
               ascent=optax.chain(optax.contrib.normalize(),
                                  optax.adam(1e-4)))

  def body(_, carry):
    p, s = carry
    u, s = tx.update(grad(p), s, p, grad_fn=grad)
    return optax.apply_updates(p, u), s

  p0 = jnp.array([-1.0, 10.0, 1.0])
  p, _ = jax.jit(lambda p: jax.lax.fori_loop(0, 25000, body,
                                             (p, tx.init(p))))(p0)
  np.testing.assert_allclose(p, target, rtol=3e-2, atol=3e-2)


def test_ascent_with_m_sharpness_perturbs_per_device():
  params, loss_fn, batch = battery.problem()
  adv = lambda: optax.chain(optax.contrib.normalize(), optax.sgd(0.1))
  tx = sam.sam(optax.sgd(0.05), rho=1.0, batch_axis_name='batch',
               ascent=adv())
  ref = sam.sam(optax.sgd(0.05), rho=0.1, batch_axis_name='batch')
  run = lambda t: _per_device_trajectory(t, params, loss_fn, batch, 3)
  assert _max_diff(run(tx), run(ref)) < 1e-5
  with pytest.raises(ValueError, match='reset_ascent=False'):
    sam.sam(optax.sgd(0.1), batch_axis_name='batch', ascent=adv(),
            reset_ascent=False)


# LookSAM's reuse (`every=k`) against a hand-written loop in plain jnp.


def _looksam_reference(params, loss, steps, k, lr, rho, alpha):
  """Liu et al.'s Algorithm 1 on the flattened weights with SGD: the
  updates, the g_v after each step and the steps that took g+."""
  w, unravel = jax.flatten_util.ravel_pytree(params)
  grad = jax.jit(lambda v: jax.flatten_util.ravel_pytree(
      jax.grad(loss)(unravel(v)))[0])
  norm = lambda v: jnp.sqrt(jnp.sum(v * v))
  g_v, updates, stored = jnp.zeros_like(w), [], []
  for t in range(steps):
    g = grad(w)
    if t % k == 0:
      g_s = grad(w + rho * g / (norm(g) + 1e-12))
      cos = jnp.dot(g, g_s) / (norm(g) * norm(g_s))
      g_v = g_s - norm(g_s) * cos * g / norm(g)
      step = g_s
    else:
      step = g + alpha * norm(g) / norm(g_v) * g_v
    updates.append(unravel(-lr * step))
    stored.append(unravel(g_v))
    w = w - lr * step
  return updates, stored


def _updates_of(tx, params, loss, steps, jit=True, grad_fn=None):
  grad = jax.grad(loss)
  grad_fn = grad if grad_fn is None else grad_fn
  update = lambda p, s: tx.update(grad(p), s, p, grad_fn=grad_fn)
  update = jax.jit(update) if jit else update
  state, out, states = tx.init(params), [], []
  for _ in range(steps):
    u, state = update(params, state)
    params = optax.apply_updates(params, u)
    out.append(u)
    states.append(state)
  return out, states


@pytest.mark.parametrize('jit', [True, False])
def test_every_k_follows_a_hand_written_looksam_loop(jit):
  params, loss, _ = _mlp()
  tx = sam.sam(optax.sgd(0.1), rho=0.2, every=3, alpha=0.7)
  got, states = _updates_of(tx, params, loss, 7, jit=jit)
  want, want_g_v = _looksam_reference(params, loss, 7, 3, 0.1, 0.2, 0.7)
  for t in range(7):
    assert _max_diff(got[t], want[t]) < 2e-6, t
    assert _max_diff(states[t].orthogonal, want_g_v[t]) < 2e-6, t
  assert [bool(s.sam_active) for s in states] == [
      True, False, False, True, False, False, True]
  # The reuse steps are not plain steps: g_v moves them.
  plain = -0.1 * jax.flatten_util.ravel_pytree(jax.grad(loss)(
      optax.apply_updates(params, got[0])))[0]
  assert float(jnp.max(jnp.abs(
      jax.flatten_util.ravel_pytree(got[1])[0] - plain))) > 1e-4


def test_every_1_is_sam_exactly():
  params, loss, _ = _mlp()
  want, _ = _updates_of(sam.sam(optax.sgd(0.1), rho=0.2), params, loss, 3)
  got, states = _updates_of(sam.sam(optax.sgd(0.1), rho=0.2, every=1,
                                    alpha=0.3), params, loss, 3)
  for a, b in zip(got, want):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert states[-1].orthogonal is None


def test_every_k_reuse_steps_do_not_call_grad_fn():
  params, loss, _ = _mlp()
  grad, calls = jax.grad(loss), []

  def counted_grad_fn(p):
    jax.debug.callback(lambda: calls.append(1))
    return grad(p)

  tx = sam.sam(optax.sgd(0.1), rho=0.2, every=3)
  _, states = _updates_of(tx, params, loss, 7, grad_fn=counted_grad_fn)
  jax.effects_barrier()
  assert len(calls) == 3  # Steps 0, 3 and 6.
  # The detector saw those three steps only: reuse steps have no g+.
  assert int(sam.diagnostics(states[-1])['sam_steps']) == 3
  assert int(sam.diagnostics(states[-2])['sam_steps']) == 2


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_every_k_keeps_g_v_in_the_parameters_dtype(dtype):
  params, loss, batch = battery.problem(dtype)
  tx = sam.sam(optax.sgd(0.1), rho=0.2, every=2)
  got, states = _updates_of(tx, params, lambda p: loss(p, batch), 4)
  for s in states:
    assert jax.tree.map(lambda x: x.dtype, s.orthogonal) == jax.tree.map(
        lambda x: x.dtype, params)
  assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
             for u in got for x in jax.tree.leaves(u))
  # Step 1 reuses step 0's g_v: LookSAM's rule in float32 on the stored
  # values, rounded to the parameters' dtype.
  w1 = optax.apply_updates(params, got[0])
  g = jax.jit(jax.grad(lambda p: loss(p, batch)))(w1)
  f32 = lambda t: jax.flatten_util.ravel_pytree(
      jax.tree.map(lambda x: x.astype(jnp.float32), t))[0]
  g32, v32 = f32(g), f32(states[0].orthogonal)
  want = -0.1 * (g32 + 0.7 * jnp.linalg.norm(g32) / jnp.linalg.norm(v32)
                 * v32)
  np.testing.assert_allclose(f32(got[1]), want, rtol=2e-2,
                             atol=2e-2 * float(jnp.max(jnp.abs(want))))
  assert float(jnp.linalg.norm(v32)) > 0


def test_every_k_with_zero_or_parallel_gradients_reuses_nothing():
  # g = 0: e = 0, g+ = 0, g_v = 0; the next reuse step is the plain step.
  params, _, _ = _mlp()
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx = sam.sam(optax.sgd(0.1), rho=0.05, every=2)
  u, s = tx.update(zeros, tx.init(params), params, grad_fn=lambda p: zeros)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(s.orthogonal))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
  assert all(bool(jnp.isfinite(v)) for v in sam.diagnostics(s).values())
  g = jax.tree.map(jnp.ones_like, params)
  u, s = tx.update(g, s, params, grad_fn=lambda p: g)
  jax.tree.map(np.testing.assert_array_equal, u,
               jax.tree.map(lambda x: -0.1 * x, g))
  # g = 0 but g+ not (a grad_fn on purpose inconsistent with g): nothing
  # to project on, so g_v = g+, not NaN and not 0.
  _, s = tx.update(zeros, tx.init(params), params, grad_fn=lambda p: g)
  jax.tree.map(np.testing.assert_array_equal, s.orthogonal, g)
  # H = 3 I: g+ = g (1 + 3 rho / |g|) is parallel to g, so g_v = 0 (not
  # float32 rounding scaled up to alpha |g|), and a reuse step is plain.
  loss = lambda p: 1.5 * sum(jnp.sum(jnp.square(x - 0.3))
                             for x in jax.tree.leaves(p))
  got, states = _updates_of(tx, params, loss, 2)
  assert all(bool(jnp.all(x == 0))
             for x in jax.tree.leaves(states[0].orthogonal))
  w1 = optax.apply_updates(params, got[0])
  jax.tree.map(np.testing.assert_array_equal, got[1],
               jax.tree.map(lambda x: -0.1 * x, jax.jit(jax.grad(loss))(w1)))


def test_every_k_counts_from_the_warmup_and_compiles_apart():
  params, loss, _ = _mlp()
  options = sam.SAMOptions(rho=0.2, warmup_steps=2, every=3)
  tx = sam.from_options(optax.sgd(0.1), options)
  free, states = _updates_of(tx, params, loss, 7)
  assert [bool(s.sam_active) for s in states] == [
      False, False, True, False, False, True, False]
  # A loop compiling the kinds apart (hooks) takes the same steps.
  hooks = sam.hooks(options)
  grad = jax.grad(loss)
  step = jax.jit(lambda p, s, kind: tx.update(grad(p), s, p, grad_fn=grad,
                                              sam_step=kind),
                 static_argnums=2)
  p, s, kinds = params, tx.init(params), []
  for t in range(7):
    kinds.append(hooks.variants.choose(t, s))
    u, s = step(p, s, kinds[-1])
    assert _max_diff(u, free[t]) < 1e-6, t
    p = optax.apply_updates(p, u)
  assert kinds == [bool(x.sam_active) for x in states]
  # The warm-up steps are the base optimizer's, and leave g_v at 0.
  base, _ = _updates_of(optax.with_extra_args_support(optax.sgd(0.1)),
                        params, loss, 2)
  for a, b in zip(free[:2], base):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert all(bool(jnp.all(x == 0))
             for x in jax.tree.leaves(states[1].orthogonal))


def test_every_k_after_the_window_is_plain_and_clears_g_v():
  params, loss, _ = _mlp()
  tx = sam.sam(optax.sgd(0.1), rho=0.2, window=(1, 4), every=2)
  got, states = _updates_of(tx, params, loss, 6)
  assert [bool(s.sam_active) for s in states] == [
      False, True, False, True, False, False]
  assert all(bool(jnp.all(x == 0))
             for x in jax.tree.leaves(states[4].orthogonal))
  p = params
  for u in got[:4]:
    p = optax.apply_updates(p, u)
  jax.tree.map(np.testing.assert_array_equal, got[4],
               jax.tree.map(lambda x: -0.1 * x, jax.jit(jax.grad(loss))(p)))


def test_every_k_with_the_fused_kernel_matches_jnp():
  params, loss, _ = _mlp()
  run = lambda fused: _updates_of(sam.sam(optax.sgd(0.1), rho=0.2, every=2,
                                          fused=fused), params, loss, 4)[0]
  for a, b in zip(run(True), run(False)):
    assert _max_diff(a, b) < 1e-6


@pytest.mark.parametrize('kwargs,match', [
    (dict(every=0), r'every=0: must be an integer >= 1'),
    (dict(every=2.5), r'every=2.5: must be an integer >= 1'),
    (dict(alpha=-0.1), r'alpha=-0.1: must be finite and >= 0'),
    (dict(every=2, mode='two_call'), r"every=2: .*needs mode='opaque'"),
    (dict(every=2, batch_axis_name='batch'), r'every=2: .*m-sharpness'),
])
def test_every_k_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sam.sam(optax.sgd(0.1), **kwargs)


def test_every_k_under_inject_hyperparams_is_checked_at_init():
  params, _, _ = _mlp()
  injected = optax.inject_hyperparams(sam.sam)
  with pytest.raises(ValueError, match=r"every=3: .*needs mode='opaque'"):
    injected(optax.sgd(0.1), mode='two_call', every=3).init(params)
  with pytest.raises(ValueError, match=r'every=0: must be an integer >= 1'):
    injected(optax.sgd(0.1), every=0).init(params)


def test_every_k_changed_under_inject_hyperparams_takes_effect():
  params, loss, _ = _mlp()
  grad = jax.grad(loss)
  tx = optax.inject_hyperparams(sam.sam)(optax.sgd(0.1), rho=0.2, every=3)
  step = jax.jit(lambda p, s: tx.update(grad(p), s, p, grad_fn=grad))
  u, state = step(params, tx.init(params))
  p = optax.apply_updates(params, u)
  _, kept = step(p, state)
  assert not bool(sam.find_state(kept).sam_active)  # Step 1 of 3: reuse.
  state.hyperparams['every'] = jnp.asarray(2)
  got, changed = step(p, state)
  assert not bool(sam.find_state(changed).sam_active)  # Step 1 of 2.
  state.hyperparams['every'] = jnp.asarray(1)
  got, changed = step(p, state)
  assert bool(sam.find_state(changed).sam_active)  # Every step: SAM.
  want, _ = sam.sam(optax.sgd(0.1), rho=0.2).update(
      grad(p), sam.find_state(state), p, grad_fn=grad)
  assert _max_diff(got, want) < 1e-6


# AE-SAM's switch (`ae_margin`) against a hand-written loop in plain jnp.


def _minibatches(batch, steps, size=16):
  """A different slice of the batch each step, so that |g|^2 varies."""
  n = batch['x'].shape[0] // size
  return [jax.tree.map(lambda x, i=i: x[(i % n) * size:(i % n + 1) * size],
                       batch) for i in range(steps)]


def _ae_sam_reference(params, loss, batches, lr, rho, margin, decay):
  """Jiang et al.'s AE-SAM with SGD on the flattened weights: the updates,
  (mu, sigma) after each step and whether each step took g+."""
  w, unravel = jax.flatten_util.ravel_pytree(params)
  grad = jax.jit(lambda v, b: jax.flatten_util.ravel_pytree(
      jax.grad(loss)(unravel(v), b))[0])
  mu = sigma2 = 0.0
  updates, stats, chose = [], [], []
  for t, b in enumerate(batches):
    g = grad(w, b)
    sq = float(jnp.sum(g * g))
    mu = decay * mu + (1 - decay) * sq
    sigma2 = decay * sigma2 + (1 - decay) * (sq - mu) ** 2
    c = margin(t) if callable(margin) else margin
    sam_step = sq >= mu + c * np.sqrt(sigma2)
    if sam_step:
      g = grad(w + rho * g / (jnp.sqrt(jnp.sum(g * g)) + 1e-12), b)
    updates.append(unravel(-lr * g))
    stats.append((mu, np.sqrt(sigma2)))
    chose.append(bool(sam_step))
    w = w - lr * g
  return updates, stats, chose


def _switch_run(tx, params, loss, batches, jit=True, grad_fn_calls=None):
  def update(p, s, b):
    grad_fn = lambda q: jax.grad(loss)(q, b)
    if grad_fn_calls is not None:
      plain_grad_fn = grad_fn

      def grad_fn(q):
        jax.debug.callback(lambda: grad_fn_calls.append(1))
        return plain_grad_fn(q)
    return tx.update(jax.grad(loss)(p, b), s, p, grad_fn=grad_fn)

  update = jax.jit(update) if jit else update
  state, out, states = tx.init(params), [], []
  for b in batches:
    u, state = update(params, state, b)
    params = optax.apply_updates(params, u)
    out.append(u)
    states.append(state)
  return out, states


@pytest.mark.parametrize('margin,jit,select', [
    (0.0, True, False), (0.0, False, False), (0.5, True, False),
    (optax.linear_schedule(-1.0, 1.0, 12), True, False),
    (0.0, True, True), (0.5, False, True), (0.0, True, None)])
def test_ae_switch_follows_a_hand_written_ae_sam_loop(margin, jit, select):
  params, loss, batch = battery.problem()
  batches = _minibatches(batch, 12)
  tx = sam.sam(optax.sgd(0.1), rho=0.2, ae_margin=margin, ae_decay=0.8,
               ae_select=select)
  got, states = _switch_run(tx, params, loss, batches, jit=jit)
  want, stats, chose = _ae_sam_reference(params, loss, batches, 0.1, 0.2,
                                         margin, 0.8)
  assert [bool(s.sam_active) for s in states] == chose
  assert 0 < sum(chose) < len(chose)  # The switch chose both kinds.
  for t in range(12):
    assert _max_diff(got[t], want[t]) < 2e-6, t
    np.testing.assert_allclose(
        [float(states[t].switch.mean), float(states[t].switch.std)],
        stats[t], rtol=1e-5)
  d = sam.diagnostics(states[-1])
  assert int(d['ae_sam_steps']) == sum(chose)
  # The detector is fed by the steps that computed g+ only.
  assert int(d['sam_steps']) == sum(chose)
  mu, sigma = stats[-1]
  c = margin(11) if callable(margin) else margin
  np.testing.assert_allclose(float(d['ae_threshold']), mu + c * sigma,
                             rtol=1e-5)


def test_ae_switch_plain_steps_do_not_call_grad_fn():
  params, loss, batch = battery.problem()
  calls = []
  tx = sam.sam(optax.sgd(0.1), rho=0.2, ae_margin=0.0, ae_decay=0.8,
               ae_select=False)
  _, states = _switch_run(tx, params, loss, _minibatches(batch, 12),
                          grad_fn_calls=calls)
  jax.effects_barrier()
  took = sum(bool(s.sam_active) for s in states)
  assert 0 < took < 12 and len(calls) == took
  # ae_select computes g+ on every step and keeps the switch's pick: the
  # same updates (bit for bit) at SAM's cost.
  calls.clear()
  selected, picked = _switch_run(
      sam.sam(optax.sgd(0.1), rho=0.2, ae_margin=0.0, ae_decay=0.8,
              ae_select=True), params, loss, _minibatches(batch, 12),
      grad_fn_calls=calls)
  jax.effects_barrier()
  assert len(calls) == 12
  assert [bool(s.sam_active) for s in picked] == [
      bool(s.sam_active) for s in states]
  skipped, _ = _switch_run(tx, params, loss, _minibatches(batch, 12))
  for a, b in zip(selected, skipped):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  # None picks by platform: on this CPU, the selecting step.
  calls.clear()
  _switch_run(sam.sam(optax.sgd(0.1), rho=0.2, ae_margin=0.0, ae_decay=0.8),
              params, loss, _minibatches(batch, 12), grad_fn_calls=calls)
  jax.effects_barrier()
  assert len(calls) == 12


def test_ae_switch_margin_sets_how_often_sam_runs():
  params, loss, batch = battery.problem()
  batches = _minibatches(batch, 12)
  run = lambda c: [bool(s.sam_active) for s in _switch_run(
      sam.sam(optax.sgd(0.1), rho=0.2, ae_margin=c), params, loss,
      batches)[1]]
  assert all(run(-1e6)) and not any(run(1e6))
  # A stricter margin takes a subset of the steps.
  loose, strict = run(-0.5), run(0.5)
  assert sum(strict) < sum(loose)


def test_ae_switch_under_inject_hyperparams_takes_the_new_margin():
  params, loss, batch = battery.problem()
  b = batch
  tx = optax.inject_hyperparams(sam.sam)(optax.sgd(0.1), rho=0.2,
                                         ae_margin=0.0)
  step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p, b), s, p,
                                        grad_fn=lambda q: jax.grad(loss)(
                                            q, b)))
  state = tx.init(params)
  state.hyperparams['ae_margin'] = jnp.asarray(1e6)
  _, plain = step(params, state)
  assert not bool(sam.find_state(plain).sam_active)
  state.hyperparams['ae_margin'] = jnp.asarray(-1e6)
  got, chosen = step(params, state)
  assert bool(sam.find_state(chosen).sam_active)
  want, _ = sam.sam(optax.sgd(0.1), rho=0.2).update(
      jax.grad(loss)(params, b), sam.sam(optax.sgd(0.1), rho=0.2).init(
          params), params, grad_fn=lambda q: jax.grad(loss)(q, b))
  assert _max_diff(got, want) < 1e-6


def test_ae_switch_at_the_edges_keeps_finite_statistics():
  params, _, _ = _mlp()
  tx = sam.sam(optax.sgd(0.1), rho=0.05, ae_margin=0.0)
  update = jax.jit(lambda g, s: tx.update(g, s, params,
                                          grad_fn=lambda p: g))
  state = tx.init(params)
  huge = jax.tree.map(lambda x: jnp.full_like(x, 1e20), params)
  _, state = update(huge, state)
  assert bool(state.sam_active)  # The first step is above 0.1 |g|^2.
  for _ in range(3):
    _, state = update(huge, state)
  d = sam.diagnostics(state)
  assert all(bool(jnp.isfinite(d[k])) for k in (
      'ae_sq_grad_norm', 'ae_mean', 'ae_std', 'ae_threshold'))
  # A non-finite |g| is a plain step and leaves the statistics as they were.
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  _, after = update(nan, state)
  assert not bool(after.sam_active)
  assert float(after.switch.mean) == float(state.switch.mean)
  assert float(after.switch.std) == float(state.switch.std)
  # g = 0 after non-zero steps: below the mean, a plain step.
  zeros = jax.tree.map(jnp.zeros_like, params)
  u, after = update(zeros, state)
  assert not bool(after.sam_active)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))


def test_ae_switch_with_the_fused_kernel_and_bfloat16():
  params, loss, batch = battery.problem()
  batches = _minibatches(batch, 8)
  run = lambda fused: _switch_run(sam.sam(
      optax.sgd(0.1), rho=0.2, ae_margin=0.0, fused=fused), params, loss,
                                  batches)
  (a, sa), (b, sb) = run(True), run(False)
  assert [bool(s.sam_active) for s in sa] == [bool(s.sam_active) for s in sb]
  for x, y in zip(a, b):
    assert _max_diff(x, y) < 1e-6
  p16, loss16, batch16 = battery.problem(jnp.bfloat16)
  got, states = _switch_run(sam.sam(optax.sgd(0.1), rho=0.2, ae_margin=0.0),
                            p16, loss16, _minibatches(batch16, 8))
  assert all(x.dtype == jnp.bfloat16 for u in got
             for x in jax.tree.leaves(u))
  assert states[-1].switch.mean.dtype == jnp.float32
  took = [bool(s.sam_active) for s in states]
  assert 0 < sum(took) < len(took)


def test_ae_switch_compiles_one_step_and_refuses_sam_step():
  options = sam.SAMOptions(rho=0.2, warmup_steps=2, ae_margin=0.0)
  assert sam.hooks(options).variants is None
  assert 'ae_sam_steps' in sam.hooks(options).console
  params, loss, _ = _mlp()
  tx = sam.from_options(optax.sgd(0.1), options)
  with pytest.raises(ValueError, match=r'sam_step=True: .*ae_margin'):
    tx.update(jax.grad(loss)(params), tx.init(params), params,
              grad_fn=jax.grad(loss), sam_step=True)
  # The warm-up's steps stay plain whatever the switch says.
  _, states = _updates_of(tx, params, loss, 3)
  assert [bool(s.sam_active) for s in states][:2] == [False, False]
  assert int(states[1].switch.sam_steps) == 0


@pytest.mark.parametrize('kwargs,match', [
    (dict(ae_margin=0.0, ae_decay=0.0), r'ae_decay=0.0: must be in \(0, 1\)'),
    (dict(ae_margin=0.0, ae_decay=1.0), r'ae_decay=1.0: must be in \(0, 1\)'),
    (dict(ae_margin=float('inf')), r'ae_margin=inf: must be finite'),
    (dict(ae_margin=0.0, every=2), r"ae_margin=0.0: .*LookSAM.*every"),
    (dict(ae_margin=0.0, mode='two_call'), r"ae_margin=0.0: .*two_call"),
    (dict(ae_margin=0.0, batch_axis_name='batch'),
     r'ae_margin=0.0: .*m-sharpness'),
    (dict(ae_select=True), r"ae_select=True: is an option of AE-SAM's"),
    (dict(ae_select=False), r"ae_select=False: is an option of AE-SAM's"),
])
def test_ae_switch_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sam.sam(optax.sgd(0.1), **kwargs)


# Mixed precision: bfloat16 activations or parameters, float32 statistics.

_VARIANTS = {
    'sam': dict(),
    'asam': dict(adaptive=True, rho=0.5),
    'fused': dict(fused=True),
    'every_3': dict(every=3),
    'ae': dict(ae_margin=0.0),
    'two_call': dict(mode='two_call'),
}


def _bf16_loss(p, b):
  """The battery's loss with bfloat16 activations around float32 weights."""
  cast = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
  out = battery.forward(cast(p), cast(b)['x']).astype(jnp.float32)
  return jnp.mean(jnp.square(out - b['y']))


def _variant_run(name, params, loss, batches):
  kwargs = dict(rho=0.2, detector=hallucination.DetectorConfig(
      track_cosine=True))
  kwargs.update(_VARIANTS[name])
  tx = sam.sam(optax.sgd(0.1), **kwargs)
  two_call = kwargs.get('mode') == 'two_call'

  @jax.jit
  def step(p, s, b):
    g = jax.grad(loss)(p, b)
    if two_call:  # The ascent call, then the call with g+.
      u, s = tx.update(g, s, p)
      u, s = tx.update(jax.grad(loss)(optax.apply_updates(p, u), b), s,
                       optax.apply_updates(p, u))
      return optax.apply_updates(optax.apply_updates(p, u), jax.tree.map(
          jnp.zeros_like, u)), s
    u, s = tx.update(g, s, p, grad_fn=lambda q: jax.grad(loss)(q, b))
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  for b in batches:
    params, state = step(params, state, b)
  return params, state


@pytest.mark.parametrize('name', _VARIANTS)
def test_bfloat16_activations_track_float32_with_float32_statistics(name):
  params, loss, batch = battery.problem()
  batches = _minibatches(batch, 6)
  got, state = _variant_run(name, params, _bf16_loss, batches)
  want, want_state = _variant_run(name, params, loss, batches)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got))
  moved = _max_diff(want, params)
  # bfloat16 activations (8 bits of mantissa) move the result by a small
  # part of how far training moved the weights.
  assert _max_diff(got, want) < 0.05 * moved, (_max_diff(got, want), moved)
  s = sam.find_state(state)
  stats = [s.rho, *jax.tree.leaves(s.detector)]
  if s.switch is not None:
    stats += [s.switch.mean, s.switch.std, s.switch.threshold]
  for x in stats:
    assert x.dtype in (jnp.float32, jnp.int32, jnp.bool_), x.dtype
    assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
  # The same steps took g+ (the detector counts them).
  assert int(sam.diagnostics(state)['sam_steps']) == int(
      sam.diagnostics(want_state)['sam_steps'])


@pytest.mark.parametrize('name', _VARIANTS)
def test_bfloat16_parameters_keep_float32_statistics(name):
  params, loss, batch = battery.problem(jnp.bfloat16)
  got, state = _variant_run(name, params, loss, _minibatches(batch, 4))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
  d = sam.diagnostics(state)
  for key in ('rho', 'grad_norm', 'perturbed_grad_norm', 'cosine',
              'grad_norm_ema'):
    assert d[key].dtype == jnp.float32 and bool(jnp.isfinite(d[key])), key
  # |g| of the last step that took g+, from its bfloat16 gradient summed in
  # float32 (a bfloat16 sum of squares would be off by up to 2^-8 per add).
  assert float(d['grad_norm']) > 0


@pytest.mark.parametrize('scale', [1e20, 1e-30])
def test_bfloat16_gradients_at_extreme_norms_perturb_by_rho(scale):
  params, _, _ = _mlp()
  g = jax.tree.map(lambda x: (scale * jax.random.normal(
      jax.random.key(x.size), x.shape)).astype(jnp.bfloat16), params)
  w = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  for adaptive in (False, True):
    e, norm = jax.jit(lambda g, w, a=adaptive: sam.perturbation(
        g, w, 0.05, adaptive=a))(g, w)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(e))
    assert bool(jnp.isfinite(norm)) and float(norm) > 0
    if not adaptive:
      length = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(e)))
      # rho |g| / (|g| + eps): rho at 1e20, far below it at 1e-30 (eps =
      # 1e-12 is what makes g -> 0 give e -> 0), never 0 or NaN.
      g_norm = float(norm)
      want_norm = np.sqrt(sum(np.sum(np.square(np.asarray(
          x.astype(jnp.float32), np.float64))) for x in jax.tree.leaves(g)))
      np.testing.assert_allclose(g_norm, want_norm, rtol=1e-5)
      np.testing.assert_allclose(length, 0.05 * g_norm / (g_norm + 1e-12),
                                 rtol=1e-3)
      assert length > 0
  fused, _ = sam.sam(optax.sgd(0.1), rho=0.05, fused=True), None
  u, s = fused.update(g, fused.init(w), w, grad_fn=lambda p: g)
  assert all(x.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(
      x.astype(jnp.float32)))) for x in jax.tree.leaves(u))
