"""Orbax checkpoints in the workdir: atomic, asynchronous, verified, keep N, resume.

Orbax writes each step into a temporary directory and renames it when
complete, so a crash never leaves a half-written checkpoint that a restart
would pick up. Saves are asynchronous: the device-to-host copy happens
before `save` returns (so the caller may donate the arrays to the next
step); the write to disk overlaps with training.

Every checkpoint carries a fingerprint of each array it holds
(`train.run.checksums`, computed on the devices), and a restore recomputes and
compares them, so a flipped bit on disk is found rather than trained on.
The metadata saved beside the arrays (the run's config, its inputs'
fingerprints) carries its own digest, so a flipped bit there is damage
too, never a different config. `restore_latest_good` walks back from the
newest checkpoint past any that fails to load or to verify, with one
warning line each, and moves those aside (`checkpoints_damaged/<step>`:
nothing is deleted) so that the run can write their steps again.
"""

from collections.abc import Callable
import hashlib
import json
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from train.run import checksums
from train.run import disk_space
from train import fileio
from train.run import process_group
from train.errors import DiskFull, RunError, cause_line

CHECKPOINTS = 'checkpoints'
CHECKSUMS = 'checksums'
# The digest of the rest of the metadata (`_meta_digest`).
META_DIGEST = 'meta_sha256'
DAMAGED = 'checkpoints_damaged'


class DamagedCheckpoint(RuntimeError):
  """A checkpoint that does not load, or whose arrays fail verification."""

  def __init__(self, step: int, reason: str):
    self.step = step
    self.reason = reason
    super().__init__(f'checkpoint at step {step}: {reason}')


class NoGoodCheckpoint(RunError):
  """Checkpoints exist and none of them is usable (the run cannot resume)."""
  exit_code = 4

  def __init__(self, directory: str, problems: list[DamagedCheckpoint]):
    self.problems = problems
    listed = '; '.join(f'step {p.step}: {p.reason}' for p in problems)
    super().__init__(
        f'no usable checkpoint in {directory} ({listed}). Nothing was '
        'changed; to start the run over, move that directory aside.')


def _meta_digest(meta: dict[str, Any]) -> str:
  """SHA-256 of `meta` as canonical JSON: of what JSON gives back of it
  (integer keys come back as strings, and sort as strings), so the saved
  and the restored metadata agree."""
  text = json.dumps(json.loads(json.dumps(meta)), sort_keys=True,
                    separators=(',', ':'))
  return hashlib.sha256(text.encode()).hexdigest()


def _verified_meta(step: int, meta: Any) -> dict[str, Any]:
  """`meta` without its digest, once the digest matches (older checkpoints
  have none).

  Raises:
    DamagedCheckpoint: `meta` is not a JSON object, or not what was saved.
  """
  if not isinstance(meta, dict):
    raise DamagedCheckpoint(step, 'metadata is not a JSON object')
  meta = dict(meta)
  saved = meta.pop(META_DIGEST, None)
  if saved is not None and saved != _meta_digest(meta):
    raise DamagedCheckpoint(step, 'metadata checksum mismatch (the saved '
                            'config or fingerprints changed on disk)')
  return meta


