"""The train state and the pure train / eval step functions (jitted by the trainer)."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import struct
import jax
import jax.numpy as jnp
import optax

NONFINITE_POLICIES = ('stop', 'skip')


@struct.dataclass
class TrainState:
  """Everything a run needs to continue bit-exactly; the step is the data position.

  Attributes:
    step: number of completed updates (int32 scalar).
    params / batch_stats: the model's variables.
    opt_state: the optax state.
    nonfinite_step: first step whose loss or gradient was non-finite, or -1.
    skipped_steps: updates skipped for non-finite values (policy 'skip').
  """
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
  nonfinite_step: jax.Array
  skipped_steps: jax.Array


def init_state(model: nn.Module, tx: optax.GradientTransformation,
               example_images: jax.Array, rng: jax.Array) -> TrainState:
  variables = nn.meta.unbox(model.init(rng, example_images, train=False))
  params = variables['params']
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      batch_stats=variables.get('batch_stats', {}),
      opt_state=tx.init(params),
      nonfinite_step=jnp.full((), -1, jnp.int32),
      skipped_steps=jnp.zeros((), jnp.int32))


def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                            for x in jax.tree.leaves(tree)]))


def make_train_step(model: nn.Module, tx: optax.GradientTransformation,
                    learning_rate: optax.Schedule,
                    nonfinite: str) -> Callable[..., tuple[TrainState, dict]]:
  """One update on one batch; returns the new state and per-step scalars."""
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f'nonfinite={nonfinite!r}; valid choices: '
                     f'{NONFINITE_POLICIES}')

  def train_step(state: TrainState, batch: dict[str, jax.Array]):

    def loss_fn(params):
      logits, updates = model.apply(
          {'params': params, 'batch_stats': state.batch_stats},
          batch['image'], train=True, mutable=['batch_stats'])
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits, batch['label']).mean()
      return loss, (logits, updates['batch_stats'])

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)

    def grad_fn(params):
      # Gradient at other weights on the same batch, for transformations
      # such as SAM. BatchNorm statistics come from the clean pass only.
      return jax.grad(lambda p: loss_fn(p)[0])(params)

    updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                   grad_fn=grad_fn)
    params = optax.apply_updates(state.params, updates)

    grad_norm = optax.tree.norm(grads)
    # Per element, not through a norm: a norm overflows on large finite values.
    finite = jnp.isfinite(loss) & _all_finite(grads) & _all_finite(updates)
    if nonfinite == 'skip':
      params, batch_stats, opt_state = jax.tree.map(
          lambda new, old: jnp.where(finite, new, old),
          (params, batch_stats, opt_state),
          (state.params, state.batch_stats, state.opt_state))
    first_bad = (~finite) & (state.nonfinite_step < 0)
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        batch_stats=batch_stats,
        opt_state=opt_state,
        nonfinite_step=jnp.where(first_bad, state.step, state.nonfinite_step),
        skipped_steps=state.skipped_steps + jnp.where(
            finite, 0, 1).astype(jnp.int32) * (nonfinite == 'skip'))
    metrics = {
        'train_loss': loss,
        'train_accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['label']),
        'grad_norm': grad_norm,
        'learning_rate': learning_rate(state.step),
    }
    return new_state, metrics

  return train_step


def make_eval_step(model: nn.Module) -> Callable[..., dict[str, jax.Array]]:
  """Sums of loss, correct predictions and real examples (mask) of one batch."""

  def eval_step(state: TrainState, batch: dict[str, jax.Array]):
    logits = model.apply(
        {'params': state.params, 'batch_stats': state.batch_stats},
        batch['image'], train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['label'])
    correct = jnp.argmax(logits, -1) == batch['label']
    mask = batch['mask']
    return {'loss_sum': jnp.sum(loss * mask),
            'correct': jnp.sum(correct * mask),
            'count': jnp.sum(mask)}

  return eval_step
