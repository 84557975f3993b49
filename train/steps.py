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
from jax.sharding import PartitionSpec as P
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


# (model, variables, batch, train) -> (per-example loss, per-example
# correctness in [0, 1], new batch_stats).
PerExample = Callable[[nn.Module, dict[str, Any], dict[str, jax.Array], bool],
                      tuple[jax.Array, jax.Array, Any]]


def classification_loss(model: nn.Module, variables: dict[str, Any],
                        batch: dict[str, jax.Array], train: bool):
  """Cross-entropy and correctness of `batch['image']` against `batch['label']`."""
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


def make_train_step(
    model: nn.Module, tx: optax.GradientTransformation, nonfinite: str,
    log_every: int, *,
    diagnostics: Callable[[Any], dict[str, jax.Array]] | None = None,
    local_axis: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    sam_step: bool | None = None,
    check_vma: bool = True,
    per_example: PerExample | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
  """One update on one batch; returns the new state and per-step metrics.

  Args:
    model, tx: the model and the optax transformation. `tx.update` gets
      `grad_fn(params)`, the loss gradient at other weights on the same
      batch (BatchNorm statistics come from the clean pass only).
    nonfinite: 'stop' or 'skip' (see the trainer).
    log_every: the gradient norm is computed on logging steps only.
    diagnostics: `opt_state -> dict of scalars` of the method in `tx` (e.g.
      SAM's), reported each step under `opt/<name>`.
    local_axis: m-sharpness: the mesh axis (the data axis) along which each
      device computes its own gradient, inside `jax.shard_map`; `tx` must
      average over it (`geom.sam.sam(batch_axis_name=local_axis)`).
      BatchNorm then normalises with per-device statistics, as in the
      reference implementation, and their running averages are averaged.
    mesh: the mesh, needed with `local_axis`.
    sam_step: passed to `tx.update` when not None: a SAM (True) or plain
      (False) step fixed at trace time (see `geom.sam.sam`).
    check_vma: shard_map's check of device-variance (with `local_axis`).
      False for Pallas kernels in interpret mode, whose interpreter
      rejects device-varying operands; the explicit means above keep the
      outputs replicated either way.
    per_example: the loss, as `(model, variables, batch, train) ->
      (losses, correct, new batch_stats)` per example (default:
      `classification_loss`; `lm_loss` for language models).

  Returns:
    `train_step(state, batch) -> (state, metrics)`. Metrics: `loss` and
    `correct` per example (sharded like the batch), `grad_norm` on logging
    steps (`(step + 1) % log_every == 0`, else 0; with `local_axis`, the
    mean over devices of their gradients' norms), and the diagnostics.
    With `nonfinite='skip'` an update whose loss, gradient or update is
    non-finite is not applied (those checks reduce across the mesh, so
    they run only under that policy).
  """
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f'nonfinite={nonfinite!r}; valid choices: '
                     f'{NONFINITE_POLICIES}')
  if local_axis is not None and mesh is None:
    raise ValueError('make_train_step: local_axis needs the mesh')
  per_example = per_example or classification_loss

  def across(fn, x):
    return x if local_axis is None else fn(x, local_axis)

  def update(params, batch_stats, opt_state, skipped, step, batch):

    def loss_fn(p):
      losses, correct, new_stats = per_example(
          model, {'params': p, 'batch_stats': batch_stats}, batch, True)
      return losses.mean(), (losses, correct, new_stats)

    # With local_axis, differentiate at the device-varying copy of the
    # weights: the gradient at the replicated weights would already be
    # summed over the axis.
    at = params
    if local_axis is not None and check_vma:
      at = jax.lax.pcast(params, local_axis, to='varying')
    (loss, (losses, correct, new_stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(at)
    new_stats = across(jax.lax.pmean, new_stats)
    grad_fn = lambda p: jax.grad(lambda q: loss_fn(q)[0])(p)
    extra = {} if sam_step is None else {'sam_step': sam_step}
    updates, new_opt = tx.update(grads, opt_state, params, grad_fn=grad_fn,
                                 **extra)
    new_params = optax.apply_updates(params, updates)
    if nonfinite == 'skip':
      # A non-finite element makes a norm non-finite: one scalar per tree.
      # The update is checked too: a finite gradient times a huge learning
      # rate can overflow.
      finite = (jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
                & jnp.isfinite(optax.tree.norm(updates)))
      finite = across(jax.lax.pmin, finite.astype(jnp.int32)) > 0
      new_params, new_stats, new_opt = jax.tree.map(
          lambda new, old: jnp.where(finite, new, old),
          (new_params, new_stats, new_opt), (params, batch_stats, opt_state))
      skipped = skipped + (~finite).astype(jnp.int32)
    # The zero keeps the gradient's device-variance (for shard_map's types).
    zero = lambda g: jnp.zeros_like(jax.tree.leaves(g)[0].ravel()[0],
                                    jnp.float32)
    grad_norm = jax.lax.cond((step + 1) % log_every == 0, optax.tree.norm,
                             zero, grads)
    return (new_params, new_stats, new_opt, skipped, losses, correct,
            across(jax.lax.pmean, grad_norm))

  if local_axis is not None:
    rep, loc = P(), P(local_axis)
    update = jax.shard_map(
        update, mesh=mesh, in_specs=(rep, rep, rep, rep, rep, loc),
        out_specs=(rep, rep, rep, rep, loc, loc, rep),
        axis_names={local_axis}, check_vma=check_vma)

  def train_step(state: TrainState, batch: dict[str, jax.Array]):
    params, stats, opt_state, skipped, losses, correct, grad_norm = update(
        state.params, state.batch_stats, state.opt_state,
        state.skipped_steps, state.step, batch)
    new_state = TrainState(step=state.step + 1, params=params,
                           batch_stats=stats, opt_state=opt_state,
                           skipped_steps=skipped)
    metrics = {'loss': losses, 'correct': correct, 'grad_norm': grad_norm}
    if diagnostics is not None:
      metrics.update({f'opt/{k}': v.astype(jnp.float32)
                      for k, v in diagnostics(opt_state).items()})
    return new_state, metrics

  return train_step


def metric_shardings(batch_sharding: jax.sharding.Sharding,
                     replicated: jax.sharding.Sharding) -> Callable[[str], Any]:
  """Out-sharding of each train-step metric (see `make_train_step`)."""
  per_example = ('loss', 'correct')
  return lambda name: batch_sharding if name in per_example else replicated


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
    `train_loss` and `train_accuracy` averaged over the finite steps;
    `grad_norm` when sampled; the other metrics (the method's diagnostics)
    as of the last step; and the first step whose loss is non-finite, or
    None.
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
  scalars.update({k: float(v) for k, v in host[-1].items()
                  if k not in ('loss', 'correct', 'grad_norm')})
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


def make_eval_step(
    model: nn.Module,
    per_example: PerExample | None = None) -> Callable[..., dict[str, jax.Array]]:
  """Sums of loss, correct predictions and real examples (mask) of one batch."""
  per_example = per_example or classification_loss

  def eval_step(state: TrainState, batch: dict[str, jax.Array]):
    loss, correct, _ = per_example(
        model, {'params': state.params, 'batch_stats': state.batch_stats},
        batch, False)
    mask = batch['mask']
    return {'loss_sum': jnp.sum(loss * mask),
            'correct': jnp.sum(correct * mask),
            'count': jnp.sum(mask)}

  return eval_step
