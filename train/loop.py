"""The training loop every product shares: `train_and_evaluate(exp, load_data)`.

The flow: restore the latest checkpoint or initialise sharded state ->
compile the steps ahead of time (`train.aot`, memory statistics logged) ->
train, logging every `log_every` steps, evaluating the validation split
every `eval_every` steps and checkpointing every `checkpoint_every` steps
-> evaluate the final splits once -> `final_metrics.json` and a PNG of
the curves. A product (`train.vision.trainer`, `train.lm.trainer`) builds
the `train.experiment.Experiment` and says where its data comes from;
everything else is here, method-agnostic: a method reaches the loop only
through `exp.hooks` (`geom.method_hooks.MethodHooks`).

Guarantees of a workdir:
- One run at a time: the run holds an OS lock on the workdir
  (`train.workdir_lock`) before it reads or writes anything there; a
  second launch ends at once naming the holder. The kernel drops the lock
  when its holder dies, kill -9 included.
- Resume: running the command again restores the latest checkpoint, data
  position included (batch k is a pure function of the seed and k), and
  ends with parameters equal, bit for bit, to an uninterrupted run's.
  The saved config is compared with the new one first
  (`train.resume_check`): a change to a field that fixes the run is
  refused before any compute. Lines of `metrics.jsonl` written after that
  checkpoint, or torn by a crash, are dropped. A finished run returns its
  final metrics and trains nothing.
- Verified checkpoints: each carries fingerprints of its arrays, checked
  on restore; one that does not load or verify is moved aside with a
  warning and the one before it is used (`train.checkpointing`).
- Preemption: SIGTERM or SIGINT (or, with several processes, JAX's
  preemption sync point) saves a checkpoint at the current step and raises
  `Preempted`.
- Non-finite values: with `nonfinite='stop'` a non-finite loss ends the
  run, naming its step, before anything after it is saved; every
  checkpoint is checked finite first. `'skip'` skips such updates; the
  JSON files hold such values as null.
- A full disk ends the run with `DiskFull` (the path, the space needed and
  left); the checkpoints written before stay valid.

Loops whose step differs (test-time adaptation, RL) reuse the parts:
`workdir_lock.hold`, `checkpointing.Checkpoints` (with
`restore_latest_good` and `resume_check.check`), `metrics.MetricWriter`,
`preemption.StopFlag`, `disk_space.reported`,
`aot.log_memory_stats`.
"""

from collections.abc import Callable, Mapping
import contextlib
import dataclasses
import functools

from absl import logging
import jax

from train import aot
from train import checkpointing
from train import disk_space
from train import experiment as experiment_lib
from train import fileio
from train import input_pipeline
from train import metrics as metrics_lib
from train import plots
from train import preemption
from train import resume_check
from train import steps
from train import workdir_lock
from train.errors import NonFiniteLossError, Preempted

FINAL_METRICS = 'final_metrics.json'
# In a checkpoint's metadata: the records metrics.jsonl held when it was
# saved, and the [loss, accuracy] of the steps since the last log line.
METRICS_RECORDS = 'metrics_records'
INTERVAL_MEANS = 'interval_means'


@dataclasses.dataclass(frozen=True)
class Data:
  """The splits a run reads.

  Attributes:
    train: the training split (batches drawn by step number).
    validation: evaluated every `eval_every` steps as `val_*`.
    final: `() -> {prefix: split}`, evaluated once at the end (loaded only
      then), e.g. {'val': ..., 'test': ...}; metrics are `<prefix>_loss`
      and `<prefix>_accuracy`, in this order.
    fingerprints: {name: fingerprint} of files the data depends on beyond
      the config (a trained tokenizer); saved with every checkpoint, and a
      resume with other ones is refused (`resume_check.check_fingerprints`).
  """
  train: input_pipeline.Split
  validation: input_pipeline.Split
  final: Callable[[], Mapping[str, input_pipeline.Split]]
  fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)


def evaluate(exp: experiment_lib.Experiment, compiled_eval: aot.EvalFn,
             state: steps.TrainState, data: input_pipeline.Split,
             prefix: str) -> dict[str, float]:
  """Mean loss and accuracy over every example of `data`, once each."""
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


