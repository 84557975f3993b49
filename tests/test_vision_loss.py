"""The image loss: cross-entropy, and label smoothing in training only, in numpy."""

import jax
import numpy as np

from train.vision import loss
from train.vision import models


def _setup():
  model = models.CNN(num_classes=10, features=(4,), hidden=8, pixel_max=16.0)
  rng = np.random.default_rng(0)
  images = rng.integers(0, 17, (6, 8, 8, 1)).astype(np.uint8)
  labels = rng.integers(0, 10, (6,)).astype(np.int32)
  # Jitted with an 'rbg' key: op by op or with threefry this takes seconds.
  variables = jax.jit(lambda: model.init(jax.random.key(0, impl='rbg'),
                                         images, train=False))()
  return model, variables, {'image': images, 'label': labels}


def _cross_entropy(logits, targets):
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  log_p = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  return -(targets * log_p).sum(-1)


def test_label_smoothing_mixes_the_uniform_distribution_in_training():
  model, variables, batch = _setup()
  logits, _ = jax.jit(lambda v, x: model.apply(
      v, x, train=True, mutable=['batch_stats']))(variables, batch['image'])
  one_hot = np.eye(10)[batch['label']]
  for a in (0.0, 0.3):
    fn = jax.jit(lambda v, b, a=a: loss.classification_loss(
        model, v, b, True, label_smoothing=a))
    losses, correct, _ = fn(variables, batch)
    want = _cross_entropy(logits, (1 - a) * one_hot + a / 10)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    np.testing.assert_array_equal(
        correct, np.argmax(logits, -1) == batch['label'])


def test_evaluation_keeps_the_plain_cross_entropy():
  model, variables, batch = _setup()
  logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(
      variables, batch['image'])
  losses, _, stats = jax.jit(lambda v, b: loss.classification_loss(
      model, v, b, False, label_smoothing=0.1))(variables, batch)
  np.testing.assert_allclose(
      losses, _cross_entropy(logits, np.eye(10)[batch['label']]), rtol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, stats, variables['batch_stats'])
