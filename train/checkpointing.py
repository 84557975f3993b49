"""Orbax checkpoints in the workdir: atomic, asynchronous, keep N, resume.

Orbax writes each step into a temporary directory and renames it when
complete, so a crash never leaves a half-written checkpoint that a restart
would pick up. Saves are asynchronous: the device-to-host copy happens
before `save` returns (so the caller may donate the arrays to the next
step); the write to disk overlaps with training.
"""

from typing import Any

import jax
import orbax.checkpoint as ocp

from train import fileio


class Checkpoints:
  """The run's checkpoint directory (`workdir/checkpoints`)."""

  def __init__(self, workdir: str, *, every_steps: int, keep: int,
               async_save: bool = True):
    self.directory = fileio.join(fileio.absolute(workdir), 'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            # Only the interval (orbax's default also saves the first step).
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
                every_steps),
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        ),
        item_names=('state', 'meta'),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, meta: dict[str, Any],
           force: bool = False) -> bool:
    """Starts saving `state` at `step`; returns whether a save was started."""
    return self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(meta)),
        force=force)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores `step` into the shapes, dtypes and shardings of `abstract_state`."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=x.sharding),
        abstract_state)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def restore_meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata saved with `step` (e.g. the run's config), alone."""
    return self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> 'Checkpoints':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
