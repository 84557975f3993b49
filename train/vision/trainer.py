"""`train_and_evaluate(config, workdir)`: the supervised image-classification trainer.

The flow: validate and build the experiment (no compute) -> restore the
latest checkpoint or initialise sharded state -> compile the train and
eval steps ahead of time (memory statistics logged) -> train (small
training splits live on the devices and the host sends batch indices),
logging, evaluating on the validation split and checkpointing at the
configured intervals -> evaluate the test split once at the end ->
`final_metrics.json`, and a PNG of the curves.

A SIGTERM makes the run save a checkpoint at the current step and raise
`Preempted`; running the same command again resumes from it, data position
included, and ends with the same parameters as an uninterrupted run.
"""

import contextlib
import functools
import signal
import threading
from typing import Any, NamedTuple

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_collections

from train import checkpointing
from train import datasets
from train import experiment as experiment_lib
from train import fileio
from train import input_pipeline
from train import metrics as metrics_lib
from train import optim
from train import plots
from train import steps
from train.errors import NonFiniteLossError, Preempted

FINAL_METRICS = 'final_metrics.json'


class _SigtermFlag:
  """Records SIGTERM instead of dying, so the loop can save first."""

  def __init__(self):
    self.event = threading.Event()

  @contextlib.contextmanager
  def installed(self):
    if (threading.current_thread() is not threading.main_thread()
        or jax.process_count() > 1):
      # Signals can only be handled on the main thread. With several
      # processes, jax.distributed's preemption notifier owns SIGTERM (a
      # Python handler would take it away) and `requested` asks it.
      yield self
      return
    previous = signal.signal(signal.SIGTERM, lambda *_: self.event.set())
    try:
      yield self
    finally:
      signal.signal(signal.SIGTERM, previous)

  def requested(self, step: int) -> bool:
    if jax.process_count() > 1:
      # All processes must agree on the step at which to save.
      return multihost_utils.reached_preemption_sync_point(step)
    return self.event.is_set()


class CompiledSteps(NamedTuple):
  """The compiled steps of a run.

  Attributes:
    variants: train steps `(state, batch) -> (state, metrics)` (donating
      the state), keyed by the `sam_step` they were traced with (None: the
      only one).
    choose: `(step, opt_state) -> key of variants`, or None for the only one.
    eval: `(state, batch) -> sums of loss, correct, count`.
    state_is_finite: `state -> bool scalar`.
    data_on_device: whether the training split lives on the devices; then
      train steps take batches of indices ({'index': int32}).
  """
  variants: dict[bool | None, Any]
  choose: Any
  eval: Any
  state_is_finite: Any
  data_on_device: bool

  def train(self, state, batch, step: int):
    """One update; `step` is the state's step count (known on the host)."""
    key = None if self.choose is None else self.choose(step, state.opt_state)
    return self.variants[key](state, batch)


