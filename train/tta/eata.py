"""'eata' (Niu et al., ICML 2022): entropy on reliable samples only
(H < E0 = 0.4 ln C), minus redundant ones (|cos(p, m)| >= d_margin, with m
the moving average of the kept samples' probabilities), each weighted by
1 / exp(H - E0), plus an EWC penalty alpha sum F (theta - theta_0)^2 with
the Fisher F of the source model on in-distribution samples (squared
gradients of the cross-entropy with the model's own predictions, as
EATA's code computes it)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from train.tta import classifier as classifier_lib
from train.tta import interface


class EataState(NamedTuple):
  """adapted, opt_state, updates: as TENT's (`tent.TentState`);
  mean_probs: the moving average m of the kept samples' probabilities;
  has_mean: whether `mean_probs` holds one yet."""
  adapted: interface.Flat
  opt_state: Any
  updates: jax.Array
  mean_probs: jax.Array
  has_mean: jax.Array


class Eata(interface.Method):
  """EATA; `fisher`: its Fisher diagonal over the adapted parameters."""
  fisher: interface.Flat | None = None

  def init(self) -> EataState:
    source = self.classifier.source
    return EataState(
        adapted=source, opt_state=self.tx.init(source),
        updates=jnp.zeros((), jnp.int32),
        mean_probs=jnp.zeros((self.settings.num_classes,), jnp.float32),
        has_mean=jnp.zeros((), bool))

  def filter(self, state: EataState, logits, h):
    """(kept mask, weights, probabilities) of EATA's two filters."""
    e0 = interface.margin(self.settings.num_classes)
    reliable = h < e0
    probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
    m = state.mean_probs
    cos = jnp.abs(probs @ m) / jnp.maximum(
        jnp.linalg.norm(probs, axis=-1) * jnp.linalg.norm(m), 1e-8)
    distinct = jnp.where(state.has_mean, cos < self.settings.d_margin, True)
    keep = reliable & distinct
    return keep, jnp.where(keep, jnp.exp(-(h - e0)), 0.0), probs

  def _loss(self, state: EataState, adapted, images):
    logits = self.classifier.logits(adapted, images, True)
    h = interface.entropies(logits)
    keep, weights, probs = self.filter(
        state, jax.lax.stop_gradient(logits), jax.lax.stop_gradient(h))
    n = jnp.maximum(jnp.sum(keep), 1)
    ent = jnp.sum(weights * h) / n
    source = self.classifier.source
    ewc = sum(jnp.sum(self.fisher[k] * jnp.square(adapted[k] - source[k]))
              for k in adapted)
    return ent + self.settings.fisher_alpha * ewc, (logits, h, keep, probs)

  def step(self, state: EataState, images: jax.Array
           ) -> tuple[EataState, dict[str, jax.Array]]:
    (loss, (logits, h, keep, probs)), grads = jax.value_and_grad(
        lambda adapted: self._loss(state, adapted, images),
        has_aux=True)(state.adapted)
    gate = jnp.any(keep)
    state = interface.gated_update(self.tx, state, grads, h, gate)
    kept_mean = (jnp.sum(jnp.where(keep[:, None], probs, 0.0), 0)
                 / jnp.maximum(jnp.sum(keep), 1))
    decay = self.settings.ema_decay
    mean = jnp.where(state.has_mean, decay * state.mean_probs
                     + (1 - decay) * kept_mean, kept_mean)
    state = state._replace(
        mean_probs=jnp.where(gate, mean, state.mean_probs),
        has_mean=state.has_mean | gate)
    return state, interface.outputs(logits, h, loss, jnp.mean(keep), gate,
                                    False)


def fisher_diagonal(classifier: classifier_lib.Classifier,
                    batches: list[jax.Array]) -> interface.Flat:
  """EATA's Fisher: the mean over `batches` (clean, in-distribution images)
  of the squared gradient of the cross-entropy against the source model's
  own predictions, for the adapted parameters."""
  def loss(adapted, images):
    logits = classifier.logits(adapted, images, True)
    labels = jnp.argmax(jax.lax.stop_gradient(logits), -1)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels))

  # Whole programs (op by op, each leaf's zeros, square, sum and division
  # compiled for itself).
  @jax.jit
  def accumulate(total, source, images):
    return jax.tree.map(lambda t, g: t + jnp.square(g), total,
                        jax.grad(loss)(source, images))

  total = jax.jit(lambda s: jax.tree.map(jnp.zeros_like, s))(
      classifier.source)
  for images in batches:
    total = accumulate(total, classifier.source, images)
  return jax.jit(lambda t: jax.tree.map(
      lambda x: x / max(len(batches), 1), t))(total)
