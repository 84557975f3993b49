"""The train state, the pure train / eval step functions, and their metrics.

A train step computes what training needs and nothing that would add a
collective across the mesh: per-example loss and correctness come out
sharded like the batch (no reduction inside the step) and are reduced on
the host at logging time, which also finds the first non-finite loss. The
gradient norm, which needs a reduction over every sharded parameter, is
taken on logging steps only.
"""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
from flax import struct
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax

NONFINITE_POLICIES = ('stop', 'skip')


@struct.dataclass
class TrainState:
  """Everything a run needs to continue bit-exactly; the step is the data position.

  Attributes:
    step: number of completed updates (int32 scalar).
    params / batch_stats: the model's variables.
    opt_state: the optax state.
    skipped_steps: updates skipped for non-finite values (policy 'skip').
  """
  step: jax.Array
  params: Any
  batch_stats: Any
  opt_state: Any
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
      skipped_steps=jnp.zeros((), jnp.int32))


def make_train_step(model: nn.Module, tx: optax.GradientTransformation,
                    nonfinite: str,
                    log_every: int) -> Callable[..., tuple[TrainState, dict]]:
  """One update on one batch; returns the new state and per-step metrics.

  Metrics: `loss` and `correct`, per example (sharded like the batch), and
  `grad_norm`, a scalar on logging steps (`(step + 1) % log_every == 0`)
  and 0 between. With `nonfinite='skip'` an update whose loss, gradient or
  update is non-finite is not applied (those checks do reduce across the
  mesh, so they run only under that policy).
  """
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f'nonfinite={nonfinite!r}; valid choices: '
                     f'{NONFINITE_POLICIES}')

  def train_step(state: TrainState, batch: dict[str, jax.Array]):

    def loss_fn(params):
      logits, updates = model.apply(
          {'params': params, 'batch_stats': state.batch_stats},
          batch['image'], train=True, mutable=['batch_stats'])
      losses = optax.softmax_cross_entropy_with_integer_labels(
          logits, batch['label'])
      return losses.mean(), (losses, logits, updates['batch_stats'])

    (loss, (losses, logits, batch_stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)

    def grad_fn(params):
      # Gradient at other weights on the same batch, for transformations
      # such as SAM. BatchNorm statistics come from the clean pass only.
      return jax.grad(lambda p: loss_fn(p)[0])(params)

    updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                   grad_fn=grad_fn)
    params = optax.apply_updates(state.params, updates)
    skipped = state.skipped_steps
    if nonfinite == 'skip':
      # A non-finite element makes a norm non-finite: one scalar per tree.
      # The update is checked too: a finite gradient times a huge learning
      # rate can overflow.
      finite = (jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
                & jnp.isfinite(optax.tree.norm(updates)))
      params, batch_stats, opt_state = jax.tree.map(
          lambda new, old: jnp.where(finite, new, old),
          (params, batch_stats, opt_state),
          (state.params, state.batch_stats, state.opt_state))
      skipped = skipped + (~finite).astype(jnp.int32)
    new_state = TrainState(step=state.step + 1, params=params,
                           batch_stats=batch_stats, opt_state=opt_state,
                           skipped_steps=skipped)
    log_step = (state.step + 1) % log_every == 0
    metrics = {
        'loss': losses,
        'correct': (jnp.argmax(logits, -1) == batch['label']).astype(
            jnp.float32),
        'grad_norm': jax.lax.cond(log_step, optax.tree.norm,
                                  lambda g: jnp.zeros((), jnp.float32), grads),
    }
    return new_state, metrics

  return train_step


def metric_shardings(batch_sharding: jax.sharding.Sharding,
                     replicated: jax.sharding.Sharding) -> dict[str, Any]:
  """Out-shardings of the train step's metrics (see `make_train_step`)."""
  return {'loss': batch_sharding, 'correct': batch_sharding,
          'grad_norm': replicated}


def _to_host(tree: Any) -> Any:
  if jax.process_count() > 1:  # Per-example values live on every host.
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def summarize(records: Sequence[dict[str, jax.Array]], first_step: int,
              grad_norm_sampled: bool) -> tuple[dict[str, float], int | None]:
  """Interval means of per-step metrics, and the first non-finite step.

  Args:
    records: the train step's metrics for steps first_step, first_step+1, ...
    first_step: the step number (state.step before the update) of records[0].
    grad_norm_sampled: whether the last record is a logging step, which
      holds the gradient norm.

  Returns:
    `train_loss` and `train_accuracy` averaged over the finite steps, plus
    `grad_norm` when sampled; and the first step whose loss is non-finite,
    or None.
  """
  host = _to_host(list(records))
  step_loss = np.array([np.mean(r['loss']) for r in host])
  step_acc = np.array([np.mean(r['correct']) for r in host])
  finite = np.isfinite(step_loss)
  bad = np.flatnonzero(~finite)
  first_bad = first_step + int(bad[0]) if bad.size else None
  scalars = {}
  if finite.any():
    scalars['train_loss'] = float(step_loss[finite].mean())
    scalars['train_accuracy'] = float(step_acc[finite].mean())
  if grad_norm_sampled:
    scalars['grad_norm'] = float(host[-1]['grad_norm'])
  return scalars, first_bad


def state_is_finite(state: TrainState) -> jax.Array:
  """True when every float in params, batch statistics and optimizer state is finite.

  Element by element (a norm would overflow on large finite values); run
  before each checkpoint only.
  """
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(
      (state.params, state.batch_stats, state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


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
