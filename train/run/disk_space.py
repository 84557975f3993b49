"""Running out of disk: recognising it in whatever a library raised, and saying so.

Orbax, tensorstore and the file system each report a full disk their own
way (an OSError with errno ENOSPC, a tensorstore status whose text says
"No space left on device", wrapped by an asynchronous save); the run
reports all of them as one `errors.DiskFull` line naming the path, the
space needed and the space left. Saves are atomic, so the checkpoints
written before stay valid and the run resumes from them once there is
space again.
"""

from collections.abc import Iterator
import contextlib
import errno
import os
import re
import shutil

from train import fileio
from train.errors import DiskFull, Preempted, RunError, UsageError

FULL_DISK_TEXT = re.compile(r'no space left on device|ENOSPC|disk quota exceeded',
                   re.IGNORECASE)


def _chain(error: BaseException):
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def full_disk_error(error: BaseException) -> BaseException | None:
  """The exception in `error`'s chain that says the disk is full, or None."""
  for e in _chain(error):
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return e
    if FULL_DISK_TEXT.search(str(e)):
      return e
  return None


def free_bytes(path: str) -> int | None:
  """Free space on the file system of `path` (None for buckets)."""
  if fileio.is_remote(path):
    return None
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path or '.').free
  except OSError:
    return None


def completed_steps(checkpoint_dir: str) -> list[int]:
  """Steps whose checkpoint finished writing (orbax renames a step's
  temporary directory to the bare step number when it is complete)."""
  if fileio.is_remote(checkpoint_dir) or not os.path.isdir(checkpoint_dir):
    return []
  return sorted(int(d) for d in os.listdir(checkpoint_dir) if d.isdigit())


def as_disk_full(error: BaseException, workdir: str, needed_bytes: int | None,
                 checkpoint_dir: str) -> DiskFull | None:
  """`error` as a `DiskFull` if a full disk caused it, else None."""
  cause = full_disk_error(error)
  if cause is None:
    return None
  # An OSError names its file; tensorstore quotes it in its message.
  quoted = re.search(r'"(/[^"]+|gs://[^"]+)"', str(cause))
  path = (getattr(cause, 'filename', None)
          or (quoted.group(1) if quoted else workdir))
  steps = completed_steps(checkpoint_dir)
  return DiskFull(str(path), needed_bytes, free_bytes(workdir),
                  steps[-1] if steps else None)


@contextlib.contextmanager
def reported(workdir: str, needed_bytes: int | None,
             checkpoint_dir: str) -> Iterator[None]:
  """Inside the block, an exception that a full disk caused (a write of the
  log, the results, a checkpoint's files) is raised as `DiskFull`, one
  line; the run's own errors and stops pass as they are."""
  try:
    yield
  except (UsageError, RunError, Preempted):
    raise
  except Exception as e:  # pylint: disable=broad-except
    full = as_disk_full(e, workdir, needed_bytes, checkpoint_dir)
    if full is None:
      raise
    raise full from e


def tree_bytes(tree) -> int:
  """Bytes of a pytree's arrays (global shapes; ShapeDtypeStructs too)."""
  import jax  # pylint: disable=g-import-not-at-top
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def check_room(directory: str, needed_bytes: int) -> None:
  """Raises `DiskFull` now if `directory`'s file system has less than
  `needed_bytes` free: a save that would fail is not started (a failed
  asynchronous save is reported by the library's threads, noisily)."""
  free = free_bytes(directory)
  if free is not None and free < needed_bytes:
    steps = completed_steps(directory)
    raise DiskFull(directory, needed_bytes, free,
                   steps[-1] if steps else None)
