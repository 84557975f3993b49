"""Workdir files on a local disk or in a bucket (`gs://...`), written atomically.

Local paths use plain `os` calls: a temporary file, fsync, then rename, so
a crash leaves the old file or the new one. Remote paths go through
`etils.epath` (Orbax's own path layer; GCS needs `gcsfs` installed on the
workers), where one object upload is already all-or-nothing. Checkpoints
do not come through here: Orbax writes them (tensorstore speaks gs://).

The run core opens a workdir's local files through `open_local`, which
refuses what is not a regular file (or a directory): opening a FIFO blocks until a writer
comes, a device such as /dev/zero reads without end, and a symlink that
leads out of the workdir would have the run read or overwrite someone
else's file. `check_tree` looks over a whole workdir before a run holds
it, so that files opened by libraries (Orbax's) are covered too.
"""

import errno
import os
import stat

from etils import epath

from train.errors import UsageError

REMOTE_PREFIXES = ('gs://', 's3://')

_SPECIAL = ((stat.S_ISFIFO, 'a FIFO (named pipe)'), (stat.S_ISSOCK, 'a socket'),
            (stat.S_ISCHR, 'a character device'),
            (stat.S_ISBLK, 'a block device'))

# open()'s modes as os.open flags ('b' and 't' dropped).
_OPEN_FLAGS = {
    'r': os.O_RDONLY, 'r+': os.O_RDWR,
    'w': os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    'w+': os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    'a': os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    'a+': os.O_RDWR | os.O_CREAT | os.O_APPEND,
    'x': os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    'x+': os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


class SpecialFile(UsageError):
  """A file in a workdir that a run must not open: a FIFO, a socket, a
  device, or a symlink that leads out of the workdir."""

  def __init__(self, path: str, what: str):
    self.path = path
    self.what = what
    # Not UsageError's `name=value` form: the path is what went wrong.
    ValueError.__init__(  # pylint: disable=non-parent-init-called
        self, f'{path} is {what}; a run opens only regular files inside its '
        'workdir. Move it away (or use another --workdir) and run again.')
    self.name, self.value, self.choices = path, what, None


def _special_kind(mode: int) -> str | None:
  """What a file of `mode` is, if a run may not open it."""
  for test, what in _SPECIAL:
    if test(mode):
      return what
  return None


def _inside(path: str, root: str) -> bool:
  return os.path.commonpath([path, root]) == root


def check_local(path: str, root: str | None = None) -> str:
  """The real path of local `path`, once it is known to be safe to open.

  Args:
    path: a file or directory (it may not exist yet: the open creates it).
    root: the directory that `path`, its symlinks followed, must lie in
      (the workdir); None: anywhere (a file the user named).

  Returns:
    `path` with every symlink resolved (open that, not `path`).

  Raises:
    SpecialFile: `path` is a FIFO, a socket or a device, or leads out of
      `root` through a symlink.
  """
  real = os.path.realpath(path)
  if root is not None and not _inside(real, os.path.realpath(root)):
    raise SpecialFile(path, f'a symlink to {real}, outside '
                      f'{os.path.realpath(root)}')
  try:
    kind = _special_kind(os.stat(real).st_mode)
  except OSError:  # Missing (to be created), or the open says why.
    return real
  if kind is not None:
    raise SpecialFile(path if real == os.path.abspath(path)
                      else f'{path} (a symlink to {real})', kind)
  return real


def open_local(path: str, mode: str = 'r', root: str | None = None, **kw):
  """`open(path, mode, **kw)` of a local file that cannot block or lead out
  of `root` (see `check_local`).

  The file is opened without blocking and checked again through its
  descriptor, so a FIFO put in its place after the check is refused too.

  Raises:
    SpecialFile: see `check_local`.
  """
  real = check_local(path, root)
  flags = _OPEN_FLAGS[mode.replace('b', '').replace('t', '')]
  try:
    fd = os.open(real, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666)
  except OSError as e:
    # ENXIO: a FIFO without a reader, or a socket, opened for writing
    # (put there since the check); ELOOP: a symlink loop, or a symlink
    # made since the check.
    if e.errno == errno.ENXIO:
      raise SpecialFile(path, 'a FIFO or a socket') from None
    if e.errno == errno.ELOOP:
      raise SpecialFile(path, 'a symlink loop (or a symlink made while it '
                        'was opened)') from None
    raise
  try:
    kind = _special_kind(os.fstat(fd).st_mode)
    if kind is not None:
      raise SpecialFile(path, kind)
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, **kw)
  except BaseException:
    os.close(fd)
    raise


def check_tree(root: str) -> None:
  """SpecialFile for the first entry below local directory `root` that a
  run may not open (see `check_local`); nothing for a bucket or a
  directory that does not exist yet.

  Symlinked directories are not entered: their targets lie in `root`, so
  the walk reaches them anyway.
  """
  if is_remote(root) or not os.path.isdir(root):
    return
  real_root = os.path.realpath(root)
  for directory, dirs, files in os.walk(real_root):
    for name in dirs + files:
      path = os.path.join(directory, name)
      try:
        mode = os.lstat(path).st_mode
      except FileNotFoundError:  # Removed since listed (a run's temp file).
        continue
      if stat.S_ISLNK(mode):
        check_local(path, real_root)
      elif _special_kind(mode) is not None:
        raise SpecialFile(path, _special_kind(mode))


def is_remote(path: str) -> bool:
  return str(path).startswith(REMOTE_PREFIXES)


def absolute(path: str) -> str:
  """An absolute local path; remote paths unchanged."""
  return str(path) if is_remote(path) else os.path.abspath(path)


def join(*parts: str) -> str:
  if is_remote(parts[0]):
    return '/'.join([str(parts[0]).rstrip('/'), *parts[1:]])
  return os.path.join(*parts)


def exists(path: str) -> bool:
  return epath.Path(path).exists() if is_remote(path) else os.path.exists(path)


def makedirs(path: str) -> None:
  if is_remote(path):
    epath.Path(path).mkdir(parents=True, exist_ok=True)
  else:
    os.makedirs(path, exist_ok=True)


def rename(source: str, target: str) -> None:
  """Moves a file or directory (in a bucket: copies then deletes)."""
  if is_remote(source):
    epath.Path(source).rename(target)
  else:
    os.replace(source, target)


def read_text(path: str, root: str | None = None) -> str:
  """The text of `path`; `root` as in `check_local`."""
  if is_remote(path):
    return epath.Path(path).read_text()
  with open_local(path, root=root) as f:
    return f.read()


def read_bytes(path: str, root: str | None = None) -> bytes:
  """The bytes of `path`; `root` as in `check_local`."""
  if is_remote(path):
    return epath.Path(path).read_bytes()
  with open_local(path, 'rb', root=root) as f:
    return f.read()


def write_bytes_atomic(path: str, data: bytes) -> None:
  if is_remote(path):
    epath.Path(path).write_bytes(data)
    return
  tmp = f'{path}.tmp.{os.getpid()}'
  # The rename replaces whatever `path` is (a FIFO, a symlink) without
  # opening it; only the temporary file is opened.
  with open_local(tmp, 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
  write_bytes_atomic(path, text.encode())
