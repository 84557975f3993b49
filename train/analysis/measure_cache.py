"""A study's measures cached on disk, one JSON record per measure.

`cached(path, identity, compute)`: the record at `path` if it was made
with `identity` (settings, config, model file), else `compute()`'s,
written atomically with its identity; a record of another identity is
refused (UsageError naming --workdir), never overwritten: a study's
workdir is its user's data, and a rerun with other settings belongs in
another one.
"""

import json
import os
from typing import Any, Callable

from train import fileio
from train.errors import UsageError

__all__ = ['cached', 'write_json']


def write_json(path: str, value: Any) -> None:
  fileio.write_text_atomic(path, json.dumps(value, indent=1,
                                            sort_keys=True) + '\n')


def cached(path: str, identity: dict, compute: Callable[[], dict],
           root: str | None = None) -> dict:
  """The record at `path` made with `identity`, or computed and written.

  Args:
    path: the record's file.
    identity: what the measure depends on (JSON-serialisable).
    compute: gives the record's fields.
    root: the study's workdir, for messages (default: `path`'s
      grandparent, a `<workdir>/measures/<name>.json` layout).

  Raises:
    UsageError: `path` holds a record of another identity.
  """
  if os.path.exists(path):
    record = json.loads(fileio.read_text(path))
    if record.get('identity') != identity:
      raise UsageError('--workdir', root or os.path.dirname(
          os.path.dirname(path)), f'{os.path.basename(path)} was measured '
                       'with other settings or another model file; use '
                       'another workdir')
    return record
  record = dict(compute(), identity=identity)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  write_json(path, record)
  return record