class Checkpoints:
  """The run's checkpoint directory (`workdir/checkpoints`)."""

  def __init__(self, workdir: str, *, every_steps: int, keep: int,
               async_save: bool = True, read_only: bool = False):
    """`read_only` for another run's checkpoints (a source model, a policy):
    nothing there is created, cleaned up or saved; its unfinished
    checkpoints may be that run's saves in progress."""
    self.workdir = fileio.absolute(workdir)
    self.directory = fileio.join(self.workdir, CHECKPOINTS)
    if read_only:
      # Another run's directory is not scanned by `workdir_lock.hold`, and
      # Orbax's reads of a FIFO there would block.
      fileio.check_tree(self.directory)
    # A run alone on part of a job (process_group) reads with Orbax as a
    # job of one process; Orbax cannot write there (its numpy and scalar
    # writers run on process 0 only): such a run saves LocalCheckpoints.
    self._alone = process_group.is_alone()
    if self._alone and not read_only:
      raise RuntimeError('a run alone on part of a multi-process job saves '
                         'train.run.local_checkpoints.LocalCheckpoints')
    extra = {}
    if self._alone:
      me = jax.process_index()
      processes = ocp.options.MultiprocessingOptions(
          primary_host=me, active_processes={me},
          barrier_sync_key_prefix=f'geom_alone_{me}')
      extra = dict(multiprocessing_options=processes)
      items = {'item_handlers': {
          'state': ocp.StandardCheckpointHandler(
              multiprocessing_options=processes),
          'meta': ocp.JsonCheckpointHandler(
              multiprocessing_options=processes)}}
    else:
      items = {'item_names': ('state', 'meta')}
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            # Only the interval (orbax's default also saves the first step).
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
                every_steps),
            max_to_keep=keep,
            create=not read_only,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            **extra,
        ),
        **items,
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, meta: dict[str, Any],
           force: bool = False) -> bool:
    """Starts saving `state` at `step`; returns whether a save was started.

    The arrays' fingerprints go into the saved `meta` under 'checksums',
    and the digest of all of it under 'meta_sha256'.

    Raises:
      DiskFull: the disk has less room than the checkpoint needs (the
        earlier checkpoints stay as they are).
    """
    if not (force or self.should_save(step)):
      return False
    # Arrays as stored (uncompressed), plus the metadata files.
    needed = disk_space.tree_bytes(state) * 11 // 10 + 2**16
    try:
      disk_space.check_room(self.directory, needed)
    except DiskFull:
      # A save still in flight holds space in its temporary directory and
      # is not yet counted among the intact checkpoints: let it finish (it
      # may free the space of one past `keep`), then look again.
      self._manager.wait_until_finished()
      disk_space.check_room(self.directory, needed)
    meta = dict(meta, **{CHECKSUMS: checksums.fingerprint(state)})
    meta[META_DIGEST] = _meta_digest(meta)
    return self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(meta)),
        force=force)

  def restore(self, step: int, abstract_state: Any
              ) -> tuple[Any, dict[str, Any]]:
    """Restores `step` into the shapes, dtypes and shardings of `abstract_state`.

    Raises:
      DamagedCheckpoint: it does not load, or an array's fingerprint
        differs from the one saved with it.
    """
    if self._alone:  # Read as host arrays, then placed (module docstring).
      target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                            abstract_state)
    else:
      target = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=x.sharding),
          abstract_state)
    try:
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      # Orbax and tensorstore raise many types for unreadable files.
      raise DamagedCheckpoint(step, f'does not load ({cause_line(e)})'
                              ) from e
    state, meta = restored.state, _verified_meta(step, restored.meta)
    if self._alone:
      state = jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), state,
                           abstract_state)
    saved = meta.get(CHECKSUMS)
    if saved is None:
      logging.warning('The checkpoint at step %d in %s has no checksums '
                      '(saved by an older version): not verified.', step,
                      self.directory)
      return state, meta
    bad = checksums.mismatches(saved, checksums.fingerprint(state))
    if bad:
      raise DamagedCheckpoint(
          step, f'checksum mismatch in {len(bad)} array(s), e.g. '
          f'state{bad[0]}')
    return state, meta

  def restore_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata saved with `step` (e.g. the run's config), alone.

    Raises:
      DamagedCheckpoint: it does not load.
    """
    try:
      meta = self._manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      raise DamagedCheckpoint(step, f'metadata does not load '
                              f'({cause_line(e)})') from e
    return _verified_meta(step, meta)

  def restore_latest_good(
      self, abstract_state: Any | Callable[[dict[str, Any]], Any], *,
      check_meta: Callable[[int, dict[str, Any]], None] | None = None,
      move_damaged: bool = True) -> tuple[int, Any, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies: (step, state, meta).

    Args:
      abstract_state: the target of the restore, or `meta -> target`.
      check_meta: called with each candidate's step and metadata before its
        arrays are read; a `UsageError` it raises (e.g. a changed config)
        ends the search and propagates.
      move_damaged: move the checkpoints skipped as damaged to
        `workdir/checkpoints_damaged/` (only the run that owns the workdir
        should; a reader leaves them).

    Returns:
      None when there is no checkpoint at all.

    Raises:
      NoGoodCheckpoint: there are checkpoints and none is usable.
    """
    problems = []
    for step in sorted(self.all_steps(), reverse=True):
      try:
        meta = self.restore_meta(step)
        if check_meta is not None:
          check_meta(step, meta)
        target = (abstract_state(meta) if callable(abstract_state)
                  else abstract_state)
        state, meta = self.restore(step, target)
      except DamagedCheckpoint as e:
        logging.warning('Skipping the damaged %s', e)
        problems.append(e)
        continue
      if problems and move_damaged:
        self._move_aside([p.step for p in problems])
      return step, state, meta
    if problems:
      raise NoGoodCheckpoint(self.directory, problems)
    return None

  def _move_aside(self, damaged_steps: list[int]) -> None:
    """Moves damaged steps to `workdir/checkpoints_damaged/` (process 0)."""
    if process_group.is_writer():
      aside = fileio.join(self.workdir, DAMAGED)
      fileio.makedirs(aside)
      for step in damaged_steps:
        target, n = fileio.join(aside, str(step)), 1
        while fileio.exists(target):
          target, n = fileio.join(aside, f'{step}.{n}'), n + 1
        fileio.rename(fileio.join(self.directory, str(step)), target)
        logging.warning('Moved the damaged checkpoint at step %d to %s',
                        step, target)
    if process_group.count() > 1:
      multihost_utils.sync_global_devices('geom_move_damaged_checkpoints')
    self._manager.reload()

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> 'Checkpoints':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def newest_meta(workdir: str, checkpoints: type['Checkpoints'] | None = None
                ) -> tuple[int, dict[str, Any]] | None:
  """(step, metadata) of the newest checkpoint in `workdir`, without
  restoring arrays; None if there is none or its metadata is damaged (the
  restore that follows skips a damaged checkpoint and reports it).
  `checkpoints`: the class that wrote them (default: Orbax's)."""
  with (checkpoints or Checkpoints)(workdir, every_steps=1, keep=1, async_save=False,
                   read_only=True) as ckpts:
    step = ckpts.latest_step()
    if step is None:
      return None
    try:
      return step, ckpts.restore_meta(step)
    except DamagedCheckpoint:
      return None
