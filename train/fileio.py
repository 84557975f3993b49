"""Workdir files on a local disk or in a bucket (`gs://...`), written atomically.

Local paths use plain `os` calls: a temporary file, fsync, then rename, so
a crash leaves the old file or the new one. Remote paths go through
`etils.epath` (Orbax's own path layer; GCS needs `gcsfs` installed on the
workers), where one object upload is already all-or-nothing. Checkpoints
do not come through here: Orbax writes them (tensorstore speaks gs://).
"""

import os

from etils import epath

REMOTE_PREFIXES = ('gs://', 's3://')


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


def read_text(path: str) -> str:
  if is_remote(path):
    return epath.Path(path).read_text()
  with open(path) as f:
    return f.read()


def read_bytes(path: str) -> bytes:
  if is_remote(path):
    return epath.Path(path).read_bytes()
  with open(path, 'rb') as f:
    return f.read()


def write_bytes_atomic(path: str, data: bytes) -> None:
  if is_remote(path):
    epath.Path(path).write_bytes(data)
    return
  tmp = f'{path}.tmp.{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_text_atomic(path: str, text: str) -> None:
  write_bytes_atomic(path, text.encode())
