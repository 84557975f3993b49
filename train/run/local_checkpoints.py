"""Checkpoints that one process writes alone: for a run on part of a JAX job.

Orbax coordinates every save and restore over all processes of the job
(its barriers, and its numpy and scalar writers run on process 0 only;
with `active_processes` set it refuses arrays held by fewer processes).
The learner of a multi-process RL job is a subset of the job, so it saves
here instead, in the same guarantees as `train.run.checkpointing.Checkpoints`
(whose interface this is):

- atomic: a step is written into `<step>.tmp-<pid>` and renamed to
  `<step>` when complete (files fsync-ed first); leftovers of a crash are
  removed when the directory is opened for writing;
- verified: the arrays' fingerprints (`train.run.checksums`) and the
  metadata's digest are saved with them and checked on restore, and a
  damaged step is skipped and moved aside by `restore_latest_good`;
- the newest `keep` steps are kept.

A step holds `arrays.npz` (the tree's leaves, in order, as host arrays)
and `meta.json` (the metadata, with the leaves' key paths, shapes and
dtypes). Saves are synchronous: the device-to-host copy and the write
happen in `save`. The arrays are the whole of each leaf, so a step
restores onto any mesh (any process split of the learner).
"""

from collections.abc import Callable
import io
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.run import checkpoint_integrity as integrity
from train.run import checkpointing
from train.run import disk_space
from train import fileio
from train.run.checkpointing import DamagedCheckpoint

ARRAYS = 'arrays.npz'
META = 'meta.json'
FORMAT = 'geom-local-checkpoint-1'


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


