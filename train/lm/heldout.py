"""Held-out cross-entropy of any language model of the repository.

`cross_entropy(model, params, windows)`: the mean next-token
cross-entropy (nats per token) over held-out windows. The in-project
`DecoderLM` and `Gemma3` share the call `model.apply({'params': p},
tokens, valid)` -> (logits, cache), so one function measures either; the
forgetting studies (studies/lm_forgetting, studies/gemma_forgetting)
measure what a model forgot with it.
"""

import functools

import jax
import numpy as np
import optax

__all__ = ['cross_entropy']


@functools.cache
def _per_window_fn(model):
  """Jitted (params, tokens) -> per-window mean CE, one per model: every
  measure of a study on one model compiles it once."""

  @jax.jit
  def per_window(params, tokens):
    logits, _ = model.apply({'params': params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean(-1)
  return per_window


def cross_entropy(model, params, windows: np.ndarray, batch: int = 64
                  ) -> float:
  """Mean next-token cross-entropy (nats) over `windows` (N, len + 1).

  Args:
    model: a Flax LM of the repository (its `max_len` is widened to the
      windows where shorter: the parameters do not depend on it).
    params: its parameters.
    windows: (N, len + 1) token ids, every token real; each window
      predicts its tokens 1..len from the ones before.
    batch: windows per compiled call; the last call is padded to it and
      the padding dropped, so one shape compiles.
  """
  tokens = np.asarray(windows, np.int32)
  if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
    raise ValueError(f'windows of shape {tokens.shape}: need (N >= 1, '
                     'len + 1 >= 2)')
  if model.max_len < tokens.shape[1]:
    model = model.clone(max_len=tokens.shape[1])
  fn = _per_window_fn(model)
  total = 0.0
  for i in range(0, len(tokens), batch):
    chunk = tokens[i:i + batch]
    full = np.concatenate([chunk, np.repeat(chunk[:1], batch - len(chunk),
                                            0)])
    total += float(np.asarray(fn(params, full))[:len(chunk)].sum())
  return total / len(tokens)
