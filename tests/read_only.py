"""A directory seen through a read-only bind mount, as a run's input may be
(another user's, a shared disk): the suite runs as root, which ignores
permission bits, but not a read-only mount."""

import contextlib
import errno
import os
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def view(path: str, at: str) -> Iterator[str]:
  """`path` seen read-only at `at` (created); skips the test where this
  machine does not let the tests mount (root, outside restrictive
  containers)."""
  os.makedirs(at)
  made = subprocess.run(['mount', '--bind', path, at], capture_output=True,
                        check=False)
  if made.returncode:
    pytest.skip(f'cannot bind-mount here: {made.stderr.decode().strip()}')
  try:
    subprocess.run(['mount', '-o', 'remount,bind,ro', at], check=True,
                   capture_output=True)
    try:  # The mount is really read-only, for root too.
      with open(os.path.join(at, '.probe'), 'w'):
        pass
    except OSError as e:
      assert e.errno == errno.EROFS, e
    else:
      raise AssertionError(f'{at} is writable after a read-only remount')
    yield at
  finally:
    subprocess.run(['umount', at], check=False)
