"""Damage done to a saved Orbax checkpoint, as disks and careless hands do
it, and the bit-for-bit comparison of what a restore gives back.

Shared by the core's checkpoint tests (test_checkpoint_damage, on a small
state) and the trainer's end-to-end ones (test_workdir_faults).
"""

import os
import random

import jax
import numpy as np
import tensorstore as ts


def step_dir(workdir: str, step: int) -> str:
  return os.path.join(workdir, 'checkpoints', str(step))


def data_files(workdir: str, step: int) -> list[str]:
  """The array data files of a checkpoint (OCDBT's `d/` files)."""
  root = os.path.join(step_dir(workdir, step), 'state')
  return sorted(os.path.join(d, f) for d, _, files in os.walk(root)
                for f in files if os.sep + 'd' + os.sep in os.path.join(d, f))


def flip_bit(path: str, rng: random.Random) -> None:
  """Flips one random bit of the file at `path`."""
  size = os.path.getsize(path)
  offset, bit = rng.randrange(size), rng.randrange(8)
  with open(path, 'r+b') as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ (1 << bit)]))


def _state_root(workdir: str, step: int) -> dict:
  return {'driver': 'file',
          'path': os.path.join(step_dir(workdir, step), 'state/')}


def arrays(workdir: str, step: int) -> list[str]:
  """The names of the arrays stored in a checkpoint (e.g. 'params.bn0.scale')."""
  store = ts.KvStore.open({'driver': 'ocdbt',
                           'base': _state_root(workdir, step)}).result()
  return sorted(k.decode()[:-len('/.zarray')] for k in store.list().result()
                if k.endswith(b'/.zarray'))


def flip_stored_bit(workdir: str, step: int, array: str,
                    rng: random.Random) -> None:
  """Flips one bit of one element of `array` through tensorstore: the
  storage's own checks (OCDBT's CRCs) pass; only the fingerprint can tell."""
  stored = ts.open({'driver': 'zarr', 'kvstore': {
      'driver': 'ocdbt', 'path': f'{array}/',
      'base': _state_root(workdir, step)}}).result()
  values = np.array(stored.read().result())
  bits = values.reshape(-1).view(f'u{values.dtype.itemsize}')
  bits[rng.randrange(bits.size)] ^= np.array(
      1 << rng.randrange(8 * values.dtype.itemsize), bits.dtype)
  stored[...] = values
  stored.read().result()  # The write is complete.


KINDS = ('flipped_bit', 'truncated', 'garbage_metadata', 'torn_meta')


def damage(kind: str, workdir: str, step: int,
           array: str = 'params.conv1.kernel', seed: int = 0) -> None:
  """Damages the checkpoint at `step` of `workdir` as `kind` (one of
  KINDS) says; 'flipped_bit' flips a bit of `array`'s values (by default
  the first kernel of the trainer's CNN, and of test_checkpoint_damage's
  state)."""
  rng = random.Random(seed)
  ckpt = step_dir(workdir, step)
  if kind == 'flipped_bit':
    flip_stored_bit(workdir, step, array, rng)
  elif kind == 'truncated':
    for path in data_files(workdir, step):
      os.truncate(path, os.path.getsize(path) // 3)
  elif kind == 'garbage_metadata':
    with open(os.path.join(ckpt, 'state', '_METADATA'), 'wb') as f:
      f.write(bytes(rng.randrange(256) for _ in range(4096)))
  elif kind == 'torn_meta':
    with open(os.path.join(ckpt, 'meta', 'metadata'), 'w') as f:
      f.write('{"config": "{\\"seed')
  else:
    raise ValueError(f'kind={kind!r}; valid choices: {KINDS}')


def snapshot(root: str, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
  """Every file's bytes under `root`, by relative path, but those named in
  `skip`."""
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      if name in skip:
        continue
      path = os.path.join(dirpath, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def assert_same_tree(a, b) -> None:
  """`a` and `b` hold the same leaves, bit for bit and of the same dtypes
  (the first that differs is named by its path)."""
  leaves_a = jax.tree_util.tree_leaves_with_path(a)
  leaves_b = jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for (path, x), y in zip(leaves_a, leaves_b):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and np.array_equal(x, y), (
        jax.tree_util.keystr(path))
