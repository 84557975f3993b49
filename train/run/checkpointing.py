"""Orbax checkpoints in the workdir: atomic, asynchronous, verified, keep N, resume.

Orbax writes each step into a temporary directory and renames it when
complete, so a crash never leaves a half-written checkpoint that a restart
would pick up. Saves are asynchronous: the device-to-host copy happens
before `save` returns (so the caller may donate the arrays to the next
step); the write to disk overlaps with training.

Each checkpoint is sealed and verified by `train.run.checkpoint_integrity`
(its arrays' fingerprints, its metadata's digest). `restore_latest_good`
walks back from the newest checkpoint past any that fails to load or to
verify (`train.run.latest_good`), and moves those aside
(`checkpoints_damaged/<step>`: nothing is deleted) so that the run can
write their steps again.
"""

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from train import fileio
from train.errors import DiskFull, cause_line
from train.run import checkpoint_integrity as integrity
from train.run import disk_space
from train.run import latest_good
from train.run import process_group

CHECKPOINTS = 'checkpoints'
DAMAGED = 'checkpoints_damaged'
# Named here too: callers and `train.run.local_checkpoints` know them as
# checkpointing's.
CHECKSUMS = integrity.CHECKSUMS
META_DIGEST = integrity.META_DIGEST
DamagedCheckpoint = integrity.DamagedCheckpoint
NoGoodCheckpoint = integrity.NoGoodCheckpoint


@functools.cache
def _whole_arrays_on_cpu() -> None:
  """On a CPU host, Orbax saves each replicated array once, whole.

  Orbax's default (replica-parallel saving, off on GPUs) splits a
  replicated array into one slice per device so that every device copies
  a part to the host; simulated CPU devices share the host's memory, so
  the split only adds work: an eager slice program per leaf and device,
  compiled in each process (2,012 compiles in one run of the suite). The
  files hold the same values either way, and a restore reads both.
  """
  if all(d.platform == 'cpu' for d in jax.devices()):
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
        override=True)


def _orbax_manager(directory: str, *, every_steps: int, keep: int,
                   async_save: bool, read_only: bool, alone: bool
                   ) -> ocp.CheckpointManager:
  """Orbax's manager of `directory`, for a run `alone` on part of a
  multi-process job (`process_group`) or for the whole job."""
  _whole_arrays_on_cpu()
  extra = {}
  if alone:
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
  return ocp.CheckpointManager(
      directory,
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


def _check_room(manager: ocp.CheckpointManager, directory: str,
                state: Any) -> None:
  """Raises `DiskFull` unless `directory` has room for a save of `state`."""
  # Arrays as stored (uncompressed), plus the metadata files.
  needed = disk_space.tree_bytes(state) * 11 // 10 + 2**16
  try:
    disk_space.check_room(directory, needed)
  except DiskFull:
    # A save still in flight holds space in its temporary directory and
    # is not yet counted among the intact checkpoints: let it finish (it
    # may free the space of one past `keep`), then look again.
    manager.wait_until_finished()
    disk_space.check_room(directory, needed)


def _restore_target(abstract_state: Any, alone: bool) -> Any:
  """What Orbax restores into: with the shardings, or host arrays for a run
  alone on part of a job (placed after the restore)."""
  if alone:
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_state)
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      abstract_state)


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
    self._manager = _orbax_manager(
        self.directory, every_steps=every_steps, keep=keep,
        async_save=async_save, read_only=read_only, alone=self._alone)

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
    _check_room(self._manager, self.directory, state)
    meta = integrity.sealed(meta, state)
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
    target = _restore_target(abstract_state, self._alone)
    try:
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      # Orbax and tensorstore raise many types for unreadable files.
      raise DamagedCheckpoint(step, f'does not load ({cause_line(e)})'
                              ) from e
    state, meta = restored.state, integrity.verified_meta(step, restored.meta)
    if self._alone:
      state = jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), state,
                           abstract_state)
    integrity.check_arrays(step, state, meta, self.directory)
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
    return integrity.verified_meta(step, meta)

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
    return latest_good.restore_latest_good(
        self, abstract_state, check_meta,
        self._move_aside if move_damaged else None)

  def _move_aside(self, damaged_steps: list[int]) -> None:
    """Moves damaged steps to `workdir/checkpoints_damaged/` (process 0)."""
    if process_group.is_writer():
      latest_good.move_aside(self.directory, damaged_steps,
                             fileio.join(self.workdir, DAMAGED))
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
  with (checkpoints or Checkpoints)(workdir, every_steps=1, keep=1,
                                    async_save=False, read_only=True) as ckpts:
    step = ckpts.latest_step()
    if step is None:
      return None
    try:
      return step, ckpts.restore_meta(step)
    except DamagedCheckpoint:
      return None
