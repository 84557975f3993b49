"""A resumable run opened from the workdir its launcher gives.

`open_run` is the one way in from a launcher's `--workdir` for a run that
may be one process of a larger job (RL's learner): it

- checks the path (`train.run.workdir_path`): created, writable, and on
  a file system where this process writes its checkpoints alone;
- picks the checkpoint back-end: Orbax's for a run that spans its job,
  `train.run.local_checkpoints` for a run that one process of a job holds
  (`part`), and refuses, in one line naming the field that splits the
  job, a workdir whose newest checkpoint is of the other kind (neither
  reads the other's);
- holds the workdir and resumes it as `train.run.resumable.open_run`
  does (the lock, the config check, the checkpoints); with `part`, the
  whole block runs as this process alone (`process_group.alone`).

A stop told by another process of the job reaches the run through
`train.run.stop_protocol`.
"""

from collections.abc import Callable, Iterator, Mapping
import contextlib
import dataclasses
import functools
from typing import Any

import ml_collections

from train.errors import ConfigError
from train.run import local_checkpoints
from train.run import process_group
from train.run import resumable
from train.run import workdir_path

# (workdir, step, saved metadata) -> None, or raises (e.g. ConfigChanged).
CheckConfig = Callable[[str, int, Mapping[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class JobSplit:
  """How a product's job splits into processes, for its refusals.

  Attributes:
    field: the config field that splits the job ('rollout_processes').
    whole: a run that spans its job ('a one-process run').
    whole_resume: how to resume one ('resume it with one process').
    part: a run on part of a job ('a multi-process run (...)').
    part_resume: how to resume one.
    holder: who holds such a run ('the learner of a multi-process run').
  """
  field: str
  whole: str
  whole_resume: str
  part: str
  part_resume: str
  holder: str


def check_backend(config: ml_collections.ConfigDict, workdir: str,
                  split: JobSplit, part: bool) -> None:
  """ConfigError unless `workdir` holds no checkpoint, or its newest is of
  the back-end this run writes (local with `part`, else Orbax's)."""
  local = local_checkpoints.newest_is_local(workdir)
  if local is None or local == part:
    return
  if part:
    raise ConfigError(split.field, config.get(split.field),
                      f'{workdir} holds the checkpoints of {split.whole}; '
                      f'{split.whole_resume}, or give a new workdir')
  raise ConfigError(split.field, None,
                    f'{workdir} holds the checkpoints of {split.part}; '
                    f'{split.part_resume}, or give a new workdir')


@contextlib.contextmanager
def open_run(config: ml_collections.ConfigDict, workdir: str, *,
             check_config: CheckConfig, results_name: str, split: JobSplit,
             part: bool = False) -> Iterator[resumable.Run]:
  """Checks `workdir`, picks its checkpoints, holds it; yields the `Run`.

  Args:
    config: the run's config (see `resumable.open_run`).
    workdir: as the launcher gave it.
    check_config: `(workdir, step, saved metadata) -> None`, raising on a
      config that may not resume this run.
    results_name: the results file in the workdir.
    split: how the job splits, for a workdir of the other back-end.
    part: this process holds the run alone, in a job of several.

  Raises:
    UsageError: the workdir is not a writable directory, or (with
      `part`) a bucket URL; ConfigError: its checkpoints are the other
      back-end's; and what `resumable.open_run` raises.
  """
  with process_group.alone() if part else contextlib.nullcontext():
    if part:
      workdir_path.check_local(workdir, split.holder)
    workdir = workdir_path.check(workdir)
    check_backend(config, workdir, split, part)
    with resumable.open_run(
        config, workdir, check_config=functools.partial(check_config,
                                                        workdir),
        results_name=results_name,
        checkpoints=local_checkpoints.opener(part)) as run:
      yield run
