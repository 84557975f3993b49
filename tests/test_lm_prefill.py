"""A prompt's prefill with the last position's logits alone
(`interface.prefill(..., last_only=True)`, which generation uses), for the
in-project decoder and Gemma 3 (small random models): the same logits and
cache as the full prefill, and the head's work over the other positions
gone from the compiled program."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tiny_gemma
from train.lm import decoder
from train.lm import gemma
from train.lm import generate
from train.lm import interface

MODELS = {
    'decoder': decoder.DecoderLM(vocab_size=512, d_model=16, num_layers=2,
                                 num_heads=2, mlp_dim=32, max_len=24),
    'gemma': gemma.Gemma3(shape=tiny_gemma.SHAPE, max_len=24),
}
BATCH, PROMPT, SLOTS = 3, 9, 16


@functools.cache
def _setup(name):
  """The model, its parameters and a prompt batch: built once per model
  for the file's tests (which only read them), the initialisation jitted
  (op by op it cost seconds of one-op compiles)."""
  model = MODELS[name]
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, model.vocab_size, (BATCH, PROMPT)).astype(np.int32)
  valid = np.ones((BATCH, PROMPT), bool)
  valid[0, :4] = False  # Left padding in one row.
  params = jax.jit(model.init)(jax.random.key(1), tokens)['params']
  return model, params, tokens, valid


def _prefill(model, last_only):
  return jax.jit(lambda p, t, v: interface.prefill(
      model, p, t, v, SLOTS, last_only=last_only)[:2])


# The decoder's cases of this test and the greedy one below are `slow`
# (docs/slow_tests.md): its last-only prefill and cached decoding are
# test_steering_lm's (cached generation equals recomputation).
BOTH_SLOW_DECODER = [pytest.param('decoder', marks=pytest.mark.slow), 'gemma']


@pytest.mark.parametrize('name', BOTH_SLOW_DECODER)
def test_the_last_positions_logits_and_the_cache_are_the_full_prefills(name):
  model, params, tokens, valid = _setup(name)
  full_logits, full_cache = _prefill(model, False)(params, tokens, valid)
  logits, cache = _prefill(model, True)(params, tokens, valid)
  assert logits.shape == (BATCH, 1, model.vocab_size)
  np.testing.assert_allclose(logits, full_logits[:, -1:], rtol=1e-6,
                             atol=1e-6)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(full_cache)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_the_heads_work_over_the_other_positions_is_gone(name):
  """The compiled prefill's FLOPs fall by the head's closed form over the
  prompt's other positions, 2 * batch * (prompt - 1) * d_model * vocab
  (XLA does not narrow a matmul whose rows are sliced afterwards)."""
  model, params, tokens, valid = _setup(name)
  flops = {}
  for last_only in (False, True):
    def kept(p, t, v, last_only=last_only):  # What generation keeps.
      logits, cache, _ = interface.prefill(model, p, t, v, SLOTS,
                                           last_only=last_only)
      return logits[:, -1], cache
    compiled = jax.jit(kept).lower(params, tokens, valid).compile()
    flops[last_only] = compiled.cost_analysis()['flops']
  head = 2 * BATCH * (PROMPT - 1) * model.d_model * model.vocab_size
  assert flops[False] - flops[True] == pytest.approx(head, rel=0.05), flops


@pytest.mark.parametrize('name', BOTH_SLOW_DECODER)
def test_greedy_generation_is_the_full_forwards_argmax(name):
  """Cached greedy decoding (the last-only prefill, then one step per
  token) against a full forward pass over the sequence so far per step."""
  model, params, tokens, valid = _setup(name)
  steps = 4
  out = jax.jit(lambda p, t, v: generate.generate(
      model, p, t, v, steps).tokens)(params, tokens, valid)
  # Jitted, one compile per sequence length: op by op, the full forwards
  # cost seconds of one-op compiles per length.
  last_logits = jax.jit(lambda p, s, v: model.apply({'params': p}, s, v)[0][
      :, -1])
  seq, seq_valid = jnp.asarray(tokens), jnp.asarray(valid)
  for i in range(steps):
    nxt = jnp.argmax(last_logits(params, seq, seq_valid), -1).astype(
        jnp.int32)
    np.testing.assert_array_equal(out[:, i], nxt, err_msg=f'step {i}')
    seq = jnp.concatenate([seq, nxt[:, None]], 1)
    seq_valid = jnp.concatenate([seq_valid, jnp.ones((BATCH, 1), bool)], 1)