def compile_steps(exp: experiment_lib.Experiment,
                  train_data: datasets.ArraySplit) -> CompiledSteps:
  """AOT-compiles the train and eval steps; logs their memory statistics.

  When `train_data` fits in `config.device_data_max_mb` per device, it is
  placed (replicated) on the devices once and the train step gathers each
  batch there; the host then sends indices only, which is what keeps the
  trainer within a few percent of a bare loop on small data sets. When
  SAM has plain steps (warm-up, window, warm restarts), a SAM and a plain
  variant are compiled and the host picks one per step
  (`optim.sam_step_chooser`).
  """
  config = exp.config
  repl = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  sam_cfg = config.optimizer.get('sam')
  m_sharpness = bool(sam_cfg and sam_cfg.enabled and sam_cfg.m_sharpness)
  choose = optim.sam_step_chooser(config.optimizer)
  on_device = input_pipeline.fits_on_devices(train_data,
                                             config.device_data_max_mb)
  resident = (input_pipeline.put_replicated(train_data, repl) if on_device
              else None)
  sharding_of = steps.metric_shardings(exp.batch_sharding, repl)

  def compile_train(sam_step):
    train_fn = steps.make_train_step(
        exp.model, exp.tx, config.nonfinite, config.log_every,
        diagnostics=optim.method_diagnostics(config.optimizer),
        local_axis=optim.M_SHARPNESS_AXIS if m_sharpness else None,
        mesh=exp.mesh, sam_step=sam_step,
        # Pallas's interpreter (CPU) rejects device-varying operands.
        check_vma=not (m_sharpness and sam_cfg.fused
                       and jax.default_backend() == 'cpu'))
    metric_names = jax.eval_shape(
        train_fn, exp.abstract_state,
        exp.abstract_batch(config.batch_size))[1]
    out_shardings = (exp.state_shardings,
                     {name: sharding_of(name) for name in metric_names})
    if not on_device:
      compiled = jax.jit(
          train_fn, in_shardings=(exp.state_shardings, exp.batch_sharding),
          out_shardings=out_shardings, donate_argnums=(0,)).lower(
              exp.abstract_state,
              exp.abstract_batch(config.batch_size)).compile()
      return compiled, compiled
    compiled = jax.jit(
        lambda state, data, batch: train_fn(
            state, input_pipeline.gather(data, batch['index'])),
        in_shardings=(exp.state_shardings, repl, exp.batch_sharding),
        out_shardings=out_shardings, donate_argnums=(0,)).lower(
            exp.abstract_state, resident,
            exp.abstract_index_batch(config.batch_size)).compile()
    return compiled, functools.partial(
        lambda c, data, state, batch: c(state, data, batch), compiled,
        resident)

  keys = (None,) if choose is None else (True, False)
  compiled_variants = {k: compile_train(k) for k in keys}
  compiled_eval, compiled_finite = compile_eval_and_finite(exp)
  logging.info('Training data on the devices: %s (%.2f MiB per device)',
               on_device,
               (train_data.images.nbytes + train_data.labels.nbytes) / 2**20)
  for key, (compiled, _) in compiled_variants.items():
    name = 'train_step' + ('' if key is None else
                           ' (SAM)' if key else ' (plain)')
    log_memory_stats(name, compiled)
  log_memory_stats('eval_step', compiled_eval)
  return CompiledSteps({k: fn for k, (_, fn) in compiled_variants.items()},
                       choose, compiled_eval, compiled_finite, on_device)


def compile_eval_and_finite(exp, per_example: steps.PerExample | None = None
                            ) -> tuple[Any, Any]:
  """The compiled eval step (sums over a masked batch) and the finiteness
  check that guards every checkpoint (compiled here, so a save never waits
  for it). `exp` is any experiment with shardings and abstract batches."""
  repl = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
  compiled_eval = jax.jit(
      steps.make_eval_step(exp.model, per_example),
      in_shardings=(exp.state_shardings, exp.batch_sharding),
      out_shardings=repl).lower(
          exp.abstract_state,
          exp.abstract_batch(exp.config.eval_batch_size,
                             with_mask=True)).compile()
  compiled_finite = jax.jit(
      steps.state_is_finite, in_shardings=(exp.state_shardings,),
      out_shardings=repl).lower(exp.abstract_state).compile()
  return compiled_eval, compiled_finite


def log_memory_stats(name: str, compiled: Any) -> dict[str, int]:
  stats = compiled.memory_analysis()
  if stats is None:
    logging.info('%s: no memory statistics on this backend', name)
    return {}
  fields = ('argument_size_in_bytes', 'output_size_in_bytes',
            'alias_size_in_bytes', 'temp_size_in_bytes',
            'generated_code_size_in_bytes')
  values = {f: int(getattr(stats, f, 0)) for f in fields}
  logging.info('%s compiled (per device): %s', name, ', '.join(
      f'{f.removesuffix("_size_in_bytes")} {v / 2**20:.2f} MiB'
      for f, v in values.items()))
  return values


