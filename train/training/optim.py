"""The optax chain a config asks for.

    clip_by_global_norm (optional)
    -> base scaling: sgd (identity) | momentum | adamw (scale_by_adam)
    -> decoupled weight decay, masked (norm scales and biases excluded)
    -> learning-rate schedule: linear warmup, then cosine decay or constant

Weight decay is added after the base scaling and before the learning rate,
as in `optax.adamw` (and SGDW for momentum): the step is lr * (u + wd * w).
`weight_decay_mode='l2'` (a field absent from older configs, which keep
'decoupled') adds wd * w to the gradient first instead, before clipping
and momentum: the gradient of an L2 penalty wd / 2 * |w|^2 in the loss, as
the SAM paper's code trains. With momentum 0.9 the decay then acts about
10x as strongly as the decoupled one of the same `weight_decay`.

`frozen` (a field absent from older configs: nothing frozen) is a regular
expression over parameter paths: the chain runs on the other parameters
only (`optax.multi_transform`, no state for frozen ones) and frozen ones
get zero updates, which weight decay does not reach either. The loss
sees them through `jax.lax.stop_gradient` (`train.training.experiment`), so their
gradient is never computed (for Gemma's tied 262,144 x 640 embedding
that is the output head's weight gradient) and a method that perturbs the
weights along the gradient (SAM) leaves them where they are.

Methods from `geom/` wrap this chain, each from its own config block
(`METHODS`: block name -> builder). A builder returns the wrapped
transformation and the method's `geom.method_hooks.MethodHooks`, which is
all a training loop learns about the method: the extra `update` arguments
it needs (SAM: `grad_fn`, the loss gradient at other weights on the same
batch), the kinds of step it may compile apart and how the host picks one,
its diagnostics and a per-device axis. `build` returns both in an
`Optimizer`; this module is the only place in `train/` that maps a
method's config block to its geom factory.

SAM (`config.optimizer.sam`, see `configs/sam_block.py`) wraps the whole chain
above: the perturbation uses the raw gradient g, and the chain (clipping
included) steps with the SAM gradient g+. Clipping g itself would not
change the perturbation, which is normalised. geom rejects a bad setting
with an `ArgumentError` that names its argument; the argument's config
field is named in the `ConfigError` raised here.
"""

from collections.abc import Callable
import dataclasses
import functools
import math
import re
from typing import Any

import jax
import ml_collections
import optax

from geom import hallucination
from geom import method_hooks
from geom import sam as sam_lib
from geom.validation import ArgumentError
from train.errors import ConfigError
from train.errors import from_argument_error

OPTIMIZERS = ('sgd', 'momentum', 'adamw')
WEIGHT_DECAY_MODES = ('decoupled', 'l2')
SCHEDULES = ('cosine', 'constant', 'wsd')


def learning_rate_schedule(cfg: ml_collections.ConfigDict,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 over `warmup_steps`, then cosine to
  `end_lr_fraction`, constant, or 'wsd' (warmup-stable-decay): constant,
  then a linear anneal to `end_lr_fraction` over the last
  `decay_fraction` of all steps (a field read only by 'wsd')."""
  if cfg.schedule not in SCHEDULES:
    raise ConfigError('optimizer.schedule', cfg.schedule, 'unknown schedule',
                      SCHEDULES)
  if not 0 < cfg.learning_rate < math.inf:
    raise ConfigError('optimizer.learning_rate', cfg.learning_rate,
                      'must be finite and > 0')
  if not 0 <= cfg.warmup_steps < total_steps:
    raise ConfigError('optimizer.warmup_steps', cfg.warmup_steps,
                      f'must be in [0, num_steps={total_steps})')
  if not 0 <= cfg.end_lr_fraction <= 1:
    raise ConfigError('optimizer.end_lr_fraction', cfg.end_lr_fraction,
                      'must be in [0, 1]')
  peak = cfg.learning_rate
  if cfg.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(
        peak, total_steps - cfg.warmup_steps, alpha=cfg.end_lr_fraction)
  elif cfg.schedule == 'wsd':
    fraction = cfg.get('decay_fraction', None)
    anneal = (0 if not isinstance(fraction, (int, float))
              else int(round(fraction * total_steps)))
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1
            and 1 <= anneal <= total_steps - cfg.warmup_steps):
      raise ConfigError('optimizer.decay_fraction', fraction,
                        "schedule 'wsd' needs the fraction of num_steps "
                        'to anneal over, in (0, 1], at least one step and '
                        'no more than the steps after warmup')
    stable = total_steps - cfg.warmup_steps - anneal
    decay = optax.join_schedules(
        [optax.constant_schedule(peak),
         optax.linear_schedule(peak, peak * cfg.end_lr_fraction, anneal)],
        [stable])
  else:
    decay = optax.constant_schedule(peak)
  if cfg.warmup_steps == 0:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, cfg.warmup_steps), decay],
      [cfg.warmup_steps])


def path_name(path) -> str:
  """A parameter's path as the config's expressions see it: 'block_0/mlp/up'."""
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def matching(params: Any, pattern: str) -> Any:
  """True where a parameter's path matches `pattern` (re.search)."""
  compiled = re.compile(pattern)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: compiled.search(path_name(path)) is not None, params)


