"""The training loop every product shares: `train_and_evaluate(exp, load_data)`.

The flow: restore the latest checkpoint or initialise sharded state ->
compile the steps ahead of time (`train.training.aot`, memory statistics logged) ->
train, logging every `log_every` steps, evaluating the validation split
every `eval_every` steps and checkpointing every `checkpoint_every` steps
-> evaluate the final splits once -> `final_metrics.json` and a PNG of
the curves. A product (`train.vision.trainer`, `train.lm.trainer`) builds
the `train.training.experiment.Experiment` and says where its data comes from;
everything else is here, method-agnostic: a method reaches the loop only
through `exp.hooks` (`geom.method_hooks.MethodHooks`).

The workdir's guarantees (one run at a time, config checked on resume,
verified checkpoints, bit-exact resume, preemption, a full disk in one
line, non-finite state never saved) are `train.run.resumable`'s, which the
test-time adaptation and RL loops share. What is this loop's own:
- Resume: batch k is a pure function of the seed and k, so a resumed run
  ends with parameters equal, bit for bit, to an uninterrupted run's; the
  log interval a checkpoint fell in is saved with it, so that a resumed
  run logs the lines of an uninterrupted one.
- Non-finite values: with `nonfinite='stop'` a non-finite loss ends the
  run, naming its step, before anything after it is saved. `'skip'` skips
  such updates; the JSON files hold such values as null.
"""

from collections.abc import Callable, Mapping
import contextlib
import dataclasses
import functools

from absl import logging
import jax

from train.training import aot
from train.run import disk_space
from train.training import experiment as experiment_lib
from train import fileio
from train.training import input_pipeline
from train.run import metrics as metrics_lib
from train.analysis import plots
from train.run import resumable
from train.run import resume_check
from train.training import steps

FINAL_METRICS = 'final_metrics.json'
# In a checkpoint's metadata: the [loss, accuracy] of the steps since the
# last log line.
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
                       initial_variables: Callable[[], dict] | None = None,
                       inputs: Mapping[str, str] | None = None
                       ) -> dict[str, float]:
  """Trains, evaluates and checkpoints into `exp.workdir`; returns final metrics.

  Args:
    exp: the built experiment.
    load_data: gives the splits; not called for a finished run.
    initial_variables: for a new run, gives the variables to start from
      (e.g. another run's, `config.init_from`) instead of `config.seed`'s
      initialisation; not called when the run resumes or is finished.
    inputs: {name: fingerprint} of files the run starts from (a
      pretrained model's), pinned before anything else: a resume, or a
      rerun of a finished run, with other ones is refused.

  Raises:
    WorkdirBusy: another run holds the workdir.
    ConfigChanged: the workdir holds a run with a different config.
    NoGoodCheckpoint: checkpoints exist and none loads and verifies.
    NonFiniteLossError: a non-finite loss with `config.nonfinite='stop'`.
    DiskFull: a write ran out of space (earlier checkpoints are intact).
    Preempted: SIGTERM or SIGINT arrived; a checkpoint was saved first.
  """
  config, workdir = exp.config, exp.workdir
  check_config = functools.partial(
      resume_check.check, config, workdir,
      per_device_method=exp.hooks.per_device_axis is not None)
  with resumable.open_run(
      config, workdir, check_config=check_config, results_name=FINAL_METRICS,
      needed_bytes=disk_space.tree_bytes(exp.abstract_state)) as run:
    run.pin(inputs or {})
    finished = run.finished(config.num_steps)
    if finished is not None:
      return finished
    # Read before anything is computed: a damaged data file ends the run
    # here, with one line.
    data = load_data()
    run.pin(data.fingerprints)
    found = run.restore(exp.abstract_state)
    if found is None:
      meta = {}
      state = exp.init_state(None if initial_variables is None
                             else initial_variables())
      if initial_variables is not None:
        logging.info('Initialised from %s', config.get('init_from'))
    else:
      _, state, meta = found
    compiled = aot.compile_steps(exp, data.train)
    state = train_loop(exp, state, compiled, data.train, data.validation,
                       run, carried=meta.get(INTERVAL_MEANS, []))
    final = {'step': config.num_steps}
    for prefix, split in data.final().items():
      final.update(evaluate(exp, compiled.eval, state, split, prefix))
    run.writer.write(config.num_steps,
                     {k: v for k, v in final.items() if k != 'step'})
    run.finish(final)
    if jax.process_index() == 0:
      plots.plot_curves(run.writer.path, fileio.join(workdir, 'curves.png'))
  return final


def train_loop(exp: experiment_lib.Experiment, state: steps.TrainState,
               compiled: aot.CompiledSteps, train_data: input_pipeline.Split,
               val_data: input_pipeline.Split, run: resumable.Run,
               carried: list[list[float]] | None = None
               ) -> steps.TrainState:
  """Trains from `state.step` to `run.total`: data, logging, eval, saves.

  `carried` is what the checkpoint saved of the log interval it fell in
  (see `steps.summarize`). Metrics of the steps since the last log line
  stay on the devices until the next log line or save, where the host
  reduces them and checks their losses: with `nonfinite='stop'` a
  non-finite loss ends the run there, naming its step, before anything
  after it is saved.
  """
  config = exp.config
  start, total = int(jax.device_get(state.step)), run.total
  batches = input_pipeline.TrainBatches(
      train_data, config.batch_size, config.seed, jax.process_index(),
      jax.process_count())
  progress = metrics_lib.Progress(start, total)
  console = tuple(steps.DIAGNOSTICS_PREFIX + k for k in exp.hooks.console)
  run.finite = resumable.Finite(compiled.state_is_finite, 'train state',
                                skipping=config.nonfinite == 'skip')
  # The interval since the last log line: per-step metrics still on the
  # devices (`pending`, from step `pending_from`), and host means of its
  # steps before the last checkpoint (`carried`, saved with it).
  pending, pending_from, carried = [], start, list(carried or [])
  device_batches = input_pipeline.to_devices(
      batches.iterate(start, total, indices_only=compiled.data_on_device),
      exp.batch_sharding)
  with run.stopping(), contextlib.closing(device_batches):
    for step in range(start + 1, total + 1):
      state, step_metrics = compiled.train(state, next(device_batches),
                                           step - 1)
      pending.append(step_metrics)
      # A stop saves without a log line of its own, so that a resumed run
      # logs the lines of an uninterrupted one.
      log_now = step % config.log_every == 0 or step == total
      if log_now or run.checkpoint_due(step):
        scalars, first_bad, means = steps.summarize(
            pending, pending_from,
            grad_norm_logged=step % config.log_every == 0, carried=carried)
        if first_bad is not None and config.nonfinite == 'stop':
          run.stop_nonfinite(first_bad)
        carried, pending, pending_from = carried + means, [], step
      if log_now:
        scalars['learning_rate'] = float(exp.learning_rate(step - 1))
        if config.nonfinite == 'skip':
          scalars['skipped_steps'] = float(jax.device_get(state.skipped_steps))
        run.writer.write(step, scalars)
        metrics_lib.log_progress(step, total, scalars, *progress.update(step),
                                 console=console)
        carried = []
      if step % config.eval_every == 0 and step != total:
        val = evaluate(exp, compiled.eval, state, val_data, 'val')
        run.writer.write(step, val)
        logging.info('step %d: %s', step, val)
      run.end_step(step, lambda: (state, {INTERVAL_MEANS: carried}))
  return state
