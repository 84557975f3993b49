"""One resumable run in a workdir: all of a loop that is not its step or data.

The image/LM trainer (`train.training.loop`), test-time adaptation
(`train.tta.adapt`) and RL (`train.rl.run`) hold their workdir through
`open_run`, and keep only their step and their data. The run gives each:

- One run at a time: an OS lock on the workdir (`train.run.workdir_lock`),
  taken before anything there is read or written; a second launch ends
  at once naming the holder.
- The config compared with the newest checkpoint's before anything is
  loaded (`check_config`, e.g. `resume_check.check`): a change to a field
  that fixes the run is refused in one line.
- Inputs pinned by content (`pin`: a source model, a policy, a
  tokenizer): their fingerprints go into every checkpoint, and a resume
  or a rerun of a finished run with other ones is refused
  (`resume_check.check_fingerprints`).
- A finished run returns its results without loading anything more
  (`finished`).
- Restore of the newest checkpoint that loads and verifies; damaged ones
  are moved aside (`checkpointing.Checkpoints.restore_latest_good`), and
  `metrics.jsonl` is cut back to the records that checkpoint saw.
- Saves every `config.checkpoint_every` steps and at the last one, each
  after a finiteness check of the state (`Finite`): nothing non-finite is
  saved.
- SIGTERM or SIGINT (with several processes, JAX's preemption sync point)
  saves at the current step and raises `Preempted`.
- A full disk ends the run with `DiskFull` in one line; the checkpoints
  written before stay valid.
- The results written atomically at the end, which is what makes a run
  finished.

Example::

  with resumable.open_run(config, workdir, check_config=check,
                          results_name='results.json') as run:
    run.pin({'config.source_workdir': source_digest})
    done = run.finished(total=num_steps)
    if done is not None:
      return done
    found = run.restore(abstract_state)
    step, state = (0, init()) if found is None else found[:2]
    with run.stopping():
      for step in range(step + 1, num_steps + 1):
        state = train_step(state)
        run.writer.write(step, metrics)
        run.end_step(step, lambda: (state, {}))
    return run.finish(results)
"""

from collections.abc import Callable, Iterator, Mapping
import contextlib
import dataclasses
from typing import Any

from absl import logging
import ml_collections

from train import fileio
from train.errors import NonFiniteLossError
from train.run import checkpointing
from train.run import disk_space
from train.run import metrics as metrics_lib
from train.run import results_file
from train.run import resume_check
from train.run import save_cadence
from train.run import workdir_lock

# In a checkpoint's metadata: the records metrics.jsonl held when it was
# saved.
METRICS_RECORDS = 'metrics_records'

