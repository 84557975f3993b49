"""A run's results file: written last, so that its presence (with the
checkpoint of the last step) is what makes the run finished."""

from collections.abc import Callable, Mapping
from typing import Any

from absl import logging

from train import fileio
from train.run import checkpointing
from train.run import metrics as metrics_lib
from train.run import process_group


def read_if_finished(ckpts: checkpointing.Checkpoints, path: str,
                     workdir: str, total: int,
                     check_meta: Callable[[int, Mapping[str, Any]], None]
                     ) -> dict[str, Any] | None:
  """The results at `path` of a run that ended at step `total`, or None.

  Reads only the newest checkpoint's metadata (checked by `check_meta`,
  which may raise) and the results file. None when the run is not
  finished, its newest checkpoint is damaged (the restore that follows
  reports it and falls back) or its results are unreadable (they are
  computed again).
  """
  latest = ckpts.latest_step()
  if latest is None or latest < total or not fileio.exists(path):
    return None
  try:
    meta = ckpts.restore_meta(latest)
  except checkpointing.DamagedCheckpoint:
    return None
  check_meta(latest, meta)
  if latest != total:
    return None
  try:
    results = metrics_lib.read_json(path, workdir)
  except ValueError as e:
    logging.warning('%s is unreadable (%s); computing it again', path, e)
    return None
  logging.info('The run in %s is complete (step %d); its results are '
               'reported again', workdir, total)
  return results


def write(path: str, results: Mapping[str, Any]) -> None:
  """Writes `results` atomically (process 0 only)."""
  if process_group.is_writer():
    metrics_lib.write_json_atomic(path, results)