def evaluate(exp: experiment_lib.Experiment, compiled_eval: Any,
             state: steps.TrainState, data: datasets.ArraySplit,
             prefix: str) -> dict[str, float]:
  totals = None
  batches = input_pipeline.eval_batches(
      data, exp.config.eval_batch_size, jax.process_index(),
      jax.process_count())
  for batch in batches:
    out = compiled_eval(state, input_pipeline.to_global(
        batch, exp.batch_sharding))
    totals = out if totals is None else jax.tree.map(
        lambda a, b: a + b, totals, out)
  totals = jax.device_get(totals)
  count = float(totals['count'])
  return {f'{prefix}_loss': float(totals['loss_sum']) / count,
          f'{prefix}_accuracy': float(totals['correct']) / count}


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains, evaluates and checkpoints into `workdir`; returns the final metrics.

  Raises:
    UsageError: a setting is invalid (before anything is compiled).
    NonFiniteLossError: a non-finite loss with `config.nonfinite='stop'`.
    Preempted: SIGTERM arrived; a checkpoint was saved first.
  """
  exp = experiment_lib.build(config, workdir)
  workdir = exp.workdir
  final_path = fileio.join(workdir, FINAL_METRICS)
  # Leaving the block waits for in-flight saves, also when an error stops
  # the run, so the last checkpoint it reports is on disk.
  with checkpointing.Checkpoints(
      workdir, every_steps=config.checkpoint_every,
      keep=config.keep_checkpoints) as ckpts:
    latest = ckpts.latest_step()
    if (latest is not None and latest >= config.num_steps
        and fileio.exists(final_path)):
      logging.info('The run in %s is complete (step %d)', workdir, latest)
      return metrics_lib.read_json(final_path)
    if latest is None:
      state = exp.init_state()
      logging.info('Initialised a new run in %s', workdir)
    else:
      state, _ = ckpts.restore(latest, exp.abstract_state)
      logging.info('Resumed from the checkpoint at step %d', latest)

    train_data, val_data = (
        datasets.load_split(config.dataset, split, config.data_dir)
        for split in ('train', 'validation'))
    compiled = compile_steps(exp, train_data)
    with contextlib.closing(metrics_lib.MetricWriter(
        workdir, resume_step=latest)) as writer:
      state = train_loop(exp, state, compiled, train_data, val_data, ckpts,
                         writer, latest)
      test_data = datasets.load_split(config.dataset, 'test', config.data_dir)
      final = {'step': config.num_steps}
      final.update(evaluate(exp, compiled.eval, state, val_data, 'val'))
      final.update(evaluate(exp, compiled.eval, state, test_data, 'test'))
      writer.write(config.num_steps,
                   {k: v for k, v in final.items() if k != 'step'})
  if jax.process_index() == 0:
    metrics_lib.write_json_atomic(final_path, final)
    plots.plot_curves(writer.path, fileio.join(workdir, 'curves.png'))
  return final


def train_loop(exp: experiment_lib.Experiment, state: steps.TrainState,
               compiled: CompiledSteps, train_data: datasets.ArraySplit,
               val_data: datasets.ArraySplit,
               ckpts: checkpointing.Checkpoints,
               writer: metrics_lib.MetricWriter,
               last_saved: int | None) -> steps.TrainState:
  """Trains from `state.step` to `config.num_steps`: data, logging, eval, saves.

  `last_saved` is the step of the latest checkpoint on disk (for messages).
  Metrics of the steps since the last log line stay on the devices until
  the next log line or save, where the host reduces them and checks their
  losses: with `nonfinite='stop'` a non-finite loss ends the run there,
  naming its step, before anything after it is saved.
  """
  config = exp.config
  start, total = int(jax.device_get(state.step)), config.num_steps
  batches = input_pipeline.TrainBatches(
      train_data, config.batch_size, config.seed, jax.process_index(),
      jax.process_count())
  meta = {'config': config.to_json_best_effort()}
  progress = metrics_lib.Progress(start, total)
  pending, pending_from = [], start
  sigterm = _SigtermFlag()
  device_batches = input_pipeline.to_devices(
      batches.iterate(start, total, indices_only=compiled.data_on_device),
      exp.batch_sharding)
  with sigterm.installed(), contextlib.closing(device_batches):
    for step in range(start + 1, total + 1):
      state, step_metrics = compiled.train(state, next(device_batches),
                                           step - 1)
      pending.append(step_metrics)
      preempted = sigterm.requested(step)
      is_last = step == total
      log_now = step % config.log_every == 0 or is_last or preempted
      save_now = ckpts.should_save(step) or is_last or preempted
      if log_now or save_now:
        scalars, first_bad = steps.summarize(
            pending, pending_from,
            grad_norm_sampled=step % config.log_every == 0)
        if first_bad is not None and config.nonfinite == 'stop':
          raise NonFiniteLossError(first_bad, last_saved)
      if log_now:
        scalars['learning_rate'] = float(exp.learning_rate(step - 1))
        if config.nonfinite == 'skip':
          scalars['skipped_steps'] = float(jax.device_get(state.skipped_steps))
        writer.write(step, scalars)
        metrics_lib.log_progress(step, total, scalars, *progress.update(step))
        pending, pending_from = [], step
      if step % config.eval_every == 0 and not is_last:
        val = evaluate(exp, compiled.eval, state, val_data, 'val')
        writer.write(step, val)
        logging.info('step %d: %s', step, val)
      if save_now:
        if not bool(compiled.state_is_finite(state)):
          raise NonFiniteLossError(step, last_saved, 'train state')
        if ckpts.save(step, state, meta, force=is_last or preempted):
          last_saved = step
      if preempted:
        raise Preempted(step)
  return state
