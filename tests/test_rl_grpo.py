"""The GRPO loss against a hand-written per-token reference (numpy, float64)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from tests import host_params
from train.errors import ConfigError
from train.lm import decoder as decoder_lm
from train.rl import grpo


def _reference(logps, batch, settings):
  """The loss written out token by token in float64 loops."""
  b, t = logps.shape
  per_seq, all_tokens = [], []
  for i in range(b):
    terms = []
    for j in range(t):
      if not batch.loss_mask[i, j]:
        continue
      a = float(batch.advantages[i])
      lr = min(max(float(logps[i, j]) - float(batch.proximal_logps[i, j]),
                   -20.0), 20.0)
      r = math.exp(lr)
      surrogate = max(-a * r, -a * min(max(r, 1 - settings.epsilon),
                                       1 + settings.epsilon))
      w = math.exp(min(max(float(batch.proximal_logps[i, j])
                           - float(batch.behaviour_logps[i, j]), -20.), 20.))
      if settings.correction == 'none':
        w = 1.0
      elif settings.correction == 'tis':
        w = min(w, settings.is_cap)
      elif w > settings.is_cap:
        w = 0.0
      term = w * surrogate
      if settings.beta:
        d = float(batch.reference_logps[i, j]) - float(logps[i, j])
        term += settings.beta * (math.exp(d) - d - 1)
      terms.append(term)
    all_tokens += terms
    if terms:
      per_seq.append(sum(terms) / len(terms))
  if settings.aggregation == 'token-mean':
    return sum(all_tokens) / max(len(all_tokens), 1)
  return sum(per_seq) / max(len(per_seq), 1)


# Jitted, as the learner runs them: op by op, each new shape pays a
# one-op compile.
_loss = jax.jit(grpo.policy_loss, static_argnums=2)
_grad = jax.jit(jax.grad(lambda x, batch, settings: grpo.policy_loss(
    x, batch, settings)[0]), static_argnums=2)
_loss_and_grad = jax.jit(jax.value_and_grad(grpo.policy_loss, has_aux=True),
                         static_argnums=2)


def _batch(rng, b=6, t=9, spread=0.7):
  return _batch_jit(rng, b, t, spread)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _batch_jit(rng, b, t, spread):
  keys = jax.random.split(rng, 6)
  mask = jax.random.bernoulli(keys[0], 0.7, (b, t)).astype(jnp.float32)
  mask = mask.at[0].set(0.0)  # A completion with no tokens (all padding).
  base = -jax.random.uniform(keys[1], (b, t), minval=0.05, maxval=4.0)
  logps = base + spread * jax.random.normal(keys[2], (b, t))
  behave = base + spread * jax.random.normal(keys[3], (b, t))
  ref = base + spread * jax.random.normal(keys[4], (b, t))
  batch = grpo.Batch(
      tokens=jnp.zeros((b, t + 1), jnp.int32),
      valid=jnp.ones((b, t + 1), bool), loss_mask=mask,
      advantages=jax.random.normal(keys[5], (b,)),
      behaviour_logps=behave, proximal_logps=base, reference_logps=ref)
  return logps, batch


SETTINGS = [grpo.LossSettings(correction=c, aggregation=a, beta=beta,
                              epsilon=eps)
            for c in grpo.CORRECTIONS for a in grpo.AGGREGATIONS
            for beta, eps in ((0.0, 0.2), (0.04, 0.1))]


@pytest.mark.parametrize('settings', SETTINGS, ids=str)
@pytest.mark.parametrize('seed', range(3))
def test_loss_equals_the_token_by_token_reference(settings, seed):
  logps, batch = _batch(jax.random.key(seed))
  loss, _ = _loss(logps, batch, settings)
  want = _reference(np.asarray(logps, np.float64), jax.tree.map(np.asarray,
                                                                  batch),
                    settings)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)


def test_gradient_equals_finite_differences():
  settings = grpo.LossSettings(correction='tis', beta=0.04)
  logps, batch = _batch(jax.random.key(7), spread=0.05)
  grad = _grad(logps, batch, settings)
  ref = lambda x: _reference(x, jax.tree.map(
      lambda a: np.asarray(a, np.float64), batch), settings)
  x = np.asarray(logps, np.float64)
  h = 1e-6
  for i, j in [(1, 0), (2, 3), (3, 5), (5, 8), (4, 4)]:
    up, down = x.copy(), x.copy()
    up[i, j] += h
    down[i, j] -= h
    np.testing.assert_allclose(float(grad[i, j]),
                               (ref(up) - ref(down)) / (2 * h), atol=1e-5)


def test_on_policy_gradient_is_the_advantage_weighted_score():
  # At pi_theta = pi_prox = pi_behave the ratio is 1: the gradient of the
  # token-mean loss wrt each log-prob is -A_i / n (a policy gradient).
  _, batch = _batch(jax.random.key(3))
  batch = batch._replace(behaviour_logps=batch.proximal_logps)
  settings = grpo.LossSettings(aggregation='token-mean')
  for correction in grpo.CORRECTIONS:
    s = settings.__class__(**{**settings.__dict__, 'correction': correction})
    grad = _grad(batch.proximal_logps, batch, s)
    b = jax.tree.map(np.asarray, batch)
    want = -b.advantages[:, None] * b.loss_mask / b.loss_mask.sum()
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def _ppo(logps, old, adv, mask, eps):
  r = np.exp(logps - old)
  terms = np.maximum(-adv[:, None] * r,
                     -adv[:, None] * np.clip(r, 1 - eps, 1 + eps))
  per_seq = (terms * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
  return per_seq[mask.sum(-1) > 0].mean()


@pytest.mark.parametrize('seed', range(3))
def test_decoupled_ppo_is_ppo_when_proximal_is_behaviour(seed):
  logps, batch = _batch(jax.random.key(seed), spread=0.5)
  batch = batch._replace(proximal_logps=batch.behaviour_logps)
  settings = grpo.LossSettings(correction='decoupled', epsilon=0.2)
  loss, aux = _loss(logps, batch, settings)
  b = jax.tree.map(lambda a: np.asarray(a, np.float64), batch)
  want = _ppo(np.asarray(logps, np.float64), b.behaviour_logps, b.advantages,
              b.loss_mask, 0.2)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(aux['clip_fraction']) > 0  # The clip really acts here.
  assert float(aux['ess']) == pytest.approx(1.0)


def test_corrections_differ_where_the_behaviour_policy_is_stale():
  logps, batch = _batch(jax.random.key(11), spread=1.5)
  losses = {c: float(_loss(logps, batch, grpo.LossSettings(correction=c))[0])
            for c in grpo.CORRECTIONS}
  assert len(set(losses.values())) == 3, losses
  _, aux = _loss(logps, batch, grpo.LossSettings())
  assert 0 < float(aux['dropped_fraction']) < 1
  assert 0 < float(aux['ess']) < 1
  _, aux = _loss(logps, batch, grpo.LossSettings(correction='tis'))
  assert float(aux['weight_max']) <= 2.0


def test_extreme_log_ratios_stay_finite():
  logps, batch = _batch(jax.random.key(2))
  batch = batch._replace(
      behaviour_logps=np.asarray(batch.behaviour_logps) - 1e4)
  logps = np.asarray(logps) - 50.0
  for c in grpo.CORRECTIONS:
    s = grpo.LossSettings(correction=c, beta=0.1)
    (loss, aux), grad = _loss_and_grad(logps, batch, s)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(grad)), c
    assert all(np.isfinite(float(v)) for v in aux.values()), (c, aux)


def test_empty_mask_gives_zero_loss_and_zero_gradient():
  logps, batch = _batch(jax.random.key(1))
  batch = batch._replace(loss_mask=np.zeros(batch.loss_mask.shape,
                                            np.float32))
  for a in grpo.AGGREGATIONS:
    s = grpo.LossSettings(aggregation=a)
    (loss, _), grad = _loss_and_grad(logps, batch, s)
    assert float(loss) == 0.0
    assert not np.any(grad)


def test_bfloat16_log_probs_give_a_float32_loss_close_to_float32():
  logps, batch = _batch(jax.random.key(4))
  s = grpo.LossSettings()
  full = _loss(logps, batch, s)[0]
  half = _loss(logps.astype(jnp.bfloat16), batch, s)[0]
  assert half.dtype == jnp.float32
  np.testing.assert_allclose(float(half), float(full), rtol=0.05, atol=0.01)


def test_group_advantages_against_numpy():
  rng = np.random.default_rng(0)
  rewards = rng.integers(0, 2, 24).astype(np.float32)
  got = grpo.group_advantages(rewards, 4)
  g = rewards.reshape(6, 4)
  want = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True)
                                           + 1e-6)
  np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-6)
  # A group of equal rewards has zero advantage (no signal, no NaN).
  assert not np.any(np.asarray(got).reshape(6, 4)[g.std(1) == 0])
  with pytest.raises(ConfigError, match='group_size'):
    grpo.group_advantages(rewards, 1)
  with pytest.raises(ValueError, match='groups of 5'):
    grpo.group_advantages(rewards, 5)


def test_sequence_log_probs_match_per_position_softmax():
  model = decoder_lm.DecoderLM(vocab_size=32, d_model=16, num_layers=1,
                               num_heads=2, mlp_dim=32, max_len=16)
  tokens = np.random.default_rng(0).integers(2, 32, (3, 10), np.int32)
  valid = np.ones((3, 10), bool)
  valid[0, :3] = False
  params = host_params.draw(model, 1)
  # Jitted, as the learner runs it; the reference passes are jitted too
  # (one compile per prefix length instead of one per op).
  got = np.asarray(jax.jit(grpo.sequence_log_probs, static_argnums=0,
                           static_argnames='temperature')(
                               model, params, tokens, valid, temperature=0.7))
  apply = jax.jit(model.apply)
  for t in (3, 5, 8):  # Slots 0-2 of row 0 are padding; 3 is its first token.
    logits, _ = apply({'params': params}, tokens[:, :t + 1], valid[:, :t + 1])
    logits = np.asarray(logits, np.float64)[:, -1]
    want = scipy.special.log_softmax(logits / 0.7, -1)[np.arange(3),
                                                       tokens[:, t + 1]]
    np.testing.assert_allclose(got[:, t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('field,value', [
    ('correction', 'vtrace'), ('aggregation', 'sum'), ('epsilon', 0.0),
    ('is_cap', 0.5), ('beta', -1.0), ('temperature', 0.0)])
def test_bad_settings_name_the_field(field, value):
  with pytest.raises(ConfigError, match=f'grpo.{field}'):
    grpo.LossSettings(**{field: value}).check()