def train_and_evaluate(exp: experiment_lib.Experiment,
                       load_data: Callable[[], Data],
                       initial_variables: Callable[[], dict] | None = None
                       ) -> dict[str, float]:
  """Trains, evaluates and checkpoints into `exp.workdir`; returns final metrics.

  Args:
    exp: the built experiment.
    load_data: gives the splits; not called for a finished run.
    initial_variables: for a new run, gives the variables to start from
      (e.g. another run's, `config.init_from`) instead of `config.seed`'s
      initialisation; not called when the run resumes or is finished.

  Raises:
    WorkdirBusy: another run holds the workdir.
    ConfigChanged: the workdir holds a run with a different config.
    NoGoodCheckpoint: checkpoints exist and none loads and verifies.
    NonFiniteLossError: a non-finite loss with `config.nonfinite='stop'`.
    DiskFull: a write ran out of space (earlier checkpoints are intact).
    Preempted: SIGTERM or SIGINT arrived; a checkpoint was saved first.
  """
  with disk_space.reported(
      exp.workdir, disk_space.tree_bytes(exp.abstract_state),
      fileio.join(exp.workdir, checkpointing.CHECKPOINTS)):
    return _train_and_evaluate(exp, load_data, initial_variables)


def _train_and_evaluate(exp: experiment_lib.Experiment,
                        load_data: Callable[[], Data],
                        initial_variables: Callable[[], dict] | None
                        ) -> dict[str, float]:
  config, workdir = exp.config, exp.workdir
  final_path = fileio.join(workdir, FINAL_METRICS)
  check_config = functools.partial(
      resume_check.check, config, workdir,
      per_device_method=exp.hooks.per_device_axis is not None)
  # The lock comes first: nothing in the workdir is read or written before
  # this process owns it. Leaving the checkpoints' block waits for
  # in-flight saves, also when an error stops the run, so the last
  # checkpoint it reports is on disk.
  with workdir_lock.hold(workdir):
    with checkpointing.Checkpoints(
        workdir, every_steps=config.checkpoint_every,
        keep=config.keep_checkpoints) as ckpts:
      finished = _finished_result(ckpts, final_path, check_config,
                                  config.num_steps)
      if finished is not None:
        logging.info('The run in %s is complete (step %d)', workdir,
                     finished['step'])
        return finished
      # Read before anything is computed: a damaged data file ends the run
      # here, with one line.
      data = load_data()

      def check_meta(step: int, meta: dict) -> None:
        check_config(step, meta)
        resume_check.check_fingerprints(workdir, step, meta,
                                        data.fingerprints)

      found = ckpts.restore_latest_good(exp.abstract_state,
                                        check_meta=check_meta)
      if found is None:
        latest, meta = None, {}
        state = exp.init_state(None if initial_variables is None
                               else initial_variables())
        logging.info('Initialised a new run in %s%s', workdir,
                     '' if initial_variables is None else
                     f' from {config.get("init_from")}')
      else:
        latest, state, meta = found
        logging.info('Resumed from the checkpoint at step %d', latest)

      compiled = aot.compile_steps(exp, data.train)
      with contextlib.closing(metrics_lib.MetricWriter(
          workdir, resume_step=latest,
          keep_records=meta.get(METRICS_RECORDS))) as writer:
        state = train_loop(exp, state, compiled, data.train, data.validation,
                           ckpts, writer, latest,
                           carried=meta.get(INTERVAL_MEANS, []),
                           fingerprints=data.fingerprints)
        final = {'step': config.num_steps}
        for prefix, split in data.final().items():
          final.update(evaluate(exp, compiled.eval, state, split, prefix))
        writer.write(config.num_steps,
                     {k: v for k, v in final.items() if k != 'step'})
    if jax.process_index() == 0:
      metrics_lib.write_json_atomic(final_path, final)
      plots.plot_curves(writer.path, fileio.join(workdir, 'curves.png'))
  return final