def weight_decay_mask(params: Any, exclude: str) -> Any:
  """True where weight decay applies: parameters whose path does not match `exclude`."""
  return jax.tree.map(lambda m: not m, matching(params, exclude))


def frozen_mask(cfg: ml_collections.ConfigDict, params: Any) -> Any | None:
  """True where `cfg.frozen` freezes a parameter; None if nothing is."""
  pattern = cfg.get('frozen', '')
  return matching(params, pattern) if pattern else None


def check_frozen(cfg: ml_collections.ConfigDict, params: Any) -> None:
  """ConfigError naming `optimizer.frozen` when it matches no parameter
  or all of them (a typo would silently train everything, or nothing)."""
  mask = frozen_mask(cfg, params)
  if mask is None:
    return
  frozen = jax.tree.leaves(mask)
  names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      params)]
  if not any(frozen):
    raise ConfigError('optimizer.frozen', cfg.frozen,
                      f'matches no parameter (paths look like {names[0]!r})')
  if all(frozen):
    raise ConfigError('optimizer.frozen', cfg.frozen,
                      'matches every parameter: nothing would train')


def _freeze(tx: optax.GradientTransformation, pattern: str
            ) -> optax.GradientTransformation:
  """`tx` on the parameters `pattern` does not match; zero for the rest."""
  labels = lambda params: jax.tree.map(
      lambda m: 'frozen' if m else 'trained', matching(params, pattern))
  return optax.multi_transform(
      {'trained': tx, 'frozen': optax.set_to_zero()}, labels)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """The optimizer of a run, as a training loop consumes it.

  Attributes:
    tx: the whole transformation (chain, wrapped by any method).
    learning_rate: the schedule, for logging.
    hooks: what the methods in `tx` need from the loop.
    per_device_field: the config field that asked for `hooks.per_device_axis`
      (for messages), or None.
  """
  tx: optax.GradientTransformationExtraArgs
  learning_rate: optax.Schedule
  hooks: method_hooks.MethodHooks
  per_device_field: str | None = None


def _base_chain(cfg: ml_collections.ConfigDict,
                schedule: optax.Schedule) -> optax.GradientTransformation:
  """The chain described in the module docstring, without methods."""
  if cfg.name not in OPTIMIZERS:
    raise ConfigError('optimizer.name', cfg.name, 'unknown optimizer',
                      OPTIMIZERS)
  for field in ('weight_decay', 'grad_clip_norm'):
    if not 0 <= cfg[field] < math.inf:
      raise ConfigError(f'optimizer.{field}', cfg[field],
                        'must be finite and >= 0')
  try:
    re.compile(cfg.weight_decay_exclude)
  except re.error as e:
    raise ConfigError('optimizer.weight_decay_exclude',
                      cfg.weight_decay_exclude,
                      f'not a regular expression ({e})') from None
  mode = cfg.get('weight_decay_mode', 'decoupled')
  if mode not in WEIGHT_DECAY_MODES:
    raise ConfigError('optimizer.weight_decay_mode', mode,
                      'unknown weight decay mode', WEIGHT_DECAY_MODES)
  decay = (optax.add_decayed_weights(
      cfg.weight_decay,
      mask=lambda p: weight_decay_mask(p, cfg.weight_decay_exclude))
           if cfg.weight_decay > 0 else None)
  parts = []
  if decay is not None and mode == 'l2':
    parts.append(decay)
  if cfg.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
  if cfg.name == 'momentum':
    if not 0 <= cfg.momentum < 1:
      raise ConfigError('optimizer.momentum', cfg.momentum,
                        'must be in [0, 1)')
    parts.append(optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov))
  elif cfg.name == 'adamw':
    for field in ('b1', 'b2'):
      if not 0 <= cfg[field] < 1:
        raise ConfigError(f'optimizer.{field}', cfg[field],
                          'must be in [0, 1)')
    if not 0 < cfg.eps < math.inf:
      raise ConfigError('optimizer.eps', cfg.eps, 'must be finite and > 0')
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
  if decay is not None and mode == 'decoupled':
    parts.append(decay)
  parts.append(optax.scale_by_learning_rate(schedule))
  chain = optax.chain(*parts)
  frozen = cfg.get('frozen', '')
  if not isinstance(frozen, str):
    raise ConfigError('optimizer.frozen', frozen,
                      'must be a regular expression over parameter paths '
                      '(empty: none frozen)')
  if frozen:
    try:
      re.compile(frozen)
    except re.error as e:
      raise ConfigError('optimizer.frozen', frozen,
                        f'not a regular expression ({e})') from None
    chain = _freeze(chain, frozen)
  return chain


