"""The image classifiers' per-example loss (a `train.training.steps.PerExample`)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def classification_loss(model: nn.Module, variables: dict[str, Any],
                        batch: dict[str, jax.Array], train: bool, *,
                        label_smoothing: float = 0.0):
  """Cross-entropy and correctness of `batch['image']` against `batch['label']`.

  In training, BatchNorm normalises with the batch's statistics and the
  updated running averages are returned; in evaluation they are used as is.
  With `label_smoothing` = a > 0 the training loss is the cross-entropy
  against (1 - a) * one_hot + a / num_classes (Szegedy et al. 2016; the
  SAM paper's ImageNet runs use 0.1); evaluation keeps the plain
  cross-entropy, so validation and test losses stay comparable.
  """
  if train:
    logits, new_vars = model.apply(variables, batch['image'], train=True,
                                   mutable=['batch_stats'])
    new_stats = new_vars['batch_stats']
  else:
    logits = model.apply(variables, batch['image'], train=False)
    new_stats = variables['batch_stats']
  if train and label_smoothing:
    targets = optax.smooth_labels(
        jax.nn.one_hot(batch['label'], logits.shape[-1]), label_smoothing)
    losses = optax.softmax_cross_entropy(logits, targets)
  else:
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['label'])
  correct = (jnp.argmax(logits, -1) == batch['label']).astype(jnp.float32)
  return losses, correct, new_stats
