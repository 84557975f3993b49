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

SAM (`config.optimizer.sam`, see `configs/sam_block.py`) wraps the whole chain
above: the perturbation uses the raw gradient g, and the chain (clipping
included) steps with the SAM gradient g+. Clipping g itself would not
change the perturbation, which is normalised.
"""

from collections.abc import Callable
import re
from typing import Any

import jax
import optax

from geom import hallucination
from geom import sam as sam_lib
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
  tx = optax.chain(*parts)
  if 'sam' in cfg and cfg.sam.enabled:
    tx = _sam_from_config(tx, cfg.sam)
  return tx


def _window(cfg: Any) -> tuple[int, int | None] | None:
  if cfg.window_start > 0 or cfg.window_stop != -1:
    return (cfg.window_start,
            None if cfg.window_stop == -1 else cfg.window_stop)
  return None


def sam_step_chooser(cfg: Any) -> Callable[[int, Any], bool] | None:
  """Host-side choice between a SAM and a plain step, or None if all alike.

  Returns `choose(step, opt_state) -> bool` when some steps are SAM steps
  and others plain (warm-up, window, warm restarts). The trainer then
  compiles both branches and runs the one chosen here, passing
  `sam_step=` to `tx.update`; this keeps convolution gradients out of a
  `lax.cond`, where XLA:CPU runs them about 70x slower (measured). The
  choice follows the same `geom.sam.StepSchedule` as the transformation;
  a warm restart's cooldown is read from the optimizer state.
  """
  if not ('sam' in cfg and cfg.sam.enabled) or cfg.sam.rho == 0:
    return None
  schedule = sam_lib.StepSchedule(cfg.sam.warmup_steps, _window(cfg.sam))
  warm_restart = cfg.sam.response == 'warm_restart'
  if schedule == sam_lib.StepSchedule() and not warm_restart:
    return None

  def choose(step: int, opt_state: Any) -> bool:
    if not schedule(step):
      return False
    if warm_restart:
      return int(jax.device_get(sam_lib.find_state(opt_state).cooldown)) == 0
    return True

  return choose


def _sam_from_config(base: optax.GradientTransformation,
                     cfg: Any) -> optax.GradientTransformationExtraArgs:
  # geom validates its arguments; its message names the argument, which
  # is the field's name here.
  try:
    detector = None
    if cfg.detector.enabled:
      detector = hallucination.DetectorConfig(
          ema_decay=cfg.detector.ema_decay,
          ratio_threshold=cfg.detector.ratio_threshold,
          min_grad_norm=cfg.detector.min_grad_norm,
          patience=cfg.detector.patience,
          track_cosine=cfg.detector.track_cosine)
    window = _window(cfg)
    return sam_lib.sam(
        base, rho=cfg.rho, adaptive=cfg.adaptive, eta=cfg.eta,
        warmup_steps=cfg.warmup_steps, window=window,
        batch_axis_name=M_SHARPNESS_AXIS if cfg.m_sharpness else None,
        detector=detector, response=cfg.response,
        restart_steps=cfg.restart_steps, shrink_factor=cfg.shrink_factor,
        fused=cfg.fused)
  except ValueError as e:
    # "geom.sam.sam: NAME=VALUE: PROBLEM" or "DetectorConfig.NAME=...".
    message = str(e).removeprefix('geom.sam.sam: ')
    detector_field = message.startswith('DetectorConfig.')
    match = re.match(r'(\w+)=(.*?)(?:: |; )(.*)$',
                     message.removeprefix('DetectorConfig.'))
    if not match:
      raise ConfigError('optimizer.sam', cfg.to_dict(), message) from None
    name, raw_value, problem = match.groups()
    if detector_field:
      field, value = f'detector.{name}', cfg.detector[name]
    elif name == 'window':
      field, value = 'window_start/window_stop', (cfg.window_start,
                                                  cfg.window_stop)
    else:
      field, value = name, cfg.get(name, raw_value)
    raise ConfigError(f'optimizer.sam.{field}', value, problem) from None


# The mesh axis along which m-sharpness perturbs per device.
M_SHARPNESS_AXIS = 'data'


def method_diagnostics(cfg: Any):
  """`opt_state -> dict` of the method wrapped around the chain, or None."""
  if 'sam' in cfg and cfg.sam.enabled:
    return sam_lib.diagnostics
  return None
