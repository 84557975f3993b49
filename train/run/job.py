"""A workdir held by a job that does not resume: an evaluation or a study.

A resumable run holds its workdir through `train.run.resumable.open_run`;
everything else that writes into a workdir (an evaluation, a study's
root) holds it through `open_job`, so the lock and the stop policy are
taken in one place:

- One job at a time: the workdir is scanned for special files and locked
  (`train.run.workdir_lock`) before anything there is read or written; a
  second launch ends at once with `WorkdirBusy`, one line naming the
  holder (exit 75 under `train.jobs.entry.run_job`).
- SIGTERM or SIGINT raise `errors.Interrupted` inside the block
  (`preemption.raise_on_signals`): a job has no state to save, so it ends
  where it is, in one line. A resumable run started inside it installs
  its own handler for its steps (`Run.stopping`) and restores this one.

Example::

  root = experiment.check_workdir(workdir)
  with job.open_job(root):
    rows = measure()
    write(root, rows)
"""

from collections.abc import Iterator
import contextlib

from train.run import preemption
from train.run import workdir_lock

# What a launcher maps to its exit status for a busy workdir.
WorkdirBusy = workdir_lock.WorkdirBusy


@contextlib.contextmanager
def open_job(workdir: str) -> Iterator[None]:
  """Holds `workdir` (checked, locked) with the stop policy for the block.

  Raises:
    WorkdirBusy: another process holds the workdir.
    fileio.SpecialFile: a file in it is a FIFO, a socket, a device or a
      symlink out of it.
    Interrupted: SIGTERM or SIGINT arrived in the block.
  """
  with workdir_lock.hold(workdir), preemption.raise_on_signals():
    yield


def holder(workdir: str) -> dict[str, str] | None:
  """Who holds `workdir` now (host, pid, started), or None if nobody does
  (a sweep waits for a run that another process holds)."""
  return workdir_lock.holder(workdir)
