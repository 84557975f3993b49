"""`adapt_and_evaluate(config, workdir)`: test-time adaptation over a stream.

source workdir (a classifier trained by `launch.train`) -> the method's
adaptation over the stream (`train.tta.streams`) -> per-corruption error,
`metrics.jsonl` and TensorBoard (one record per batch), `results.json`
and `errors.png`.

The workdir's guarantees are the trainer's, from the same core
(`train.run.resumable`): one run per workdir, the config checked on resume,
the source pinned by content, verified checkpoints of the whole
adaptation state (the method's state, the stream position and the error
counts) every `checkpoint_every` batches, SIGTERM/SIGINT saving before
the run ends, and a bit-exact resume: a run killed at any point and
restarted ends with the same numbers, bit for bit, as one never stopped
(tested). A finished workdir returns its results without adapting again.
Every setting is checked, the source checkpoint loaded and verified and the
stream's data read before anything is compiled.
"""

from collections.abc import Mapping
import dataclasses
import functools
import inspect
import time
from typing import Any

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from geom import conga
from geom import method_hooks
from geom import validation
from train.training import aot
from train import fileio
from train.run import metrics as metrics_lib
from train.analysis import plots
from train.run import resumable
from train.run import resume_check
from train.training import steps
from train.errors import ConfigError, UsageError
from train.errors import from_argument_error
from train.training.experiment import check_seed
from train.training.experiment import check_workdir
from train.tta import data as tta_data
from train.tta import interface as method_interface
from train.tta import methods
from train.tta import source as source_lib
from train.tta import streams
from train.vision import datasets
from train.vision import models

RESULTS = 'results.json'
PLOT = 'errors.png'
# This process's batches per second past the first (compiling) one; apart
# from results.json, which is the same bit for bit however the run went.
TIMING = 'timing.json'
OPTIMIZERS = ('adam', 'sgd')
SCHEDULES = ('fixed', 'conga')
# Fields that may differ on resume: they change how the run is recorded,
# not what it computes.
MAY_CHANGE = ('log_every', 'checkpoint_every', 'keep_checkpoints',
              'data_dir', 'cpu_devices')


def _finite_positive(field: str, value) -> None:
  if not isinstance(value, (int, float)) or not np.isfinite(value) or (
      value <= 0):
    raise ConfigError(field, value, 'must be a finite number > 0')


def check_config(config: ml_collections.ConfigDict,
                 require_source: bool = True) -> None:
  """Every setting the run reads, before anything else (UsageError);
  `require_source=False` lets the source workdir be unset (compiling the
  step needs the source's config only)."""
  m = config.method
  if m.name not in methods.METHODS:
    raise ConfigError('method.name', m.name, 'unknown method',
                      methods.METHODS)
  if m.optimizer not in OPTIMIZERS:
    raise ConfigError('method.optimizer', m.optimizer, 'unknown optimizer',
                      OPTIMIZERS)
  if m.schedule not in SCHEDULES:
    raise ConfigError('method.schedule', m.schedule, 'unknown schedule',
                      SCHEDULES)
  _finite_positive('method.learning_rate', m.learning_rate)
  _check_conga(m)
  for field in ('d_margin', 'fisher_alpha', 'reset_below', 'rho'):
    _finite_positive(f'method.{field}', m[field])
  if config.protocol not in streams.PROTOCOLS:
    raise ConfigError('protocol', config.protocol, 'unknown protocol',
                      streams.PROTOCOLS)
  if config.order not in streams.ORDERS:
    raise ConfigError('order', config.order, 'unknown order', streams.ORDERS)
  for field in ('batch_size', 'checkpoint_every', 'keep_checkpoints',
                'log_every'):
    value = config[field]
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(field, value, 'must be a positive integer')
  check_seed(config)
  samples = m.fisher_samples  # EATA's; more than the split holds is all.
  if isinstance(samples, bool) or not isinstance(samples, int) or (
      samples <= 0):
    raise ConfigError('method.fisher_samples', samples,
                      'must be a positive integer')
  tta_data.check(config)
  if require_source and not config.source_workdir:
    raise ConfigError('source_workdir', config.source_workdir,
                      'required: the workdir of a classifier trained by '
                      '`python -m launch.train`')


