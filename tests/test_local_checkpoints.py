"""`train.run.local_checkpoints`: the format itself (the run core's guarantees on
it are tested in test_resumable, on both checkpoint classes)."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from train.run import checkpointing
from train.run import disk_space
from train import errors
from train.run import local_checkpoints


def _state(seed: int = 0):
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  rng = np.random.default_rng(seed)
  tree = {
      'w': jax.device_put(rng.normal(size=(8, 6)).astype(np.float32),
                          NamedSharding(mesh, P('data', 'model'))),
      'b16': jax.device_put(rng.normal(size=(5,)).astype(ml_dtypes.bfloat16),
                            NamedSharding(mesh, P())),
      'count': jax.device_put(np.int32(seed), NamedSharding(mesh, P())),
      'layers': [jax.device_put(np.full((3,), seed, np.uint8),
                                NamedSharding(mesh, P()))],
  }
  return tree


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=x.sharding),
                      tree)


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.sharding == y.sharding
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                  np.atleast_1d(np.asarray(y)).view(np.uint8))


def test_a_step_restores_bit_exactly_onto_its_shardings(tmp_path):
  ckpts = local_checkpoints.LocalCheckpoints(str(tmp_path), every_steps=2,
                                             keep=2)
  state = _state(3)
  assert not ckpts.should_save(3) and ckpts.should_save(4)
  assert ckpts.save(4, state, {'note': [1, 'a']})
  assert not ckpts.should_save(4)  # Not again, nor an older step.
  restored, meta = ckpts.restore(4, _abstract(state))
  _equal(restored, state)
  assert meta['note'] == [1, 'a'] and checkpointing.CHECKSUMS in meta
  assert ckpts.restore_meta(4)['note'] == [1, 'a']


def test_keeps_the_newest_and_never_counts_a_half_written_step(tmp_path):
  ckpts = local_checkpoints.LocalCheckpoints(str(tmp_path), every_steps=1,
                                             keep=2)
  for step in (1, 2, 3):
    ckpts.save(step, _state(step), {})
  assert ckpts.all_steps() == [2, 3]
  leftover = tmp_path / 'checkpoints' / '4.tmp-123'
  leftover.mkdir()
  assert ckpts.latest_step() == 3
  local_checkpoints.LocalCheckpoints(str(tmp_path), every_steps=1, keep=2)
  assert not leftover.exists()  # Removed when opened for writing.


@pytest.mark.parametrize('where', ['file', 'value'])
def test_a_flipped_bit_in_an_array_is_damage_and_the_run_falls_back(
    tmp_path, where):
  ckpts = local_checkpoints.LocalCheckpoints(str(tmp_path), every_steps=1,
                                             keep=5)
  ckpts.save(1, _state(1), {})
  ckpts.save(2, _state(2), {})
  path = os.path.join(tmp_path, 'checkpoints', '2',
                      local_checkpoints.ARRAYS)
  if where == 'file':  # The zip's CRC finds it.
    data = bytearray(open(path, 'rb').read())
    target = np.asarray(_state(2)['w']).tobytes()[-4:]
    data[bytes(data).rindex(target)] ^= 0x01
    open(path, 'wb').write(bytes(data))
    reason = 'does not load'
  else:  # A well-formed file with one changed bit: the fingerprints find it.
    with np.load(path) as npz:
      arrays = [npz[name] for name in npz.files]
    w = next(a for a in arrays if a.shape == (8, 6))
    w.view(np.uint32)[-1, -1] ^= 1
    np.savez(path, *arrays)
    reason = 'checksum mismatch'
  with pytest.raises(checkpointing.DamagedCheckpoint, match=reason):
    ckpts.restore(2, _abstract(_state(2)))
  step, restored, _ = ckpts.restore_latest_good(_abstract(_state(1)))
  assert step == 1
  _equal(restored, _state(1))
  assert ckpts.all_steps() == [1]  # Step 2 was moved aside, not deleted.
  assert os.listdir(tmp_path / checkpointing.DAMAGED) == ['2']


def test_a_changed_saved_config_or_shape_is_damage(tmp_path):
  ckpts = local_checkpoints.LocalCheckpoints(str(tmp_path), every_steps=1,
                                             keep=5)
  ckpts.save(1, _state(1), {'config': '{"seed": 1}'})
  path = os.path.join(tmp_path, 'checkpoints', '1', local_checkpoints.META)
  text = open(path).read()
  open(path, 'w').write(text.replace('\\"seed\\": 1', '\\"seed\\": 0'))
  with pytest.raises(checkpointing.DamagedCheckpoint, match='checksum'):
    ckpts.restore_meta(1)
  open(path, 'w').write(text)
  wrong = _abstract(_state(1))
  wrong['w'] = jax.ShapeDtypeStruct((8, 5), jnp.float32,
                                    sharding=wrong['w'].sharding)
  with pytest.raises(checkpointing.DamagedCheckpoint, match=r'\[8, 5\]'):
    ckpts.restore(1, wrong)


def test_a_full_disk_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
  ckpts = local_checkpoints.LocalCheckpoints(str(tmp_path), every_steps=1,
                                             keep=5)
  ckpts.save(1, _state(1), {})
  monkeypatch.setattr(disk_space, 'free_bytes', lambda path: 100)
  with pytest.raises(errors.DiskFull, match='checkpoints up to step 1 are '
                     'intact'):
    ckpts.save(2, _state(2), {})
  assert os.listdir(tmp_path / 'checkpoints') == ['1']
