"""train.tta's methods and streams against direct computations."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.tta import classifier as classifier_lib
from train.tta import eata
from train.tta import interface
from train.tta import methods
from train.tta import streams
from train.vision import models

C = 10


# The model's init and apply run jitted (eagerly, every op compiles for
# itself): one compile per model and input shape for the whole file.
@functools.partial(jax.jit, static_argnums=0)
def _init(model, seed, x):
  variables = nn.meta.unbox(model.init(jax.random.key(seed), x, train=False))
  stats = variables.get('batch_stats', {})
  # Running statistics unlike the test batches' own.
  return variables['params'], jax.tree.map(lambda s: s + 0.3, stats)


@functools.partial(jax.jit, static_argnames=('model', 'train'))
def _apply(model, variables, x, train):
  if train:
    return model.apply(variables, x, train=True, mutable=['batch_stats'])[0]
  return model.apply(variables, x, train=False)


_step = jax.jit(methods.step)
_entropies = jax.jit(interface.entropies)


def _source(norm='batch', seed=0):
  model = models.CNN(num_classes=C, features=(4, 8), hidden=16, norm=norm)
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 256, (32, 12, 12, 1)).astype(np.uint8)
  params, stats = _init(model, seed, x)
  return model, params, stats, x


def _method(name, tx=None, **kw):
  model, params, stats, x = _source()
  settings = interface.Settings(method=name, num_classes=C, **kw)
  method = methods.make(settings, model, params, stats,
                        tx or optax.scale_by_learning_rate(0.1),
                        [x] if name == 'eata' else None)
  return method, params, stats, x


def _entropy_np(logits):
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return -(p * np.log(np.maximum(p, 1e-300))).sum(-1), p


def test_entropies_match_numpy_and_are_finite_at_extremes():
  logits = np.random.default_rng(1).normal(size=(7, C)) * 5
  np.testing.assert_allclose(_entropies(jnp.asarray(logits)),
                             _entropy_np(logits)[0], rtol=1e-5, atol=1e-6)
  extreme = np.array([[1e4] + [0.0] * (C - 1), [0.0] * C], np.float32)
  h = _entropies(extreme)
  assert np.all(np.isfinite(h))
  np.testing.assert_allclose(h, [0.0, math.log(C)], atol=1e-5)


def test_adapted_parameters_are_the_norm_affines():
  model, params, _, _ = _source()
  assert classifier_lib.adapted_names(params) == [
      'bn0/bias', 'bn0/scale', 'bn1/bias', 'bn1/scale', 'bn_hidden/bias',
      'bn_hidden/scale']
  assert 'bn_hidden/scale' not in classifier_lib.adapted_names(
      params, ('bn_hidden',))


def test_source_and_bn_stats_predict_as_the_model_does():
  for name, train in (('source', False), ('bn_stats', True)):
    method, params, stats, x = _method(name)
    state = method.init()
    new, out = _step(method, state, x)
    variables = {'params': params, 'batch_stats': stats}
    logits = _apply(method.classifier.model, variables, x, train)
    np.testing.assert_array_equal(out['pred'],
                                  np.argmax(np.asarray(logits), -1))
    jax.tree.map(np.testing.assert_array_equal, new.adapted, state.adapted)


def test_tent_step_is_the_entropy_gradient_on_the_affine_parameters():
  lr = 0.1
  method, params, stats, x = _method('tent')
  state, out = _step(method, method.init(), x)

  def mean_entropy(p):
    logits = method.classifier.model.apply({'params': p, 'batch_stats': stats}, x,
                                train=True, mutable=['batch_stats'])[0]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(jnp.exp(logp) * logp, -1))

  grads = jax.device_get(jax.jit(jax.grad(mean_entropy))(params))
  for name in classifier_lib.adapted_names(params):
    module, leaf = name.split('/')
    want = np.asarray(params[module][leaf]) - lr * grads[module][leaf]
    np.testing.assert_allclose(state.adapted[name], want, rtol=1e-5,
                               atol=1e-7)
  # The gradient itself against central finite differences on one scale.
  eps = 1e-2
  bumped = jax.tree.map(lambda a: a, params)
  scale = np.asarray(params['bn1']['scale']).copy()
  values = []
  jitted_mean_entropy = jax.jit(mean_entropy)
  for sign in (1, -1):
    s = scale.copy()
    s[3] += sign * eps
    bumped = {**params, 'bn1': {**params['bn1'], 'scale': jnp.asarray(s)}}
    values.append(float(jitted_mean_entropy(bumped)))
  fd = (values[0] - values[1]) / (2 * eps)
  np.testing.assert_allclose(float(grads['bn1']['scale'][3]), fd, rtol=2e-2,
                             atol=1e-4)
  # Only the affine parameters move.
  assert out['updated']
  logits = _apply(method.classifier.model,
                  {'params': params, 'batch_stats': stats}, x, True)
  np.testing.assert_allclose(out['loss'], np.mean(_entropy_np(logits)[0]),
                             rtol=1e-5)


def test_eata_filters_weights_and_moving_average_against_numpy():
  method, params, stats, x = _method('eata', fisher_alpha=0.0)
  state = method.init()
  e0 = 0.4 * math.log(C)
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(16, C)) * rng.uniform(0.1, 8, (16, 1))
  h, p = _entropy_np(logits)
  eata_filter = jax.jit(eata.Eata.filter)
  # No moving average yet: only the reliability filter.
  keep, w, _ = eata_filter(method, state, np.asarray(logits, np.float32),
                           np.asarray(h, np.float32))
  np.testing.assert_array_equal(keep, h < e0)
  np.testing.assert_allclose(w, np.where(h < e0, np.exp(e0 - h), 0),
                             rtol=1e-5)
  # With a moving average m: also |cos(p, m)| < d_margin.
  m = rng.dirichlet(np.ones(C))
  state = state._replace(mean_probs=np.asarray(m, np.float32),
                         has_mean=np.asarray(True))
  keep, _, _ = eata_filter(method, state, np.asarray(logits, np.float32),
                           np.asarray(h, np.float32))
  cos = np.abs(p @ m) / (np.linalg.norm(p, axis=1) * np.linalg.norm(m))
  np.testing.assert_array_equal(keep, (h < e0) & (cos < 0.05))
  # One step: the loss is the weighted entropy over the kept samples, and
  # m becomes the kept samples' mean probabilities.
  new, out = _step(method, method.init(), x)
  z = jax.jit(classifier_lib.Classifier.logits, static_argnums=3)(
      method.classifier, method.classifier.source, jnp.asarray(x), True)
  h, p = _entropy_np(z)
  kept = h < e0
  if kept.any():
    np.testing.assert_allclose(
        out['loss'], np.sum(np.exp(e0 - h[kept]) * h[kept]) / kept.sum(),
        rtol=1e-4)
    np.testing.assert_allclose(new.mean_probs, p[kept].mean(0), rtol=1e-4,
                               atol=1e-6)
  assert bool(out['updated']) == bool(kept.any())


def test_eata_fisher_penalty_pulls_toward_the_source():
  method, _, _, x = _method('eata', fisher_alpha=1e6)
  state = method.init()
  moved = jax.tree.map(lambda a: np.asarray(a) + np.float32(0.5),
                       state.adapted)
  state = state._replace(adapted=moved, mean_probs=state.mean_probs)
  grads_dir = {}
  new, _ = _step(method, state, x)
  for k in moved:
    grads_dir[k] = np.sign(np.asarray(new.adapted[k]) - moved[k])
    if np.any(np.asarray(method.fisher[k]) > 0):
      # The update points from moved back toward the source (-0.5).
      big = np.asarray(method.fisher[k]) > 0
      assert np.all(grads_dir[k][big] <= 0)


def test_eata_fisher_is_the_mean_squared_gradient_over_the_batches():
  method, _, _, x = _method('eata')
  batches = [x[:16], x[16:], x[:5]]  # Ragged: the mean is over batches.

  @jax.jit
  def squared_grad(images):
    def ce(adapted):  # Against the source model's own predictions.
      logits = method.classifier.logits(adapted, images, True).astype(
          jnp.float32)
      logp = jax.nn.log_softmax(logits)
      labels = jnp.argmax(jax.lax.stop_gradient(logits), -1)
      return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))
    return jax.tree.map(jnp.square, jax.grad(ce)(method.classifier.source))

  per_batch = [jax.device_get(squared_grad(b)) for b in batches]
  got = eata.fisher_diagonal(method.classifier, batches)
  for k in method.classifier.source:
    want = np.mean([np.asarray(g[k], np.float64) for g in per_batch], 0)
    np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5,
                               atol=1e-12)
  assert any(np.any(np.asarray(got[k]) > 0) for k in got)


def test_sar_resets_on_a_constructed_collapse():
  # A head scaled up 1000x predicts with entropy ~0: SAR's loss average
  # falls below 0.2 at once and the model returns to the source.
  model, params, stats, x = _source()
  params = {**params, 'head': {
      'kernel': np.asarray(params['head']['kernel']) * np.float32(1000.0),
      'bias': params['head']['bias']}}
  settings = interface.Settings(method='sar', num_classes=C)
  method = methods.make(settings, model, params, stats,
                        optax.sgd(0.5, momentum=0.9))
  new, out = _step(method, method.init(), x)
  assert bool(out['reset']) and int(new.resets) == 1
  jax.tree.map(np.testing.assert_array_equal, new.adapted,
               method.classifier.source)
  # The unmodified model does not collapse at once.
  method2, _, _, _ = _method('sar', tx=optax.sgd(1e-3, momentum=0.9))
  new2, out2 = _step(method2, method2.init(), x)
  assert not bool(out2['reset']) and int(new2.resets) == 0


def test_sar_skips_the_last_block():
  method, _, _, _ = _method('sar')
  assert not any(k.startswith('bn_hidden') for k in method.classifier.source)


def test_no_update_when_no_sample_is_reliable():
  # A head scaled to ~0 predicts uniformly: entropy ln C > E0 for all.
  model, params, stats, x = _source()
  params = {**params, 'head': jax.tree.map(
      lambda a: np.asarray(a) * np.float32(0.0), params['head'])}
  for name in ('eata', 'sar'):
    settings = interface.Settings(method=name, num_classes=C)
    method = methods.make(settings, model, params, stats,
                          optax.adam(0.1), [x])
    state = method.init()
    new, out = _step(method, state, x)
    assert not bool(out['updated'])
    jax.tree.map(np.testing.assert_array_equal, new.adapted, state.adapted)
    jax.tree.map(np.testing.assert_array_equal, new.opt_state,
                 state.opt_state)


@pytest.mark.parametrize('norm', ['group', 'layer'])
def test_per_example_norms_predict_independently_of_the_batch(norm):
  model, params, stats, x = _source(norm)
  method = methods.make(interface.Settings('bn_stats', C), model, params,
                        stats, optax.identity())
  _, whole = _step(method, method.init(), x)
  _, alone = _step(method, method.init(), x[:1])
  assert int(np.asarray(whole['pred'])[0]) == int(np.asarray(alone['pred'])[0])


# Streams.

def _labels(sizes, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, C, n).astype(np.int32) for n in sizes]


def _pairs(plan):
  return [(int(c), int(i)) for b in plan for c, i in zip(b.corruption,
                                                         b.sample)]


@pytest.mark.parametrize('protocol', streams.PROTOCOLS)
def test_every_sample_once_and_resets_where_the_protocol_says(protocol):
  sizes = [10, 7, 12]
  plan = streams.plan(protocol, _labels(sizes), 4, seed=1)
  pairs = _pairs(plan)
  assert sorted(pairs) == [(c, i) for c, n in enumerate(sizes)
                           for i in range(n)]
  assert all(len(b.sample) <= 4 for b in plan)
  resets = [k for k, b in enumerate(plan) if b.reset]
  if protocol == 'episodic':
    starts = [0, 3, 5]  # ceil(10/4) = 3 batches, then ceil(7/4) = 2.
    assert resets == starts
    assert all(len(set(b.corruption)) == 1 for b in plan)
    assert [int(plan[k].corruption[0]) for k in starts] == [0, 1, 2]
  elif protocol == 'continual':
    assert resets == [0]
    order = [int(b.corruption[0]) for b in plan]
    assert order == sorted(order)
  else:
    assert resets == [0]
    # Mixed: batches mix corruptions.
    assert any(len(set(b.corruption)) > 1 for b in plan)
  # Deterministic in the seed, and the seed matters.
  assert _pairs(streams.plan(protocol, _labels(sizes), 4, seed=1)) == pairs
  assert _pairs(streams.plan(protocol, _labels(sizes), 4, seed=2)) != pairs


def test_by_class_order_sorts_labels_within_each_corruption():
  labels = _labels([30, 30])
  plan = streams.plan('continual', labels, 8, seed=0, order='by_class')
  for c in (0, 1):
    seen = [int(labels[c][i]) for b in plan for cc, i in
            zip(b.corruption, b.sample) if cc == c]
    assert seen == sorted(seen)


def test_bad_stream_settings_are_named():
  with pytest.raises(ValueError, match="protocol='online'; valid: episodic"):
    streams.plan('online', _labels([3]), 2, 0)
  with pytest.raises(ValueError, match="order='random'"):
    streams.plan('mixed', _labels([3]), 2, 0, order='random')
  with pytest.raises(ValueError, match='batch_size=0'):
    streams.plan('mixed', _labels([3]), 0, 0)


def test_sar_step_is_a_sam_step_on_the_reliable_entropy():
  lr, rho = 0.05, 0.3
  method, params, stats, x = _method('sar', rho=rho)
  # A sharper head: some samples are reliable (H < E0), not all.
  params = {**params, 'head': {
      **params['head'],
      'kernel': np.asarray(params['head']['kernel']) * np.float32(8.0)}}
  method = methods.make(method.settings, method.classifier.model, params,
                        stats, optax.scale_by_learning_rate(lr))
  new, out = _step(method, method.init(), x)
  e0 = 0.4 * math.log(C)
  names = classifier_lib.adapted_names(params, ('bn_hidden',))
  w0 = {n: params[n.split('/')[0]][n.split('/')[1]] for n in names}

  def reliable_entropy(w, mask=None):
    p = {**params}
    for n, v in w.items():
      module, leaf = n.split('/')
      p = {**p, module: {**p[module], leaf: v}}
    logits = method.classifier.model.apply(
        {'params': p, 'batch_stats': stats}, x, train=True,
        mutable=['batch_stats'])[0]
    logp = jax.nn.log_softmax(logits)
    h = -jnp.sum(jnp.exp(logp) * logp, -1)
    keep = jax.lax.stop_gradient(h) < e0
    if mask is not None:
      keep = keep & mask
    return jnp.sum(jnp.where(keep, h, 0)) / jnp.maximum(jnp.sum(keep), 1), keep

  @jax.jit
  def reference(w0):
    (_, keep1), g = jax.value_and_grad(reliable_entropy, has_aux=True)(w0)
    norm = jnp.sqrt(sum(jnp.sum(v ** 2) for v in g.values()))
    w_adv = {n: w0[n] + rho * g[n] / norm for n in names}
    g2 = jax.grad(lambda w: reliable_entropy(w, keep1)[0])(w_adv)
    return keep1, g2

  keep1, g2 = jax.device_get(reference(w0))
  assert 0 < int(np.sum(keep1)) < len(x) and bool(out['updated'])
  for n in names:
    np.testing.assert_allclose(new.adapted[n],
                               np.asarray(w0[n]) - lr * g2[n], rtol=1e-4,
                               atol=1e-6)


def test_each_method_keeps_a_state_of_its_own_and_a_bad_name_is_named():
  fields = {name: type(_method(name)[0].init())._fields
            for name in methods.METHODS}
  assert fields['source'] == fields['bn_stats'] == ('adapted',)
  assert fields['tent'] == ('adapted', 'opt_state', 'updates')
  assert fields['eata'] == fields['tent'] + ('mean_probs', 'has_mean')
  assert fields['sar'] == fields['tent'] + ('loss_ema', 'has_ema', 'resets')
  with pytest.raises(ValueError, match="method='nope': unknown method; valid "
                     'choices: source, bn_stats, tent, eata, sar'):
    methods.kind('nope')
