"""The train state, the pure train / eval step functions, and their metrics.

A train step computes what training needs and nothing that would add a
collective across the mesh: per-example loss and correctness come out
sharded like the batch (no reduction inside the step) and are reduced on
the host at logging time, which also finds the first non-finite loss. The
gradient norm, which needs a reduction over every sharded parameter, is
taken on logging steps only.
"""

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import flax.linen as nn
from flax import struct
import jax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax

from geom import method_hooks

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
  params: optax.Params
  batch_stats: Any  # A pytree of arrays ({} for models without BatchNorm).
  opt_state: optax.OptState
  skipped_steps: jax.Array


# (model, variables, batch, train) -> (per-example loss, per-example
# correctness in [0, 1], new batch_stats). Each product defines its own
# (`train.vision.loss`, `train.lm.loss`).
PerExample = Callable[[nn.Module, dict[str, Any], dict[str, jax.Array], bool],
                      tuple[jax.Array, jax.Array, Any]]

# The extra `update` arguments (geom.method_hooks.UPDATE_ARGUMENTS) this
# step gives a method that asks for them.
SUPPLIED_UPDATE_ARGUMENTS = ('grad_fn',)

# Prefix of the method's diagnostics among the step's metrics.
DIAGNOSTICS_PREFIX = 'opt/'


def check_update_arguments(hooks: method_hooks.MethodHooks) -> None:
  """Raises ValueError when `hooks` asks for an argument this step lacks."""
  missing = [a for a in hooks.update_arguments
             if a not in SUPPLIED_UPDATE_ARGUMENTS]
  if missing:
    raise ValueError(
        f'the method {hooks.name!r} needs the update argument {missing[0]!r}, '
        f'which this train step does not give (it gives: '
        f'{", ".join(SUPPLIED_UPDATE_ARGUMENTS)})')


def init_state(init_variables: Callable[[jax.Array], Mapping[str, Any]],
               tx: optax.GradientTransformation,
               rng: jax.Array) -> TrainState:
  """A fresh state from `init_variables(rng)` (the model's `init`)."""
  variables = nn.meta.unbox(init_variables(rng))
  params = variables['params']
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      batch_stats=variables.get('batch_stats', {}),
      opt_state=tx.init(params),
      skipped_steps=jnp.zeros((), jnp.int32))


def make_train_step(
    model: nn.Module, tx: optax.GradientTransformation,
    per_example: PerExample, *,
    nonfinite: str = 'stop',
    log_every: int = 1,
    hooks: method_hooks.MethodHooks = method_hooks.MethodHooks(),
    mesh: jax.sharding.Mesh | None = None,
    variant: Hashable | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
  """One update on one batch; returns the new state and per-step metrics.

  Args:
    model, tx: the model and the optax transformation.
    per_example: the loss, as `(model, variables, batch, train) ->
      (losses, correct, new batch_stats)` per example.
    nonfinite: 'stop' or 'skip' (see `train.training.loop`).
    log_every: the gradient norm is computed on logging steps only.
    hooks: what the method in `tx` needs (`geom.method_hooks`): its extra
      `update` arguments (`grad_fn(params)`: the loss gradient at other
      weights on this batch, BatchNorm statistics from the clean pass
      only), its diagnostics (reported each step as `opt/<name>`) and a
      per-device axis: then the update runs inside `jax.shard_map` over
      that mesh axis (the data axis) with each device's own gradient, and
      `tx` averages over it; BatchNorm normalises with per-device
      statistics, and their running averages are averaged.
    mesh: the mesh, needed with a per-device axis.
    variant: one of `hooks.variants.values`, passed to `tx.update` as
      `hooks.variants.argument`: the kind of step, fixed at trace time.
      None: `tx` decides by itself.

  Returns:
    `train_step(state, batch) -> (state, metrics)`. Metrics: `loss` and
    `correct` per example (sharded like the batch), `grad_norm` on logging
    steps (`(step + 1) % log_every == 0`, else 0; with a per-device axis,
    the mean over devices of their gradients' norms), and the diagnostics.
    With `nonfinite='skip'` an update whose loss, gradient or update is
    non-finite is not applied (those checks reduce across the mesh, so
    they run only under that policy).
  """
  fixed = _check_step(nonfinite, hooks, mesh, variant)
  update = _update(model, tx, per_example, nonfinite, log_every, hooks, fixed)
  local_axis = hooks.per_device_axis
  if local_axis is not None:
    rep, loc = P(), P(local_axis)
    update = jax.shard_map(
        update, mesh=mesh, in_specs=(rep, rep, rep, rep, rep, loc),
        out_specs=(rep, rep, rep, rep, loc, loc, rep),
        axis_names={local_axis}, check_vma=hooks.check_per_device_types)

  def train_step(state: TrainState, batch: dict[str, jax.Array]):
    params, stats, opt_state, skipped, losses, correct, grad_norm = update(
        state.params, state.batch_stats, state.opt_state,
        state.skipped_steps, state.step, batch)
    new_state = TrainState(step=state.step + 1, params=params,
                           batch_stats=stats, opt_state=opt_state,
                           skipped_steps=skipped)
    metrics = {'loss': losses, 'correct': correct, 'grad_norm': grad_norm}
    if hooks.diagnostics is not None:
      metrics.update({DIAGNOSTICS_PREFIX + k: v.astype(jnp.float32)
                      for k, v in hooks.diagnostics(opt_state).items()})
    return new_state, metrics

  return train_step


def _check_step(nonfinite: str, hooks: method_hooks.MethodHooks,
                mesh: jax.sharding.Mesh | None,
                variant: Hashable | None) -> dict[str, Hashable]:
  """ValueError for settings `make_train_step` cannot honour; returns the
  `tx.update` argument that fixes the variant ({} for none)."""
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f'nonfinite={nonfinite!r}; valid choices: '
                     f'{NONFINITE_POLICIES}')
  check_update_arguments(hooks)
  if hooks.per_device_axis is not None and mesh is None:
    raise ValueError('make_train_step: a per-device axis needs the mesh')
  if variant is None:
    return {}
  if hooks.variants is None or variant not in hooks.variants.values:
    raise ValueError(f'variant={variant!r}: the method {hooks.name!r} has '
                     f'no such kind of step')
  return {hooks.variants.argument: variant}