class LocalCheckpoints(checkpointing.Checkpoints):
  """`workdir/checkpoints`, written and read by this process alone."""

  # pylint: disable=super-init-not-called
  def __init__(self, workdir: str, *, every_steps: int, keep: int,
               async_save: bool = False, read_only: bool = False):
    del async_save  # Saves are synchronous.
    self.workdir = fileio.absolute(workdir)
    if fileio.is_remote(self.workdir):
      raise ValueError(f'{self.workdir}: local checkpoints need a local '
                       'file system')
    self.directory = fileio.join(self.workdir, checkpointing.CHECKPOINTS)
    self._every = every_steps
    self._keep = keep
    self._read_only = read_only
    if not read_only:
      os.makedirs(self.directory, exist_ok=True)
      for name in os.listdir(self.directory):
        if '.tmp-' in name:
          shutil.rmtree(os.path.join(self.directory, name),
                        ignore_errors=True)

  def all_steps(self) -> list[int]:
    if not os.path.isdir(self.directory):
      return []
    return sorted(int(d) for d in os.listdir(self.directory) if d.isdigit())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    latest = self.latest_step()
    return step % self._every == 0 and (latest is None or step > latest)

  def save(self, step: int, state: Any, meta: dict[str, Any],
           force: bool = False) -> bool:
    if self._read_only:
      raise RuntimeError(f'{self.directory} is opened read-only')
    if not (force or self.should_save(step)) or step in self.all_steps():
      return False
    leaves = jax.tree_util.tree_leaves_with_path(state)
    needed = disk_space.tree_bytes(state) * 11 // 10 + 2**16
    disk_space.check_room(self.directory, needed)
    meta = integrity.sealed(meta, state)
    host = [np.asarray(jax.device_get(x)) for _, x in leaves]
    index = {'format': FORMAT, 'step': step, 'meta': meta,
             'leaves': [[jax.tree_util.keystr(p), list(h.shape), h.dtype.name]
                        for (p, _), h in zip(leaves, host)]}
    tmp = os.path.join(self.directory, f'{step}.tmp-{os.getpid()}')
    final = os.path.join(self.directory, str(step))
    try:
      os.makedirs(tmp)
      buffer = io.BytesIO()
      np.savez(buffer, *host)
      for name, data in ((ARRAYS, buffer.getvalue()),
                         (META, json.dumps(index).encode())):
        with open(os.path.join(tmp, name), 'wb') as f:
          f.write(data)
          f.flush()
          os.fsync(f.fileno())
      _fsync_dir(tmp)
      os.rename(tmp, final)
      _fsync_dir(self.directory)
    except OSError as e:
      shutil.rmtree(tmp, ignore_errors=True)
      full = disk_space.as_disk_full(e, self.workdir, needed, self.directory)
      if full is not None:
        raise full from e
      raise
    for old in self.all_steps()[:-self._keep]:
      shutil.rmtree(os.path.join(self.directory, str(old)),
                    ignore_errors=True)
    return True

  def _index(self, step: int) -> dict[str, Any]:
    path = os.path.join(self.directory, str(step), META)
    try:
      with fileio.open_local(path, 'rb', root=self.workdir) as f:
        index = json.loads(f.read())
    except fileio.SpecialFile:
      raise  # Not damage: a file put there, refused in one line.
    except (OSError, ValueError) as e:
      raise DamagedCheckpoint(step, f'{META} does not load ({e})') from e
    if not isinstance(index, dict) or index.get('format') != FORMAT:
      raise DamagedCheckpoint(step, f'{META} is not a {FORMAT} index')
    return index

  def restore_meta(self, step: int) -> dict[str, Any]:
    return integrity.verified_meta(step, self._index(step)['meta'])

  def restore(self, step: int, abstract_state: Any
              ) -> tuple[Any, dict[str, Any]]:
    index = self._index(step)
    meta = integrity.verified_meta(step, index['meta'])
    targets, treedef = jax.tree.flatten(abstract_state)
    if len(targets) != len(index['leaves']):
      raise DamagedCheckpoint(step, f'holds {len(index["leaves"])} arrays, '
                              f'the run {len(targets)}')
    try:
      with fileio.open_local(os.path.join(self.directory, str(step), ARRAYS),
                             'rb', root=self.workdir) as f, np.load(
                                 f, allow_pickle=False) as npz:
        host = [npz[f'arr_{i}'] for i in range(len(targets))]
    except fileio.SpecialFile:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise DamagedCheckpoint(step, f'{ARRAYS} does not load '
                              f'({type(e).__name__}: {e})') from e
    arrays = []
    for (path, shape, dtype), h, t in zip(index['leaves'], host, targets):
      try:
        dtype = jnp.dtype(dtype)
      except TypeError as e:
        raise DamagedCheckpoint(step, f'state{path}: unknown dtype '
                                f'{dtype!r}') from e
      if h.dtype.kind == 'V' and h.dtype.itemsize == dtype.itemsize:
        h = h.view(dtype)  # npz keeps ml_dtypes (bfloat16, ...) as bytes.
      if (list(h.shape) != shape or h.dtype != dtype
          or tuple(h.shape) != tuple(t.shape)
          or h.dtype != np.dtype(t.dtype)):
        raise DamagedCheckpoint(
            step, f'state{path} is {h.dtype}{list(h.shape)}, the run needs '
            f'{np.dtype(t.dtype)}{list(t.shape)}')
      arrays.append(jax.device_put(h, t.sharding))
    state = jax.tree.unflatten(treedef, arrays)
    integrity.check_arrays(step, state, meta, self.directory)
    return state, meta

  def _move_aside(self, damaged_steps: list[int]) -> None:
    aside = fileio.join(self.workdir, checkpointing.DAMAGED)
    os.makedirs(aside, exist_ok=True)
    for step in damaged_steps:
      target, n = os.path.join(aside, str(step)), 1
      while os.path.exists(target):
        target, n = os.path.join(aside, f'{step}.{n}'), n + 1
      os.rename(os.path.join(self.directory, str(step)), target)

  def wait_until_finished(self) -> None:
    pass

  def close(self) -> None:
    pass


def newest_is_local(workdir: str) -> bool | None:
  """Whether the newest checkpoint step in `workdir` is of this format
  (True) or Orbax's (False); None where there is none."""
  directory = fileio.join(fileio.absolute(workdir), checkpointing.CHECKPOINTS)
  if fileio.is_remote(directory) or not os.path.isdir(directory):
    return None
  steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
  if not steps:
    return None
  return os.path.exists(os.path.join(directory, str(steps[-1]), META))


def opener(local: bool) -> Callable[..., checkpointing.Checkpoints]:
  """The checkpoint class a run uses: local (this process alone) or Orbax."""
  return LocalCheckpoints if local else checkpointing.Checkpoints