def _conga_arguments(m: ml_collections.ConfigDict) -> dict[str, Any]:
  """`method.conga`'s set fields (None leaves geom's default)."""
  return {k: v for k, v in m.conga.items() if v is not None}


def _check_conga(m: ml_collections.ConfigDict) -> None:
  """`method.conga` (geom.conga.conga's keyword arguments) as CONGA would
  take them, before anything loads: the classes and steps come from the
  data later, so any valid ones stand in for them here."""
  known = set(inspect.signature(conga.conga).parameters) - {
      'learning_rate', 'num_classes', 'total_steps'}
  for name in m.conga:
    if name not in known:
      raise ConfigError(f'method.conga.{name}', m.conga[name],
                        'not an argument of geom.conga.conga', sorted(known))
  try:
    conga.conga(m.learning_rate, num_classes=2, total_steps=1,
                **_conga_arguments(m))
  except validation.ArgumentError as e:
    raise from_argument_error(e, 'method.conga', {
        'learning_rate': 'method.learning_rate'}) from None


def _tx(config, num_classes: int, total_steps: int
        ) -> optax.GradientTransformationExtraArgs:
  m = config.method
  direction = (optax.scale_by_adam() if m.optimizer == 'adam'
               else optax.trace(decay=0.9))
  if m.schedule == 'conga':
    rate = conga.conga(m.learning_rate, num_classes=num_classes,
                       total_steps=total_steps, **_conga_arguments(m))
  else:
    rate = optax.scale_by_learning_rate(m.learning_rate)
  return optax.chain(direction, rate)


@dataclasses.dataclass
class _Adaptation:
  """The mutable part of a run: what a checkpoint holds."""
  state: method_interface.State  # The method's own.
  correct: np.ndarray  # Per corruption, correctly predicted samples.
  seen: np.ndarray  # Per corruption, samples predicted.
  # Batches that changed the parameters, and model resets (SAR's), over
  # the whole stream (the method's state restarts at each episode).
  counts: np.ndarray  # (updates, resets)

  def tree(self) -> dict[str, Any]:
    return {'state': self.state, 'correct': jnp.asarray(self.correct),
            'seen': jnp.asarray(self.seen),
            'counts': jnp.asarray(self.counts)}


def _error_percent(correct: np.ndarray, seen: np.ndarray) -> np.ndarray:
  return 100.0 * (1.0 - correct / np.maximum(seen, 1))


def _results(names: list[str], adaptation: _Adaptation,
             batches: int) -> dict[str, Any]:
  errors = _error_percent(adaptation.correct, adaptation.seen)
  return {'errors': dict(zip(names, map(float, errors))),
          'mean_error': float(np.mean(errors)) if len(errors) else 0.0,
          'batches': batches, 'updates': int(adaptation.counts[0]),
          'resets': int(adaptation.counts[1])}


def _plot(results: Mapping[str, Any], title: str, path: str) -> None:
  names = list(results['errors'])
  fig, ax = plots.subplots(figsize=(max(6, 0.6 * len(names)), 4))
  ax.bar(range(len(names)), [results['errors'][n] for n in names])
  ax.set_xticks(range(len(names)), names, rotation=60, ha='right')
  ax.set_ylabel('error %')
  ax.set_title(f'{title}: mean {results["mean_error"]:.2f}%')
  ax.grid(axis='y', alpha=0.3)
  plots.save_png(fig, path)


def _check_resume(config, workdir: str, step: int, meta: dict) -> None:
  resume_check.check_task(config, workdir, step, meta, task='tta',
                          what='a test-time adaptation run',
                          may_change=MAY_CHANGE)