def _finished_result(ckpts: checkpointing.Checkpoints, final_path: str,
                     check_config: Callable[[int, dict], None],
                     num_steps: int) -> dict[str, float] | None:
  """A finished run's final metrics, after checking the config against the
  latest checkpoint's; None if the run is not finished or its final metrics
  are unreadable (the run then restores and evaluates again)."""
  latest = ckpts.latest_step()
  if latest is None or latest < num_steps or not fileio.exists(final_path):
    return None
  try:
    meta = ckpts.restore_meta(latest)
  except checkpointing.DamagedCheckpoint:
    return None  # restore_latest_good reports it and falls back.
  check_config(latest, meta)
  if latest != num_steps:
    return None
  try:
    return metrics_lib.read_json(final_path)
  except ValueError as e:
    logging.warning('%s is unreadable (%s); evaluating the final '
                    'checkpoint again', final_path, e)
    return None


def train_loop(exp: experiment_lib.Experiment, state: steps.TrainState,
               compiled: aot.CompiledSteps, train_data: input_pipeline.Split,
               val_data: input_pipeline.Split,
               ckpts: checkpointing.Checkpoints,
               writer: metrics_lib.MetricWriter,
               last_saved: int | None,
               carried: list[list[float]] | None = None,
               fingerprints: Mapping[str, str] | None = None
               ) -> steps.TrainState:
  """Trains from `state.step` to `config.num_steps`: data, logging, eval, saves.

  `last_saved` is the step of the latest checkpoint on disk (for messages);
  `carried`, what it saved of the log interval it fell in (see
  `steps.summarize`); `fingerprints` go into every checkpoint's metadata.
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
  config_json = resume_check.as_json(config)
  progress = metrics_lib.Progress(start, total)
  console = tuple(steps.DIAGNOSTICS_PREFIX + k for k in exp.hooks.console)
  # The interval since the last log line: per-step metrics still on the
  # devices (`pending`, from step `pending_from`), and host means of its
  # steps before the last checkpoint (`carried`, saved with it).
  pending, pending_from, carried = [], start, list(carried or [])
  stop = preemption.StopFlag()
  device_batches = input_pipeline.to_devices(
      batches.iterate(start, total, indices_only=compiled.data_on_device),
      exp.batch_sharding)
  with stop.installed(), contextlib.closing(device_batches):
    for step in range(start + 1, total + 1):
      state, step_metrics = compiled.train(state, next(device_batches),
                                           step - 1)
      pending.append(step_metrics)
      preempted = stop.requested(step)
      is_last = step == total
      # A stop saves without a log line of its own, so that a resumed run
      # logs the lines of an uninterrupted one.
      log_now = step % config.log_every == 0 or is_last
      save_now = ckpts.should_save(step) or is_last or preempted
      if log_now or save_now:
        scalars, first_bad, means = steps.summarize(
            pending, pending_from,
            grad_norm_logged=step % config.log_every == 0, carried=carried)
        if first_bad is not None and config.nonfinite == 'stop':
          raise NonFiniteLossError(first_bad, last_saved)
        carried, pending, pending_from = carried + means, [], step
      if log_now:
        scalars['learning_rate'] = float(exp.learning_rate(step - 1))
        if config.nonfinite == 'skip':
          scalars['skipped_steps'] = float(jax.device_get(state.skipped_steps))
        writer.write(step, scalars)
        metrics_lib.log_progress(step, total, scalars, *progress.update(step),
                                 console=console)
        carried = []
      if step % config.eval_every == 0 and not is_last:
        val = evaluate(exp, compiled.eval, state, val_data, 'val')
        writer.write(step, val)
        logging.info('step %d: %s', step, val)
      if save_now:
        if not bool(compiled.state_is_finite(state)):
          raise NonFiniteLossError(step, last_saved, 'train state',
                                   skipping=config.nonfinite == 'skip')
        meta = {'config': config_json, METRICS_RECORDS: writer.records,
                INTERVAL_MEANS: carried,
                resume_check.FINGERPRINTS: dict(fingerprints or {})}
        if ckpts.save(step, state, meta, force=is_last or preempted):
          last_saved = step
      if preempted:
        raise Preempted(step, stop.signal_name)
  return state