def _update(model: nn.Module, tx: optax.GradientTransformation,
            per_example: PerExample, nonfinite: str, log_every: int,
            hooks: method_hooks.MethodHooks, fixed: dict[str, Hashable]
            ) -> Callable[..., tuple]:
  """`update(params, batch_stats, opt_state, skipped, step, batch)`: the
  step on arrays (on one device's shard of the batch with a per-device
  axis) -> (params, batch_stats, opt_state, skipped, losses, correct,
  grad_norm)."""
  local_axis = hooks.per_device_axis
  check_vma = hooks.check_per_device_types

  def across(fn, x):
    return x if local_axis is None else fn(x, local_axis)

  def update(params, batch_stats, opt_state, skipped, step, batch):

    def loss_fn(p):
      losses, correct, new_stats = per_example(
          model, {'params': p, 'batch_stats': batch_stats}, batch, True)
      return losses.mean(), (losses, correct, new_stats)

    # With a per-device axis, differentiate at the device-varying copy of
    # the weights: the gradient at the replicated weights would already be
    # summed over the axis.
    at = params
    if local_axis is not None and check_vma:
      at = jax.lax.pcast(params, local_axis, to='varying')
    (loss, (losses, correct, new_stats)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(at)
    new_stats = across(jax.lax.pmean, new_stats)
    supplied = {'grad_fn': lambda p: jax.grad(lambda q: loss_fn(q)[0])(p)}
    extra = {name: supplied[name] for name in hooks.update_arguments}
    updates, new_opt = tx.update(grads, opt_state, params, **extra, **fixed)
    new_params = optax.apply_updates(params, updates)
    if nonfinite == 'skip':
      (new_params, new_stats, new_opt), skipped = _unless_nonfinite(
          across, loss, grads, updates, (new_params, new_stats, new_opt),
          (params, batch_stats, opt_state), skipped)
    # The zero keeps the gradient's device-variance (for shard_map's types).
    zero = lambda g: jnp.zeros_like(jax.tree.leaves(g)[0].ravel()[0],
                                    jnp.float32)
    grad_norm = jax.lax.cond((step + 1) % log_every == 0, optax.tree.norm,
                             zero, grads)
    return (new_params, new_stats, new_opt, skipped, losses, correct,
            across(jax.lax.pmean, grad_norm))

  return update


def _unless_nonfinite(across, loss, grads, updates, new, old, skipped):
  """(`new`, skipped) if the loss, gradient and update are finite on every
  device, else (`old`, skipped + 1)."""
  # A non-finite element makes a norm non-finite: one scalar per tree.
  # The update is checked too: a finite gradient times a huge learning
  # rate can overflow.
  finite = (jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
            & jnp.isfinite(optax.tree.norm(updates)))
  finite = across(jax.lax.pmin, finite.astype(jnp.int32)) > 0
  new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  return new, skipped + (~finite).astype(jnp.int32)


def metric_shardings(batch_sharding: jax.sharding.Sharding,
                     replicated: jax.sharding.Sharding
                     ) -> Callable[[str], jax.sharding.Sharding]:
  """Out-sharding of each train-step metric (see `make_train_step`)."""
  per_example = ('loss', 'correct')
  return lambda name: batch_sharding if name in per_example else replicated


def _to_host(tree: Any) -> Any:
  if jax.process_count() > 1:  # Per-example values live on every host.
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def summarize(records: Sequence[dict[str, jax.Array]], first_step: int,
              grad_norm_logged: bool,
              carried: Sequence[Sequence[float]] = ()
              ) -> tuple[dict[str, float], int | None, list[list[float]]]:
  """Interval means of per-step metrics, and the first non-finite step.

  Args:
    records: the train step's metrics for steps first_step, first_step+1, ...
    first_step: the step number (state.step before the update) of records[0].
    grad_norm_logged: whether the last record is a logging step, which
      holds the gradient norm.
    carried: [loss, accuracy] means of the interval's earlier steps, as
      this function returned them (a checkpoint keeps them, so that the
      interval's means after a resume equal an uninterrupted run's).

  Returns:
    `train_loss` and `train_accuracy` averaged over the finite steps
    (carried ones included); `grad_norm` when logged; the other metrics
    (the method's diagnostics) as of the last step; the first step of
    `records` whose loss is non-finite, or None; and [loss, accuracy] of
    each record, for `carried`.
  """
  host = _to_host(list(records))
  fresh_loss = np.array([np.mean(r['loss']) for r in host])
  fresh_acc = np.array([np.mean(r['correct']) for r in host])
  # Carried values are exact (float32 and float64 both survive JSON), and
  # rebuilt in the dtypes of the fresh ones: identical means, bit for bit.
  step_loss = np.concatenate([np.array([c[0] for c in carried],
                                       fresh_loss.dtype), fresh_loss])
  step_acc = np.concatenate([np.array([c[1] for c in carried],
                                      fresh_acc.dtype), fresh_acc])
  finite = np.isfinite(step_loss)
  bad = np.flatnonzero(~np.isfinite(fresh_loss))
  first_bad = first_step + int(bad[0]) if bad.size else None
  scalars = {}
  if finite.any():
    scalars['train_loss'] = float(step_loss[finite].mean())
    scalars['train_accuracy'] = float(step_acc[finite].mean())
  if grad_norm_logged:
    scalars['grad_norm'] = float(host[-1]['grad_norm'])
  scalars.update({k: float(v) for k, v in host[-1].items()
                  if k not in ('loss', 'correct', 'grad_norm')})
  means = [[float(l), float(a)] for l, a in zip(fresh_loss, fresh_acc)]
  return scalars, first_bad, means


def tree_is_finite(tree: Any) -> jax.Array:
  """True when every float in `tree` is finite, element by element (a norm
  would overflow on large finite values)."""
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def state_is_finite(state: TrainState) -> jax.Array:
  """True when every float in params, batch statistics and optimizer state
  is finite; run before each checkpoint only."""
  return tree_is_finite((state.params, state.batch_stats, state.opt_state))


def make_eval_step(
    model: nn.Module,
    per_example: PerExample) -> Callable[..., dict[str, jax.Array]]:
  """Sums of loss, correct predictions and real examples (mask) of one batch."""

  def eval_step(state: TrainState, batch: dict[str, jax.Array]):
    loss, correct, _ = per_example(
        model, {'params': state.params, 'batch_stats': state.batch_stats},
        batch, False)
    mask = batch['mask']
    return {'loss_sum': jnp.sum(loss * mask),
            'correct': jnp.sum(correct * mask),
            'count': jnp.sum(mask)}

  return eval_step