def adapt_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, Any]:
  """Adapts over the stream in `workdir` (resuming it); returns the results.

  Raises:
    UsageError: a setting is invalid, the source workdir holds no usable
      classifier for this data, or the workdir belongs to another run.
    WorkdirBusy: another run holds the workdir.
    NoGoodCheckpoint: the workdir's checkpoints are all damaged.
    NonFiniteLossError: the adapted parameters went non-finite (nothing
      non-finite is saved).
    DiskFull: a write ran out of space (earlier checkpoints are intact).
    Preempted: SIGTERM or SIGINT arrived; a checkpoint was saved first.
  """
  check_config(config)
  workdir = check_workdir(workdir)
  with resumable.open_run(
      config, workdir, check_config=functools.partial(
          _check_resume, config, workdir), results_name=RESULTS) as run:
    return _adapt(config, run)


def _settings(config, num_classes: int) -> method_interface.Settings:
  return method_interface.Settings(
      method=config.method.name, num_classes=num_classes,
      d_margin=config.method.d_margin,
      fisher_alpha=config.method.fisher_alpha,
      reset_below=config.method.reset_below, rho=config.method.rho)


# The adapt step: the method's arrays are arguments, not constants.
_step = jax.jit(methods.step)


def programs(config: ml_collections.ConfigDict,
             source_config: ml_collections.ConfigDict,
             devices: list[Any]) -> tuple[Mesh, list[aot.Program]]:
  """The adapt step as the loop compiles it, on shapes only, for
  `launch.compile`: the source classifier of `source_config` and a full
  batch of the stream, on one of `devices` (adaptation runs on one
  device). Returns the (one-device) mesh and the program."""
  check_config(config, require_source=False)
  stream = tta_data.stream_spec(config)
  spec = datasets.get_spec(source_config.dataset)
  if (spec.image_shape, spec.num_classes) != (stream.image_shape,
                                              stream.num_classes):
    raise UsageError('--model_config', source_config.dataset,
                     f'the source classifier\'s images {spec.image_shape} '
                     f'and {spec.num_classes} classes differ from the '
                     f'stream\'s ({config.dataset!r})')
  model = models.create_model(source_config.model, spec.num_classes,
                              spec.pixel_max)
  example = np.zeros((1, *spec.image_shape), np.uint8)
  variables = nn.meta.unbox(jax.eval_shape(
      functools.partial(model.init, train=False), jax.random.key(0),
      example))
  settings = _settings(config, spec.num_classes)
  # CONGA's horizon is a constant of the program; its value does not
  # change what is compiled.
  tx = _tx(config, spec.num_classes, 1)

  def bind(params, batch_stats):
    method = methods.bind(settings, model, params, batch_stats, tx)
    if settings.method == 'eata':  # Its Fisher: the adapted parameters'.
      method = method.replace(fisher=jax.tree.map(
          jnp.zeros_like, method.classifier.source))
    return method

  method = jax.eval_shape(bind, variables['params'],
                          variables.get('batch_stats', {}))
  state = jax.eval_shape(methods.init, method)
  mesh = Mesh(np.array(devices[:1]), ('data',))
  place = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=NamedSharding(mesh, P())),
      tree)
  images = jax.ShapeDtypeStruct((config.batch_size, *spec.image_shape),
                                np.uint8)
  return mesh, [aot.Program(f'adapt_step ({settings.method})', _step,
                            place((method, state, images)))]


