"""The workdir a launcher gives, checked before a run or a job holds it.

`check` creates it if needed and proves it writable with a probe file; a
run rebuilt only to read another run's checkpoints (`reading_another_run`:
a source model, a policy) leaves that workdir as it is, since it is an
input and may be read-only. `check_local` refuses a bucket URL where a
process writes its checkpoints alone.
"""

from collections.abc import Iterator
import contextlib
import contextvars
import os
import tempfile

from etils import epath

from train import fileio
from train.errors import UsageError

# True while another run's experiment is rebuilt to read its checkpoints
# (`train.training.experiment.reading_checkpoints`).
_READING_ANOTHER_RUN = contextvars.ContextVar('reading_another_run',
                                              default=False)


@contextlib.contextmanager
def reading_another_run() -> Iterator[None]:
  """Inside the block, `check` only resolves the path."""
  token = _READING_ANOTHER_RUN.set(True)
  try:
    yield
  finally:
    _READING_ANOTHER_RUN.reset(token)


def check(workdir: str) -> str:
  """Creates `workdir` if needed and proves it writable with a probe file
  (inside `reading_another_run`, neither: the workdir is only read);
  returns its absolute path."""
  if not workdir or not str(workdir).strip():
    # os.path.abspath('') is the current directory: an unset shell variable
    # would scatter the run's files there.
    raise UsageError('--workdir', workdir,
                     'empty (an unset variable?); give a directory')
  path = fileio.absolute(workdir)
  if _READING_ANOTHER_RUN.get():
    return path
  try:
    if fileio.is_remote(path):
      probe = epath.Path(path) / f'.write_probe_{os.getpid()}'
      probe.parent.mkdir(parents=True, exist_ok=True)
      probe.write_text('')
      probe.unlink()
    else:
      os.makedirs(path, exist_ok=True)
      with tempfile.NamedTemporaryFile(dir=path, prefix='.write_probe_'):
        pass
  except Exception as e:  # pylint: disable=broad-except
    # OSError locally; the bucket clients raise their own types.
    raise UsageError('--workdir', workdir,
                     f'not a writable directory '
                     f'({getattr(e, "strerror", None) or e})') from None
  return path


def check_local(workdir: str, who: str) -> None:
  """UsageError if `workdir` is a bucket URL: `who` (e.g. 'the learner of
  a multi-process run') writes its checkpoints alone, to a file system."""
  if fileio.is_remote(workdir):
    raise UsageError(
        '--workdir', workdir, f'{who} writes its checkpoints alone, to a '
        'file system (local, or a bucket mounted, e.g. by Cloud Storage '
        'FUSE), not to a bucket URL')
