"""train.lm.heldout.cross_entropy against a plain log-softmax, for the
in-project decoder and Gemma 3 (small random models)."""

import jax
import numpy as np
import pytest

from tests import tiny_gemma
from train.lm import decoder
from train.lm import gemma
from train.lm import heldout

MODELS = {
    'decoder': decoder.DecoderLM(vocab_size=40, d_model=16, num_layers=2,
                                 num_heads=2, mlp_dim=32, max_len=8),
    'gemma': gemma.Gemma3(shape=tiny_gemma.SHAPE, max_len=8),
}


def _init(model, tokens, seed):
  # Jitted: op by op, the initialisation cost seconds of one-op compiles.
  return jax.jit(model.init)(jax.random.key(seed), tokens)['params']


def _reference(model, params, windows):
  """Mean over windows and positions of -log softmax(logits)[next token],
  in float64 from the model's logits (one plain jitted apply: op by op it
  cost seconds of one-op compiles)."""
  logits, _ = jax.jit(lambda p, t: model.apply({'params': p}, t))(
      params, windows[:, :-1])
  logits = np.asarray(logits, np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, windows[:, 1:, None], -1).mean()


# Gemma's case is `slow` (docs/slow_tests.md): heldout.cross_entropy is
# the same code for any model, and the Gemma studies' measures check it on
# the two-layer file against a plain log-softmax by default.
@pytest.mark.parametrize('name', [
    'decoder', pytest.param('gemma', marks=pytest.mark.slow)])
def test_cross_entropy_is_the_mean_next_token_log_loss(name):
  model = MODELS[name]
  vocab = model.vocab_size if name == 'decoder' else model.shape.vocab_size
  # Windows longer than the model's max_len (widened), and 5 windows in
  # compiled calls of 2: the last call is padded.
  windows = np.random.default_rng(0).integers(0, vocab, (5, 13))
  params = _init(model, windows[:, :-1], 1)
  want = _reference(model.clone(max_len=13), params, windows)
  got = heldout.cross_entropy(model, params, windows, batch=2)
  assert got == pytest.approx(want, rel=1e-5)
  # A chance-level model would be at log(vocab); random weights are not.
  assert abs(got - np.log(vocab)) > 0.05
  assert heldout.cross_entropy(model, params, windows, batch=8) == (
      pytest.approx(want, rel=1e-5))


def test_each_window_is_scored_alone():
  model = MODELS['decoder']
  windows = np.random.default_rng(2).integers(0, 40, (3, 9))
  params = _init(model, windows[:, :-1], 0)
  alone = [heldout.cross_entropy(model, params, w[None], batch=2)
           for w in windows]
  assert heldout.cross_entropy(model, params, windows, batch=2) == (
      pytest.approx(np.mean(alone), rel=1e-6))


@pytest.mark.parametrize('shape', [(0, 5), (3, 1), (6,)])
def test_windows_of_no_next_token_are_refused(shape):
  model = MODELS['decoder']
  params = _init(model, np.zeros((1, 4), np.int32), 0)
  with pytest.raises(ValueError, match='windows of shape'):
    heldout.cross_entropy(model, params, np.zeros(shape, np.int32))
