"""The optax chain a config asks for.

    clip_by_global_norm (optional)
    -> base scaling: sgd (identity) | momentum | adamw (scale_by_adam)
    -> decoupled weight decay, masked (norm scales and biases excluded)
    -> learning-rate schedule: linear warmup, then cosine decay or constant

Weight decay is added after the base scaling and before the learning rate,
as in `optax.adamw` (and SGDW for momentum): the step is lr * (u + wd * w).

Methods from `geom/` plug in around this chain: the trainer calls
`tx.update(grads, state, params, grad_fn=...)`, where `grad_fn(params)` is
the loss gradient at other weights on the same batch. Chains built with
`optax.chain` accept and forward such extra arguments, so a geom
transformation that needs a second gradient (SAM) receives it without any
change to the trainer.
"""

import re
from typing import Any

import jax
import optax

from train.errors import ConfigError

OPTIMIZERS = ('sgd', 'momentum', 'adamw')
SCHEDULES = ('cosine', 'constant')


def learning_rate_schedule(cfg: Any, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 over `warmup_steps`, then cosine to `end_lr_fraction` or constant."""
  if cfg.schedule not in SCHEDULES:
    raise ConfigError('optimizer.schedule', cfg.schedule, 'unknown schedule',
                      SCHEDULES)
  if not cfg.learning_rate > 0:
    raise ConfigError('optimizer.learning_rate', cfg.learning_rate,
                      'must be > 0')
  if not 0 <= cfg.warmup_steps < total_steps:
    raise ConfigError('optimizer.warmup_steps', cfg.warmup_steps,
                      f'must be in [0, num_steps={total_steps})')
  peak = cfg.learning_rate
  if cfg.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(
        peak, total_steps - cfg.warmup_steps, alpha=cfg.end_lr_fraction)
  else:
    decay = optax.constant_schedule(peak)
  if cfg.warmup_steps == 0:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, cfg.warmup_steps), decay],
      [cfg.warmup_steps])


def weight_decay_mask(params: Any, exclude: str) -> Any:
  """True where weight decay applies: parameters whose path does not match `exclude`."""
  pattern = re.compile(exclude)

  def keep(path, _):
    name = '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)
    return pattern.search(name) is None

  return jax.tree_util.tree_map_with_path(keep, params)


def create_optimizer(cfg: Any,
                     total_steps: int) -> optax.GradientTransformationExtraArgs:
  """Builds the chain described in the module docstring from `config.optimizer`."""
  if cfg.name not in OPTIMIZERS:
    raise ConfigError('optimizer.name', cfg.name, 'unknown optimizer',
                      OPTIMIZERS)
  for field in ('weight_decay', 'grad_clip_norm'):
    if cfg[field] < 0:
      raise ConfigError(f'optimizer.{field}', cfg[field], 'must be >= 0')
  try:
    re.compile(cfg.weight_decay_exclude)
  except re.error as e:
    raise ConfigError('optimizer.weight_decay_exclude',
                      cfg.weight_decay_exclude,
                      f'not a regular expression ({e})') from None
  schedule = learning_rate_schedule(cfg, total_steps)

  parts = []
  if cfg.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  if cfg.name == 'momentum':
    if not 0 <= cfg.momentum < 1:
      raise ConfigError('optimizer.momentum', cfg.momentum,
                        'must be in [0, 1)')
    parts.append(optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov))
  elif cfg.name == 'adamw':
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
  if cfg.weight_decay > 0:
    parts.append(optax.add_decayed_weights(
        cfg.weight_decay,
        mask=lambda p: weight_decay_mask(p, cfg.weight_decay_exclude)))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts)
