"""Our GRPO loss against tunix's `grpo_loss_fn` on the same inputs.

tunix (google-tunix 0.1.7, installed --no-deps from requirements-test.txt
with the packages its `tunix.rl.algo_core` imports) computes the
policy's log-probabilities itself from an NNX model; a model whose output
is a fixed logits array lets both losses see the same log-probabilities.
Mapping: tunix's `old_per_token_logps` is our proximal policy; its
`sampler_is_weights` (computed upstream in its learner as
min(exp(clip(trainer - sampler, -20, 20)), threshold)) is our 'tis'
correction; its 'sequence-mean-token-mean' / 'token-mean' aggregation is
ours; its 'low_var_kl' is our k3 penalty.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.rl import grpo

algo_core = pytest.importorskip('tunix.rl.algo_core')
nnx = pytest.importorskip('flax.nnx')

_AGGREGATION = {'sequence-mean': 'sequence-mean-token-mean',
                'token-mean': 'token-mean'}


class _FixedLogits(nnx.Module):
  """An NNX 'model' whose logits are a parameter, whatever the tokens."""

  def __init__(self, logits):
    self.logits = nnx.Param(logits)

  def __call__(self, tokens, positions=None, cache=None,
               attention_mask=None):
    del tokens, positions, cache, attention_mask
    return self.logits[...], None


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _inputs(seed, b=6, p=4, c=7, v=11):
  keys = jax.random.split(jax.random.key(seed), 6)
  logits = 2.0 * jax.random.normal(keys[0], (b, p + c, v))
  prompt = jax.random.randint(keys[1], (b, p), 2, v)
  completion = jax.random.randint(keys[2], (b, c), 2, v)
  lengths = jax.random.randint(keys[3], (b,), 1, c + 1)
  mask = (jnp.arange(c)[None] < lengths[:, None]).astype(jnp.float32)
  advantages = jax.random.normal(keys[4], (b,))
  noise = jax.random.normal(keys[5], (3, b, c))
  return logits, prompt, completion, mask, advantages, noise


def _ours_logps(logits, prompt, completion):
  p, c = prompt.shape[1], completion.shape[1]
  return grpo.token_log_probs(logits[:, p - 1:p + c - 1], completion)


def _losses(logits, prompt, completion, mask, adv, noise, *, aggregation,
            correction, beta):
  logps = _ours_logps(logits, prompt, completion)
  # Stale enough that the clip and the truncation act.
  proximal = jax.lax.stop_gradient(logps + 0.4 * noise[0])
  behaviour = proximal + 0.8 * noise[1]
  reference = logps + 0.3 * noise[2]
  weights = None
  if correction == 'tis':  # As tunix's learner computes them.
    weights = jnp.minimum(jnp.exp(jnp.clip(proximal - behaviour, -20, 20)),
                          2.0) * mask
  settings = grpo.LossSettings(correction=correction, beta=beta,
                               aggregation=aggregation, epsilon=0.2)
  config = types.SimpleNamespace(
      beta=beta, epsilon=0.2, loss_algo='grpo',
      loss_agg_mode=_AGGREGATION[aggregation], temperature=1.0,
      kl_loss_mode='low_var_kl', kl_clamp_value=None)

  def theirs(x):
    example = types.SimpleNamespace(
        prompt_ids=prompt, completion_ids=completion, completion_mask=mask,
        advantages=adv, old_per_token_logps=proximal,
        ref_per_token_logps=reference if beta else None,
        sampler_is_weights=weights)
    out = algo_core.grpo_loss_fn(_FixedLogits(x), example, config,
                                 pad_id=0, eos_id=1)
    return out[0] if isinstance(out, tuple) else out.loss

  def ours(x):
    batch = grpo.Batch(
        tokens=None, valid=None, loss_mask=mask, advantages=adv,
        behaviour_logps=behaviour, proximal_logps=proximal,
        reference_logps=reference)
    return grpo.policy_loss(_ours_logps(x, prompt, completion), batch,
                            settings)[0]

  return jax.value_and_grad(theirs)(logits), jax.value_and_grad(ours)(logits)


_CASES = [(a, c, beta) for a in _AGGREGATION for c in ('none', 'tis')
          for beta in (0.0, 0.04)]


@jax.jit
def _all_cases(*inputs):
  return {(a, c, beta): _losses(*inputs, aggregation=a, correction=c,
                                beta=beta) for a, c, beta in _CASES}


@functools.cache
def _results(seed):
  """Both losses and gradients of every case, from one jitted program for
  all cases and seeds: op by op, tunix's loss alone paid ~100 one-op
  compiles; a program per case, 8 compiles of ~1.5 s against one of ~4.
  (The inputs are a program of their own: fused into the losses, their
  random draws double its compile time.)"""
  return jax.device_get(_all_cases(*_inputs(seed)))


@pytest.mark.parametrize('aggregation', list(_AGGREGATION))
@pytest.mark.parametrize('correction', ['none', 'tis'])
@pytest.mark.parametrize('beta', [0.0, 0.04])
@pytest.mark.parametrize('seed', range(2))
def test_loss_and_gradient_equal_tunix(aggregation, correction, beta, seed):
  (want, want_grad), (got, got_grad) = _results(seed)[
      (aggregation, correction, beta)]
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-6)
  assert float(np.abs(want_grad).max()) > 0
