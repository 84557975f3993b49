"""One run per workdir: an OS lock held for the whole run.

`hold(workdir)` takes an exclusive `flock` on `workdir/.lock` before the
run writes anything, and writes who holds it (host, pid, start time) into
the file. The kernel releases a `flock` when its holder dies, however it
dies (kill -9 included), so a crashed run never leaves a stale lock behind:
the next launch takes it. A second launch on a held workdir fails at once
with `WorkdirBusy`, one line naming the holder.

Several processes of one run (multi-host): process 0 holds the lock for
all of them. A workdir in a bucket (gs://) cannot be flock-ed; its lock is
a local file named after the URL (under ~/.cache/geom/locks), which keeps
out a second run launched from the same machine, not one on another
machine: that is the scheduler's job there (one job per workdir).
"""

from collections.abc import Iterator
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import socket

from jax.experimental import multihost_utils
import numpy as np

from train import fileio
from train.run import process_group
from train.errors import UsageError

LOCK_FILE = '.lock'
# `hold`'s status from process 0 to the others: 0 busy, 1 held, or this.
_REFUSED = 2


class WorkdirBusy(UsageError):
  """Another live process holds the workdir's lock."""

  def __init__(self, workdir: str, holder: dict[str, str]):
    self.holder = holder
    who = (f'host {holder.get("host", "?")}, pid {holder.get("pid", "?")}, '
           f'started {holder.get("started", "?")}')
    super().__init__(
        '--workdir', workdir,
        f'in use by another run ({who}); wait for it to end or stop it, or '
        'use another --workdir')


def lock_path(workdir: str) -> str:
  """The file whose flock guards `workdir` (made absolute)."""
  workdir = fileio.absolute(workdir)
  if not fileio.is_remote(workdir):
    return os.path.join(workdir, LOCK_FILE)
  digest = hashlib.sha256(workdir.rstrip('/').encode()).hexdigest()[:24]
  return os.path.join(os.path.expanduser('~/.cache/geom/locks'),
                      f'{digest}.lock')


def _read_holder(f) -> dict[str, str]:
  f.seek(0)
  try:
    return json.loads(f.read() or '{}')
  except ValueError:
    return {}


def _try_lock(path: str):
  """An open file holding the flock on `path`, or (None, the holder's info)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # 'a+' creates the file without truncating what a holder wrote.
  try:
    f = fileio.open_local(  # pylint: disable=consider-using-with
        path, 'a+', root=os.path.dirname(path))
  except IsADirectoryError:
    raise UsageError('--workdir', os.path.dirname(path),
                     f'its lock file {path} is a directory, not a file '
                     '(made by hand?); move it aside') from None
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _read_holder(f)
    f.close()
    return None, holder
  return f, None


def holder(workdir: str) -> dict[str, str] | None:
  """Who holds `workdir` now (host, pid, started), or None if nobody does."""
  path = lock_path(workdir)
  if not os.path.exists(path):
    return None
  f, info = _try_lock(path)
  if f is None:
    return info
  f.close()  # Closing releases the flock we just took.
  return None


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
  """Holds the lock of `workdir` (process 0, for all processes) for the block.

  Raises:
    WorkdirBusy: another live process holds it (on every process of the
      run, so that none waits for the others at a collective).
    fileio.SpecialFile: a file in the workdir is a FIFO, a socket, a
      device or a symlink out of it (looked for before anything there is
      opened: a run would block on it, or read or write outside).
    UsageError: the lock file is a directory.
  """
  f = info = refused = None
  if process_group.is_writer():
    try:
      fileio.check_tree(fileio.absolute(workdir))
      f, info = _try_lock(lock_path(workdir))
    except UsageError as e:
      refused = e
  status = _REFUSED if refused is not None else int(f is not None)
  if process_group.count() > 1:
    # Every process ends alike; the others would wait at their first
    # collective for a process 0 that has left.
    status = int(multihost_utils.broadcast_one_to_all(np.int32(status)))
  if refused is not None:
    raise refused
  if status == _REFUSED:
    raise UsageError('--workdir', workdir, 'refused by process 0 (its error '
                     'names the file)')
  if not status:
    raise WorkdirBusy(workdir, info or {})
  if f is None:  # Another process of the run holds it.
    yield
    return
  try:
    f.seek(0)
    f.truncate()
    f.write(json.dumps({
        'host': socket.gethostname(), 'pid': os.getpid(),
        'started': datetime.datetime.now().astimezone().isoformat(
            timespec='seconds')}))
    f.flush()
    yield
  finally:
    # The file stays: removing it would let a third process lock a new
    # inode while a second still waits on the old one.
    f.close()
