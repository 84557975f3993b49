"""The optimizer chain from config, against optax's own optimizers and closed forms."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import sam_block
from geom import method_hooks
from geom import sam
from train.training import optim
from train.errors import ConfigError


def _cfg(**overrides):
  cfg = ml_collections.ConfigDict(dict(
      name='momentum', learning_rate=0.1, schedule='cosine', warmup_steps=3,
      end_lr_fraction=0.0, momentum=0.9, nesterov=False, b1=0.9, b2=0.999,
      eps=1e-8, weight_decay=0.01, weight_decay_exclude=r'(bias|scale)$',
      grad_clip_norm=0.0))
  cfg.update(overrides)
  return cfg


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {'dense': {'kernel': jax.random.normal(k[0], (4, 3)),
                    'bias': jax.random.normal(k[1], (3,))},
          'bn': {'scale': jax.random.normal(k[2], (3,))}}


def _grads(step):
  return jax.tree.map(lambda p: jnp.sin(p * (step + 1)), _params())


def _run(tx, steps=6):
  params = _params()
  state = tx.init(params)
  for step in range(steps):
    updates, state = tx.update(_grads(step), state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_weight_decay_mask_excludes_biases_and_norm_scales():
  mask = optim.weight_decay_mask(_params(), r'(bias|scale)$')
  assert mask == {'dense': {'kernel': True, 'bias': False},
                  'bn': {'scale': False}}


def test_adamw_matches_optax_adamw_with_the_same_mask():
  cfg = _cfg(name='adamw')
  schedule = optim.learning_rate_schedule(cfg, 10)
  reference = optax.adamw(
      schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01,
      mask=lambda p: optim.weight_decay_mask(p, cfg.weight_decay_exclude))
  got, want = _run(optim.create_optimizer(cfg, 10)), _run(reference)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got,
               want)


def test_momentum_is_decoupled_sgdw_in_plain_numpy():
  cfg = _cfg(schedule='constant', warmup_steps=0)
  got = _run(optim.create_optimizer(cfg, 10))
  params = jax.tree.map(np.asarray, _params())
  mask = optim.weight_decay_mask(params, cfg.weight_decay_exclude)
  trace = jax.tree.map(np.zeros_like, params)
  for step in range(6):
    grads = jax.tree.map(np.asarray, _grads(step))
    trace = jax.tree.map(lambda t, g: 0.9 * t + g, trace, grads)
    params = jax.tree.map(
        lambda p, t, m: p - 0.1 * (t + (0.01 * p if m else 0.0)),
        params, trace, mask)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got,
               params)


def test_l2_mode_adds_the_decay_to_the_gradient_before_clipping_and_momentum():
  """The SAM paper's code: wd / 2 * |w|^2 in the loss, clipped with the
  gradient, then Nesterov momentum; in plain numpy."""
  cfg = _cfg(schedule='constant', warmup_steps=0, nesterov=True,
             grad_clip_norm=0.5, weight_decay_mode='l2',
             weight_decay_exclude=r'^$')  # Decay on every parameter.
  got = _run(optim.create_optimizer(cfg, 10))
  params = jax.tree.map(lambda x: np.asarray(x, np.float64), _params())
  trace = jax.tree.map(np.zeros_like, params)
  for step in range(6):
    g = jax.tree.map(lambda gi, p: np.asarray(gi, np.float64) + 0.01 * p,
                     _grads(step), params)
    norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
    g = jax.tree.map(lambda x: x * min(1.0, 0.5 / norm), g)
    trace = jax.tree.map(lambda t, gi: 0.9 * t + gi, trace, g)
    params = jax.tree.map(lambda p, t, gi: p - 0.1 * (0.9 * t + gi),
                          params, trace, g)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
               got, params)
  # The same decay placed after momentum (decoupled) is another optimizer.
  decoupled = _run(optim.create_optimizer(
      _cfg(**{**cfg, 'weight_decay_mode': 'decoupled'}), 10))
  assert not np.allclose(decoupled['dense']['kernel'],
                         got['dense']['kernel'], rtol=1e-4)


def test_sgd_matches_optax_sgd_without_decay():
  cfg = _cfg(name='sgd', weight_decay=0.0, schedule='constant',
             warmup_steps=0)
  got, want = _run(optim.create_optimizer(cfg, 10)), _run(optax.sgd(0.1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got,
               want)


def test_wsd_closed_form():
  """Warmup 4, stable, then a linear anneal over the last 30% of 20 steps
  (6 steps) from 0.1 to 0.1 * 0.2."""
  cfg = _cfg(schedule='wsd', warmup_steps=4, end_lr_fraction=0.2)
  cfg.decay_fraction = 0.3
  lr = optim.learning_rate_schedule(cfg, 20)
  want = [0.1 * t / 4 for t in range(4)] + [0.1] * 10 + [
      0.1 - (0.1 - 0.02) * k / 6 for k in range(7)]
  np.testing.assert_allclose([float(lr(t)) for t in range(21)], want,
                             rtol=1e-6)


@pytest.mark.parametrize('fraction', [None, 0.0, 1.2, 0.95, 'x'])
def test_wsd_needs_a_fraction_that_fits(fraction):
  cfg = _cfg(schedule='wsd', warmup_steps=4)
  if fraction is not None:
    cfg.decay_fraction = fraction
  with pytest.raises(ConfigError,
                     match=r'^config.optimizer.decay_fraction=.*in \(0, 1\]'):
    optim.learning_rate_schedule(cfg, 20)


def test_warmup_then_cosine_closed_form():
  cfg = _cfg(learning_rate=0.4, warmup_steps=10, end_lr_fraction=0.1)
  schedule = optim.learning_rate_schedule(cfg, 110)
  for step in (0, 5, 10):
    np.testing.assert_allclose(schedule(step), 0.4 * step / 10, rtol=1e-6)
  for step in (10, 35, 60, 110):
    t = (step - 10) / 100
    want = 0.4 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * t)))
    np.testing.assert_allclose(schedule(step), want, rtol=1e-5)


def test_clipping_bounds_the_global_norm_before_momentum():
  cfg = _cfg(name='sgd', weight_decay=0.0, schedule='constant',
             warmup_steps=0, grad_clip_norm=0.5, learning_rate=1.0)
  tx = optim.create_optimizer(cfg, 10)
  big = jax.tree.map(lambda p: 100 * jnp.ones_like(p), _params())
  updates, _ = tx.update(big, tx.init(_params()), _params())
  np.testing.assert_allclose(optax.tree.norm(updates), 0.5, rtol=1e-5)


def _regression():
  """A loss with curvature, so the gradient at w + e differs from g."""
  k = jax.random.split(jax.random.key(1), 2)
  x = jax.random.normal(k[0], (16, 4))
  y = jax.random.normal(k[1], (16, 3))

  def loss(p):
    h = jnp.tanh(x @ p['dense']['kernel'] + p['dense']['bias'])
    return jnp.mean(jnp.square(h * p['bn']['scale'] - y))

  return loss


def test_sam_from_config_reads_grad_fn_and_matches_a_hand_computed_step():
  # grad_fn travels through the built chain to SAM, which must evaluate it
  # at w + e: checked against SAM written out by hand around SGDW with
  # momentum and clipping, and against a grad_fn that ignores its argument.
  cfg = _cfg(schedule='constant', warmup_steps=0, grad_clip_norm=0.3)
  cfg.sam = sam_block.sam_block()
  cfg.sam.enabled, cfg.sam.rho = True, 0.5
  built = optim.build(cfg, 10)
  assert built.hooks.update_arguments == ('grad_fn',)
  tx, loss = built.tx, _regression()
  grad = jax.grad(loss)

  def run(make_grad_fn, steps=3):
    @jax.jit
    def step(p, s):
      updates, s = tx.update(grad(p), s, p, grad_fn=make_grad_fn(p))
      return optax.apply_updates(p, updates), s

    p, s = _params(), tx.init(_params())
    for _ in range(steps):
      p, s = step(p, s)
    return p

  got = run(lambda _: grad)

  params = jax.tree.map(np.asarray, _params())
  mask = optim.weight_decay_mask(params, cfg.weight_decay_exclude)
  trace = jax.tree.map(np.zeros_like, params)
  norm = lambda t: np.sqrt(sum(np.sum(x.astype(np.float64) ** 2)
                               for x in jax.tree.leaves(t)))
  for _ in range(3):
    g = jax.tree.map(np.asarray, grad(params))
    scale = 0.5 / (norm(g) + 1e-12)
    g_adv = jax.tree.map(np.asarray, grad(jax.tree.map(
        lambda w, gi: (w + scale * gi).astype(np.float32), params, g)))
    clip = min(1.0, 0.3 / norm(g_adv))
    trace = jax.tree.map(lambda t, ga: 0.9 * t + clip * ga, trace, g_adv)
    params = jax.tree.map(
        lambda w, t, m: w - 0.1 * (t + (0.01 * w if m else 0.0)),
        params, trace, mask)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               got, params)

  # A grad_fn that answers with the gradient at w, wherever it is asked.
  at_w = run(lambda p: lambda _: grad(p))
  gap = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(at_w), jax.tree.leaves(params)))
  assert gap > 1e-3, gap


@pytest.mark.parametrize('field,value,match', [
    ('name', 'lamb', r"config.optimizer.name='lamb'.*valid choices: 'sgd', "
     r"'momentum', 'adamw'"),
    ('schedule', 'step', r"config.optimizer.schedule='step'.*'cosine'"),
    ('learning_rate', 0.0,
     r'config.optimizer.learning_rate=0.0: must be finite and > 0'),
    ('learning_rate', float('inf'),
     r'config.optimizer.learning_rate=inf: must be finite and > 0'),
    ('end_lr_fraction', 2.0, r'config.optimizer.end_lr_fraction=2.0'),
    ('warmup_steps', 10, r'config.optimizer.warmup_steps=10: must be in'),
    ('weight_decay', -1.0, r'config.optimizer.weight_decay=-1.0'),
    ('momentum', 1.0, r'config.optimizer.momentum=1.0'),
    ('weight_decay_exclude', '(', r'not a regular expression'),
    ('weight_decay_mode', 'adamw',
     r"config.optimizer.weight_decay_mode='adamw': unknown weight decay "
     r"mode; valid choices: 'decoupled', 'l2'"),
])
def test_bad_optimizer_settings_name_the_field(field, value, match):
  with pytest.raises(ConfigError, match=match):
    optim.create_optimizer(_cfg(**{field: value}), 10)


@pytest.mark.parametrize('changes,match', [
    ({'rho': -0.1},
     r'^config.optimizer.sam.rho=-0.1: must be finite and >= 0'),
    ({'rho': float('inf')},
     r'^config.optimizer.sam.rho=inf: must be finite and >= 0'),
    ({'window_start': 5, 'window_stop': 5},
     r'^config.optimizer.sam.window_start/window_stop=\(5, 5\): empty'),
    # A window outside the 10-step run.
    ({'window_start': 10},
     r'^config.optimizer.sam.window_start/window_stop=\(10, -1\): outside '
     r'the run \(num_steps=10\)'),
    ({'window_start': 8, 'window_stop': 12},
     r'^config.optimizer.sam.window_start/window_stop=\(8, 12\): outside'),
    # The config's own values (-1: no end), not geom's (None).
    ({'window_start': -2},
     r'^config.optimizer.sam.window_start/window_stop=\(-2, -1\): empty or '
     'negative'),
    ({'response': 'panic'}, r"^config.optimizer.sam.response='panic': unknown "
     r"response; valid "
     r"choices: 'flag', 'warm_restart', 'shrink_rho'$"),
    ({'detector.patience': 0},
     r'^config.optimizer.sam.detector.patience=0: must be >= 1$'),
    ({'detector.enabled': False, 'response': 'warm_restart'},
     r"^config.optimizer.sam.response='warm_restart': needs a detector"),
    ({'every': 0}, r'^config.optimizer.sam.every=0: must be an integer >= 1'),
    ({'ae.enabled': True, 'ae.decay': 1.0},
     r'^config.optimizer.sam.ae.decay=1.0: must be in \(0, 1\)'),
    ({'ae.enabled': True, 'every': 2},
     r'^config.optimizer.sam.ae.margin_start/margin_end=\(0.0, 0.0\): '
     r"AE-SAM's switch is not supported with LookSAM"),
])
def test_bad_sam_settings_name_their_config_field(changes, match):
  # geom's ArgumentError names its argument; the field is found from it.
  cfg = _cfg()
  cfg.sam = sam_block.sam_block()
  cfg.sam.enabled = True
  for key, value in changes.items():
    block, _, name = key.rpartition('.')
    (cfg.sam[block] if block else cfg.sam)[name] = value
  with pytest.raises(ConfigError, match=match):
    optim.build(cfg, 10)


def test_build_gives_the_methods_hooks():
  cfg = _cfg()
  assert optim.build(cfg, 10).hooks == method_hooks.MethodHooks()
  cfg.sam = sam_block.sam_block()
  cfg.sam.enabled, cfg.sam.warmup_steps, cfg.sam.m_sharpness = True, 3, True
  built = optim.build(cfg, 10)
  assert built.hooks.name == 'sam' and built.hooks.variants is not None
  assert built.hooks.per_device_axis == optim.PER_DEVICE_AXIS
  assert built.per_device_field == 'optimizer.sam.m_sharpness'
  assert [built.hooks.variants.choose(s, None) for s in range(5)] == [
      False, False, False, True, True]


def test_efficient_sam_from_config_is_geoms_sam_with_those_options():
  # every/alpha and the ae block reach geom.sam: the built chain's steps
  # equal sam.sam's with the same options (c linear over the 10 steps).
  cfg = _cfg(schedule='constant', warmup_steps=0, weight_decay=0.0,
             momentum=0.0, name='sgd')
  cfg.sam = sam_block.sam_block()
  cfg.sam.enabled, cfg.sam.rho = True, 0.5
  loss = _regression()
  grad = jax.grad(loss)
  cases = [
      (dict(every=3, alpha=0.5), dict(every=3, alpha=0.5)),
      ({'ae.enabled': True, 'ae.margin_start': -1.0, 'ae.margin_end': 1.0,
        'ae.decay': 0.8},
       dict(ae_margin=optax.linear_schedule(-1.0, 1.0, 10), ae_decay=0.8)),
  ]
  for changes, kwargs in cases:
    block = sam_block.sam_block()
    block.enabled, block.rho = True, 0.5
    for key, value in changes.items():
      sub, _, name = key.rpartition('.')
      (block[sub] if sub else block)[name] = value
    cfg.sam = block
    built = optim.build(cfg, 10)
    want_tx = sam.sam(optax.sgd(0.1), rho=0.5, **kwargs)
    p, q = _params(), _params()
    s, r = built.tx.init(p), want_tx.init(q)
    # Jitted: op by op, the 24 updates took 5 s.
    built_update = jax.jit(
        lambda p, s, tx=built.tx: tx.update(grad(p), s, p, grad_fn=grad))
    want_update = jax.jit(
        lambda q, r, tx=want_tx: tx.update(grad(q), r, q, grad_fn=grad))
    active = []
    for _ in range(6):
      u, s = built_update(p, s)
      v, r = want_update(q, r)
      p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
      active.append(bool(sam.diagnostics(s)['sam_active']))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 p, q)
    assert 0 < sum(active) < 6, (changes, active)
    if 'every' in changes:
      assert built.hooks.variants is not None
    else:  # The switch decides on the device: one compiled step.
      assert built.hooks.variants is None
      assert 'ae_sam_steps' in sam.diagnostics(s)
