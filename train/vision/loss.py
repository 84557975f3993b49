"""The image classifiers' per-example loss (a `train.steps.PerExample`)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def classification_loss(model: nn.Module, variables: dict[str, Any],
                        batch: dict[str, jax.Array], train: bool):
  """Cross-entropy and correctness of `batch['image']` against `batch['label']`.

  In training, BatchNorm normalises with the batch's statistics and the
  updated running averages are returned; in evaluation they are used as is.
  """
  if train:
    logits, new_vars = model.apply(variables, batch['image'], train=True,
                                   mutable=['batch_stats'])
    new_stats = new_vars['batch_stats']
  else:
    logits = model.apply(variables, batch['image'], train=False)
    new_stats = variables['batch_stats']
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch['label'])
  correct = (jnp.argmax(logits, -1) == batch['label']).astype(jnp.float32)
  return losses, correct, new_stats
