"""The decoder LM's per-sequence loss (a `train.training.steps.PerExample`)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def lm_loss(model: nn.Module, variables: dict[str, Any],
            batch: dict[str, jax.Array], train: bool):
  """Next-token cross-entropy (mean over positions) of `batch['tokens']`
  (batch, seq + 1), and next-token accuracy, per sequence."""
  del train  # No dropout or batch statistics in the LM.
  tokens = batch['tokens'].astype(jnp.int32)
  logits, _ = model.apply({'params': variables['params']}, tokens[:, :-1])
  targets = tokens[:, 1:]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return losses.mean(-1), correct.mean(-1), variables['batch_stats']