# (step, saved metadata) -> None, or raises (e.g. ConfigChanged).
CheckConfig = Callable[[int, Mapping[str, Any]], None]
# () -> (the tree to save, the loop's metadata); called only to save.
Checkpoint = Callable[[], tuple[Any, Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Finite:
  """The check a loop's state passes before each save.

  Attributes:
    is_finite: checkpoint tree -> whether it is finite (a bool or a
      scalar array; a jitted function, since it runs before every save).
    what: what is checked, for the error ('train state').
    skipping: the loop already skips non-finite updates (the error's
      advice then is only to lower the learning rate).
    can_skip: the loop has a setting to skip such updates.
  """
  is_finite: Callable[[Any], Any]
  what: str
  skipping: bool = False
  can_skip: bool = True


class Run:
  """A workdir held by this process; see the module docstring.

  Built by `open_run`. A loop calls, in order: `pin` (optional),
  `finished`, `restore`, then per step `end_step` under `stopping()`, and
  `finish`.

  Attributes:
    total: the step the run ends at (given to `finished`).
    writer: `metrics.jsonl` and TensorBoard, opened by `restore`.
    last_saved: the step of the newest checkpoint on disk (for messages).
    finite: the check before each save, or None.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               ckpts: checkpointing.Checkpoints, check_config: CheckConfig,
               results_name: str):
    self.config = config
    self.workdir = workdir
    self.total: int | None = None
    self.writer: metrics_lib.MetricWriter | None = None
    self.last_saved: int | None = None
    self.finite: Finite | None = None
    self._ckpts = ckpts
    self._check_config = check_config
    self._results_path = fileio.join(workdir, results_name)
    self._inputs: dict[str, str] = {}
    self._config_json = resume_check.as_json(config)
    self._cadence = save_cadence.SaveCadence(ckpts.should_save)

  def pin(self, inputs: Mapping[str, str]) -> None:
    """Pins inputs by content: {name: fingerprint}, e.g.
    {'config.source_workdir': checksums.digest(params)}; checked by
    `finished` and `restore`, saved with every checkpoint."""
    self._inputs.update(inputs)

  def _check_meta(self, step: int, meta: Mapping[str, Any]) -> None:
    self._check_config(step, meta)
    resume_check.check_fingerprints(self.workdir, step, meta, self._inputs)

  def finished(self, total: int) -> dict[str, Any] | None:
    """The results of a run that ended at step `total`, or None
    (`results_file.read_if_finished`: nothing else is loaded)."""
    self.total = total
    return results_file.read_if_finished(
        self._ckpts, self._results_path, self.workdir, total,
        self._check_meta)

  def restore(self, abstract: Any
              ) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, tree, metadata) of the newest good checkpoint, or None.

    `abstract` is the checkpoint tree's structure (ShapeDtypeStructs with
    shardings). Opens `writer`: a new run's metrics file starts empty; a
    resumed one keeps the records its checkpoint saw.

    Raises:
      ConfigChanged, or UsageError from `check_config`; a pinned input
        that changed.
      NoGoodCheckpoint: checkpoints exist and none loads and verifies.
    """
    if self.total is None:
      raise RuntimeError('Run.finished(total) comes before restore')
    found = self._ckpts.restore_latest_good(abstract,
                                            check_meta=self._check_meta)
    if found is None:
      self.writer = metrics_lib.MetricWriter(self.workdir, None)
      logging.info('Starting a new run in %s', self.workdir)
      return None
    step, tree, meta = found
    self.last_saved = step
    self.writer = metrics_lib.MetricWriter(
        self.workdir, resume_step=step, keep_records=meta.get(METRICS_RECORDS))
    logging.info('Resumed from the checkpoint at step %d of %d in %s', step,
                 self.total, self.workdir)
    return step, tree, meta

  def request_stop(self, signal_name: str) -> None:
    """Stops as SIGTERM or SIGINT would (`signal_name`): for a stop that
    another process of the job received."""
    self._cadence.request_stop(signal_name)

  def stopping(self) -> contextlib.AbstractContextManager[None]:
    """Inside the block, SIGTERM and SIGINT request a stop at the end of
    the current step (see `train.run.preemption`)."""
    return self._cadence.installed()

  def checkpoint_due(self, step: int) -> bool:
    """Whether `step` ends with a save (`SaveCadence.due`)."""
    return self._cadence.due(step, self.total)

  def stop_nonfinite(self, step: int, what: str = 'loss',
                     skipping: bool = False, can_skip: bool = True):
    """Raises `NonFiniteLossError` for `step`, before anything after the
    last save is saved."""
    raise NonFiniteLossError(step, self.last_saved, what, skipping=skipping,
                             can_skip=can_skip)

  def end_step(self, step: int, checkpoint: Checkpoint) -> None:
    """Saves if `checkpoint_due(step)`, and stops if asked to.

    Args:
      step: the step just completed (1-based: the number of steps done).
      checkpoint: gives (tree, the loop's metadata), called only to save.

    Raises:
      NonFiniteLossError: the tree fails `finite` (nothing is saved).
      DiskFull: too little room for the checkpoint.
      Preempted: a stop was requested before the last step (after the
        save).
    """
    if self.checkpoint_due(step):
      self._save(step, checkpoint,
                 force=self._cadence.forced(step, self.total))
    if self._cadence.stops_after(step, self.total):
      self._ckpts.wait_until_finished()
      self.writer.flush()
      raise self._cadence.preempted(step)

  def _save(self, step: int, checkpoint: Checkpoint, force: bool) -> None:
    tree, extra = checkpoint()
    if self.finite is not None and not bool(self.finite.is_finite(tree)):
      self.stop_nonfinite(step, self.finite.what, self.finite.skipping,
                          self.finite.can_skip)
    meta = {'config': self._config_json, METRICS_RECORDS: self.writer.records,
            resume_check.FINGERPRINTS: dict(self._inputs), **extra}
    if self._ckpts.save(step, tree, meta, force=force):
      self.last_saved = step

  def finish(self, results: Mapping[str, Any],
             checkpoint: Checkpoint | None = None) -> Mapping[str, Any]:
    """Writes `results` (process 0, atomically) once the last checkpoint
    is on disk; returns them.

    `checkpoint` saves the final state if no step did (a run of no steps).
    """
    self._ckpts.wait_until_finished()
    if checkpoint is not None and self._ckpts.latest_step() != self.total:
      self._save(self.total, checkpoint, force=True)
      self._ckpts.wait_until_finished()
    results_file.write(self._results_path, results)
    return results

  def _close(self) -> None:
    if self.writer is not None:
      self.writer.close()


@contextlib.contextmanager
def open_run(config: ml_collections.ConfigDict, workdir: str, *,
             check_config: CheckConfig, results_name: str,
             needed_bytes: int | None = None,
             checkpoints: type[checkpointing.Checkpoints]
             = checkpointing.Checkpoints) -> Iterator[Run]:
  """Holds `workdir` for one run: lock, config check, checkpoints.

  Args:
    config: the run's config; `checkpoint_every` and `keep_checkpoints`
      set the saves, and the whole of it is saved with each.
    workdir: the run's directory (created by the caller's checks).
    check_config: `(step, saved metadata) -> None`, raising on a config
      that may not resume this run; run here against the newest
      checkpoint, before the loop loads anything.
    results_name: the results file in `workdir`; a run is finished when
      its last checkpoint and this file exist.
    needed_bytes: about how much a checkpoint takes, for `DiskFull`'s
      message.
    checkpoints: the checkpoint class (Orbax's, or
      `train.run.local_checkpoints.LocalCheckpoints` for a run on part of a
      multi-process job).

  Yields:
    The `Run`. Leaving the block waits for the saves in flight, also when
    an error ends the run, so the last checkpoint it reports is on disk.

  Raises:
    WorkdirBusy: another process holds the workdir.
    DiskFull: a write in the block ran out of space.
  """
  with workdir_lock.hold(workdir):
    with disk_space.reported(
        workdir, needed_bytes,
        fileio.join(workdir, checkpointing.CHECKPOINTS)):
      newest = checkpointing.newest_meta(workdir, checkpoints)
      if newest is not None:
        check_config(*newest)
      with checkpoints(
          workdir, every_steps=config.checkpoint_every,
          keep=config.keep_checkpoints) as ckpts:
        run = Run(config, workdir, ckpts, check_config, results_name)
        try:
          yield run
        finally:
          run._close()  # pylint: disable=protected-access