def build(cfg: ml_collections.ConfigDict, total_steps: int) -> Optimizer:
  """The chain from `config.optimizer`, wrapped by the enabled methods."""
  schedule = learning_rate_schedule(cfg, total_steps)
  tx = _base_chain(cfg, schedule)
  if 'sam' in cfg and cfg.sam.enabled:
    _check_sam_window(cfg.sam, total_steps)
  all_hooks, per_device_field = [], None
  for name, method in METHODS.items():
    if name in cfg and cfg[name].enabled:
      if method is _sam:  # Its schedules (AE-SAM's margin) span the run.
        method = functools.partial(_sam, total_steps=total_steps)
      tx, hooks, field = method(tx, cfg[name])
      all_hooks.append(hooks)
      per_device_field = per_device_field or field
  hooks = method_hooks.combine(*all_hooks)
  return Optimizer(optax.with_extra_args_support(tx), schedule, hooks,
                   per_device_field if hooks.per_device_axis else None)


def create_optimizer(cfg: ml_collections.ConfigDict,
                     total_steps: int) -> optax.GradientTransformationExtraArgs:
  """`build(cfg, total_steps).tx`: the transformation alone."""
  return build(cfg, total_steps).tx


# The mesh axis along which a method's per-device update runs (m-sharpness
# perturbs per device along it): the data axis.
PER_DEVICE_AXIS = 'data'

# SAM arguments whose config field has another name.
_SAM_FIELDS = {'window': 'window_start/window_stop',
               'batch_axis_name': 'm_sharpness',
               'ae_margin': 'ae.margin_start/margin_end',
               'ae_decay': 'ae.decay'}


def _sam_config_error(e: ArgumentError, cfg: ml_collections.ConfigDict,
                      prefix: str) -> ConfigError:
  if e.argument == 'window':
    value = (cfg.window_start, cfg.window_stop)
  elif e.argument == 'ae_margin':
    value = (cfg.ae.margin_start, cfg.ae.margin_end)
  elif e.argument == 'ae_decay':
    value = cfg.ae.decay
  else:
    value = cfg.get(_SAM_FIELDS.get(e.argument, e.argument), e.value)
  return from_argument_error(
      e, prefix, {a: f'{prefix}.{f}' for a, f in _SAM_FIELDS.items()}, value)


def _check_sam_window(cfg: ml_collections.ConfigDict, total_steps: int
                      ) -> None:
  """A SAM window must lie inside the run: one that starts at or after
  num_steps, or stops after it, would silently do less than it says."""
  start, stop = cfg.window_start, cfg.window_stop
  if (isinstance(start, int) and start >= total_steps) or (
      isinstance(stop, int) and stop > total_steps):
    raise ConfigError('optimizer.sam.window_start/window_stop',
                      (start, stop), f'outside the run (num_steps='
                      f'{total_steps}): need start < num_steps and stop <= '
                      'num_steps (-1 for no end)')


def _ae_margin(cfg: ml_collections.ConfigDict, total_steps: int
               ) -> float | optax.Schedule | None:
  """AE-SAM's c: None when off, a float, or linear over the run."""
  ae = cfg.get('ae')
  if ae is None or not ae.enabled:
    return None
  if ae.margin_start == ae.margin_end:
    return ae.margin_start
  return optax.linear_schedule(ae.margin_start, ae.margin_end,
                               max(total_steps, 1))


def _sam(base: optax.GradientTransformation, cfg: ml_collections.ConfigDict,
         total_steps: int = 1) -> tuple[optax.GradientTransformationExtraArgs,
                                        method_hooks.MethodHooks, str]:
  """SAM around `base` from `config.optimizer.sam`."""
  detector = None
  if cfg.detector.enabled:
    fields = {f.name for f in dataclasses.fields(hallucination.DetectorConfig)}
    try:
      detector = hallucination.DetectorConfig(
          **{k: v for k, v in cfg.detector.items() if k in fields})
    except ArgumentError as e:
      raise _sam_config_error(e, cfg.detector,
                              'optimizer.sam.detector') from None
  window = None
  if cfg.window_start != 0 or cfg.window_stop != -1:
    window = (cfg.window_start,
              None if cfg.window_stop == -1 else cfg.window_stop)
  try:
    options = sam_lib.SAMOptions(
        rho=cfg.rho, adaptive=cfg.adaptive, eta=cfg.eta,
        warmup_steps=cfg.warmup_steps, window=window,
        batch_axis_name=PER_DEVICE_AXIS if cfg.m_sharpness else None,
        detector=detector, response=cfg.response,
        restart_steps=cfg.restart_steps, shrink_factor=cfg.shrink_factor,
        fused=cfg.fused, every=cfg.get('every', 1),
        alpha=cfg.get('alpha', 0.7), ae_margin=_ae_margin(cfg, total_steps),
        ae_decay=cfg.ae.decay if 'ae' in cfg else 0.9)
  except ArgumentError as e:
    raise _sam_config_error(e, cfg, 'optimizer.sam') from None
  return (sam_lib.from_options(base, options), sam_lib.hooks(options),
          'optimizer.sam.m_sharpness')


# Config block under `config.optimizer` -> builder of the method around the
# chain: (tx, block) -> (tx, hooks, the field that sets a per-device axis).
METHODS: dict[str, Callable[..., tuple[
    optax.GradientTransformationExtraArgs, method_hooks.MethodHooks, str]]] = {
        'sam': _sam,
    }
