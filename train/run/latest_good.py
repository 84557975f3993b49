"""The newest checkpoint that loads and verifies, walking back past damaged
ones.

Each checkpoint that fails to load or to verify costs one warning line;
once a good one is found, the damaged ones after it are moved aside
(`checkpoints_damaged/<step>`: nothing is deleted) so that the run can
write their steps again. With checkpoints and none good, the run ends with
`NoGoodCheckpoint`, changing nothing.
"""

from collections.abc import Callable
from typing import Any

from absl import logging

from train import fileio
from train.run.checkpoint_integrity import DamagedCheckpoint
from train.run.checkpoint_integrity import NoGoodCheckpoint


def restore_latest_good(
    ckpts: Any, abstract_state: Any | Callable[[dict[str, Any]], Any],
    check_meta: Callable[[int, dict[str, Any]], None] | None,
    move_aside: Callable[[list[int]], None] | None
) -> tuple[int, Any, dict[str, Any]] | None:
  """(step, state, meta) of the newest good checkpoint of `ckpts`, or None
  when there is none at all; see `Checkpoints.restore_latest_good`.

  `ckpts`: a checkpoint back-end (`all_steps`, `restore_meta`, `restore`,
  `directory`); `move_aside(steps)` moves damaged steps away, or None to
  leave them (a reader of another run's checkpoints).

  Raises:
    NoGoodCheckpoint: there are checkpoints and none is usable.
  """
  problems = []
  for step in sorted(ckpts.all_steps(), reverse=True):
    try:
      meta = ckpts.restore_meta(step)
      if check_meta is not None:
        check_meta(step, meta)
      target = (abstract_state(meta) if callable(abstract_state)
                else abstract_state)
      state, meta = ckpts.restore(step, target)
    except DamagedCheckpoint as e:
      logging.warning('Skipping the damaged %s', e)
      problems.append(e)
      continue
    if problems and move_aside is not None:
      move_aside([p.step for p in problems])
    return step, state, meta
  if problems:
    raise NoGoodCheckpoint(ckpts.directory, problems)
  return None


def move_aside(directory: str, steps: list[int], aside: str) -> None:
  """Moves the checkpoints of `steps` from `directory` into `aside`, each
  under its step (then `<step>.1`, ... if an earlier one is there)."""
  fileio.makedirs(aside)
  for step in steps:
    target, n = fileio.join(aside, str(step)), 1
    while fileio.exists(target):
      target, n = fileio.join(aside, f'{step}.{n}'), n + 1
    fileio.rename(fileio.join(directory, str(step)), target)
    logging.warning('Moved the damaged checkpoint at step %d to %s', step,
                    target)