def _method(config, source: source_lib.Source, stream: tta_data.Stream,
            plan: list[streams.Batch]) -> method_interface.Method:
  """The method bound to the source model, its optimizer and EATA's Fisher
  batches."""
  longest = max((len(l) for l in stream.labels), default=0)
  per_episode = -(-longest // config.batch_size)
  settings = _settings(config, source.spec.num_classes)
  # CONGA's progress runs over an episode (a corruption's batches) when the
  # stream resets between corruptions, else over the whole stream.
  total = per_episode if config.protocol == 'episodic' else len(plan)
  tx = _tx(config, source.spec.num_classes, max(total, 1))
  fisher = None
  if settings.method == 'eata':
    fisher = [jnp.asarray(b)
              for b in tta_data.in_distribution_batches(config)]
  return methods.make(settings, source.model, source.params,
                      source.batch_stats, tx, fisher)


def _hooks(config) -> method_hooks.MethodHooks:
  """What the schedule needs from the loop (its diagnostics)."""
  return (conga.hooks() if config.method.schedule == 'conga'
          else method_hooks.MethodHooks())


# Whether the adapted parameters are finite (checked before each save).
_adapted_finite = jax.jit(lambda tree: steps.tree_is_finite(
    tree['state'].adapted))


def _adapt(config, run: resumable.Run) -> dict[str, Any]:
  source = source_lib.load(config)
  # The source is pinned by content: one that trained on since this run
  # started (same path) is refused, on resume and on a finished rerun.
  run.pin({'config.source_workdir': source.fingerprint})
  stream = tta_data.load(config)
  plan = streams.plan(config.protocol, stream.labels, config.batch_size,
                      config.seed, config.order)
  finished = run.finished(len(plan))
  if finished is not None:
    return finished
  method = _method(config, source, stream, plan)
  names = stream.corruptions
  adaptation = _Adaptation(method.init(), np.zeros(len(names), np.int32),
                           np.zeros(len(names), np.int32),
                           np.zeros(2, np.int32))
  found = run.restore(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      adaptation.tree()))
  position = 0
  if found is not None:
    position, tree, _ = found
    logging.info('Resuming at batch %d of %d', position, len(plan))
    adaptation = _Adaptation(tree['state'], np.array(tree['correct']),
                             np.array(tree['seen']),
                             np.array(tree['counts']))
  run.finite = resumable.Finite(_adapted_finite, 'adapted parameters',
                                can_skip=False)
  timed_from = _adapt_stream(config, run, method, stream, plan, position,
                             adaptation)
  if timed_from is not None:
    seconds = time.perf_counter() - timed_from[0]
    timed = len(plan) - timed_from[1]
    metrics_lib.write_json_atomic(fileio.join(run.workdir, TIMING), {
        'batches': timed, 'seconds': seconds,
        'batches_per_second': timed / seconds if seconds > 0 else None})
  results = _results(names, adaptation, len(plan))
  run.writer.write(len(plan), {'mean_error': results['mean_error']})
  run.finish(results, lambda: (adaptation.tree(), {}))
  _plot(results, f'{config.method.name} ({config.method.schedule}), '
        f'{config.protocol}, severity {config.severity}',
        fileio.join(run.workdir, PLOT))
  return results


def _adapt_stream(config, run: resumable.Run,
                  method: method_interface.Method,
                  stream: tta_data.Stream, plan: list[streams.Batch],
                  position: int, adaptation: _Adaptation
                  ) -> tuple[float, int] | None:
  """Adapts `adaptation` in place over `plan[position:]`, logging and saving;
  returns (time, batches done) after the first batch (None if none)."""
  initial = method.init()
  diagnostics = _hooks(config).diagnostics
  timed_from = None
  with run.stopping():
    images = stream.images_of(plan[position]) if plan[position:] else None
    for index in range(position, len(plan)):
      batch = plan[index]
      if batch.reset:
        adaptation.state = initial
      adaptation.state, out = _step(method, adaptation.state, images)
      # The next batch is gathered while the devices run this one.
      if index + 1 < len(plan):
        images = stream.images_of(plan[index + 1])
      out = jax.device_get(out)
      hit = out['pred'] == stream.labels_of(batch)
      np.add.at(adaptation.correct, batch.corruption, hit)
      np.add.at(adaptation.seen, batch.corruption, 1)
      adaptation.counts += [int(out['updated']), int(out['reset'])]
      done = index + 1
      if done % config.log_every == 0 or done == len(plan):
        scalars = {'error': 100.0 * (1.0 - float(np.mean(hit))),
                   'entropy': float(np.mean(out['entropy'])),
                   'loss': float(out['loss']), 'kept': float(out['kept']),
                   'corruption': float(batch.corruption[0]),
                   'reset': float(out['reset'])}
        if diagnostics is not None:
          scalars.update({f'opt/{k}': float(v) for k, v in jax.device_get(
              diagnostics(adaptation.state.opt_state)).items()})
        run.writer.write(done, scalars)
      run.end_step(done, lambda: (adaptation.tree(), {}))
      if timed_from is None:
        timed_from = (time.perf_counter(), done)
  return timed_from
