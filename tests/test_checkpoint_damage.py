"""Verified checkpoints (`train.run.checkpointing`), on a small sharded state.

What every loop gets from the core when a checkpoint is damaged: the
damage is caught (or what is restored is bit for bit what was saved), the
damaged step is named and moved aside as it was, and the restore falls
back to the step before. Tested here once, on a state of a few arrays of
different dtypes and layouts saved at steps 20 and 40; each loop keeps one
end-to-end test of a damaged checkpoint (test_workdir_faults through
launch.train; test_resumable on the toy loop and both back-ends).
"""

import json
import os
import random
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import checkpoint_damage
from tests import compile_events
from train import errors
from train.run import checkpointing

CONFIG = {'seed': 0, 'batch_size': 64, 'model': {'hidden': 64}}


def _state(step: int) -> dict:
  """A state like a trainer's: a sharded kernel, small replicated arrays,
  bfloat16 and integer leaves; its values depend on `step`."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2),
                           ('data', 'model'))
  sharded = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data', 'model'))
  keys = jax.random.split(jax.random.key(step), 3)
  return {
      'params': {
          'conv1': {'kernel': jax.device_put(
              jax.random.normal(keys[0], (8, 16), jnp.float32), sharded)},
          'bn0': {'scale': jax.random.normal(keys[1], (16,), jnp.float32)},
          'head': {'kernel': jax.random.normal(keys[2], (16, 10),
                                               jnp.bfloat16)},
      },
      'opt_state': {'count': jnp.asarray(step, jnp.int32)},
      'step': jnp.asarray(step, jnp.int32),
  }


def _abstract(state):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)


def _meta(config=None) -> dict:
  return {'config': json.dumps(CONFIG if config is None else config)}


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A workdir with verified checkpoints at steps 20 and 40."""
  workdir = str(tmp_path_factory.mktemp('saved'))
  with checkpointing.Checkpoints(workdir, every_steps=20, keep=3,
                                 async_save=False) as ckpts:
    for step in (20, 40):
      assert ckpts.save(step, _state(step), _meta())
  return workdir


def _copy(saved, tmp_path, keep_steps=(20, 40)) -> str:
  workdir = str(tmp_path / 'run')
  shutil.copytree(saved, workdir)
  for step in (20, 40):
    if step not in keep_steps:
      shutil.rmtree(checkpoint_damage.step_dir(workdir, step))
  return workdir


def _open(workdir):
  return checkpointing.Checkpoints(workdir, every_steps=20, keep=3)


@pytest.mark.parametrize('kind', checkpoint_damage.KINDS)
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(
    kind, saved, tmp_path):
  workdir = _copy(saved, tmp_path)
  checkpoint_damage.damage(kind, workdir, 40)
  damaged = checkpoint_damage.snapshot(
      checkpoint_damage.step_dir(workdir, 40))
  with _open(workdir) as ckpts:
    step, state, meta = ckpts.restore_latest_good(_abstract(_state(0)))
    assert step == 20
    assert ckpts.all_steps() == [20]  # Step 40 can be written again.
  assert json.loads(meta['config']) == CONFIG
  checkpoint_damage.assert_same_tree(jax.device_get(state), jax.device_get(_state(20)))
  # Moved aside as it was, not deleted.
  aside = os.path.join(workdir, checkpointing.DAMAGED, '40')
  assert checkpoint_damage.snapshot(aside) == damaged


def test_a_flipped_bit_in_the_saved_config_is_damage_not_a_new_config(
    saved, tmp_path):
  # One bit turns the saved seed 0 into 1 ('0' is 0x30, '1' 0x31). A run
  # read it as a changed config and advised resuming with the damaged
  # value; the saved metadata now carries its own digest.
  workdir = _copy(saved, tmp_path)
  path = os.path.join(checkpoint_damage.step_dir(workdir, 40), 'meta',
                      'metadata')
  with open(path, 'rb') as f:
    text = f.read()
  flipped = text.replace(b'{\\"seed\\": 0,', b'{\\"seed\\": 1,', 1)
  assert sum(bin(a ^ b).count('1') for a, b in zip(text, flipped)) == 1
  with open(path, 'wb') as f:
    f.write(flipped)
  # The config check a run makes before loading finds no config to compare.
  assert checkpointing.newest_meta(workdir) is None

  def check_meta(step, meta):
    if json.loads(meta['config']) != CONFIG:
      raise errors.UsageError(f'step {step}: a different config')

  with _open(workdir) as ckpts:
    step, state, _ = ckpts.restore_latest_good(_abstract(_state(0)),
                                               check_meta=check_meta)
  assert step == 20
  checkpoint_damage.assert_same_tree(jax.device_get(state), jax.device_get(_state(20)))
  assert os.listdir(os.path.join(workdir, checkpointing.DAMAGED)) == ['40']


@pytest.mark.parametrize('seed', range(6))
def test_a_bit_flip_anywhere_is_caught_or_changes_nothing_restored(
    saved, tmp_path, seed):
  # OCDBT keeps superseded b-tree nodes and index files that a restore does
  # not read: a flip there is harmless. The guarantee: what is restored is
  # bit for bit what was saved, or the checkpoint is refused.
  workdir = _copy(saved, tmp_path, keep_steps=(40,))
  rng = random.Random(seed)
  root = checkpoint_damage.step_dir(workdir, 40)
  files = sorted(os.path.join(d, f) for d, _, names in os.walk(root)
                 for f in names if os.path.getsize(os.path.join(d, f)))
  checkpoint_damage.flip_bit(rng.choice(files), rng)
  with _open(workdir) as ckpts:
    try:
      state, _ = ckpts.restore(40, _abstract(_state(0)))
    except checkpointing.DamagedCheckpoint as e:
      assert e.step == 40
      return
  checkpoint_damage.assert_same_tree(jax.device_get(state), jax.device_get(_state(40)))


@pytest.mark.parametrize('seed', range(4))
def test_a_flipped_bit_in_any_stored_array_is_caught_and_named(
    saved, tmp_path, seed):
  workdir = _copy(saved, tmp_path, keep_steps=(40,))
  rng = random.Random(seed)
  stored = checkpoint_damage.arrays(workdir, 40)
  assert len(stored) == 5, stored
  array = rng.choice(stored)
  checkpoint_damage.flip_stored_bit(workdir, 40, array, rng)
  with _open(workdir) as ckpts:
    with pytest.raises(checkpointing.DamagedCheckpoint,
                       match='step 40: checksum mismatch in 1 array') as e:
      ckpts.restore(40, _abstract(_state(0)))
  # Named as the state's path, e.g. state['params']['bn0']['scale'].
  parts = array.split('.')
  assert all(p in str(e.value) for p in parts), (array, str(e.value))


def test_no_good_checkpoint_names_each_step_and_changes_nothing(
    saved, tmp_path):
  workdir = _copy(saved, tmp_path)
  checkpoint_damage.damage('truncated', workdir, 40)
  checkpoint_damage.damage('torn_meta', workdir, 20)
  before = checkpoint_damage.snapshot(workdir)
  with _open(workdir) as ckpts:
    with pytest.raises(checkpointing.NoGoodCheckpoint) as e:
      ckpts.restore_latest_good(_abstract(_state(0)))
  text = str(e.value)
  assert text.startswith('no usable checkpoint in ')
  assert 'step 40: does not load' in text
  assert 'step 20: metadata does not load' in text
  assert e.value.exit_code == 4
  assert checkpoint_damage.snapshot(workdir) == before


def test_a_cpu_save_writes_each_replicated_array_whole(tmp_path):
  """Orbax's replica-parallel default would split each replicated array
  into 8 slices (an eager slice program per slice, compiled in every
  process); on CPU the array is saved whole, and restores bit for bit."""
  # Replicated over the 8 devices, in a shape no other test saves (no
  # slice program cached).
  replicated = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.devices()), ('data',)),
      jax.sharding.PartitionSpec())
  state = {'w': jax.device_put(jax.random.normal(
      jax.random.key(3), (56, 24), jnp.float32), replicated),
           'step': jnp.asarray(5, jnp.int32)}
  with compile_events.compiled() as compiled:
    with checkpointing.Checkpoints(str(tmp_path), every_steps=5, keep=1,
                                   async_save=False) as ckpts:
      assert ckpts.save(5, state, _meta())
  assert 'jit(slice)' not in compiled, compiled
  with _open(str(tmp_path)) as ckpts:
    _, restored, _ = ckpts.restore_latest_good(_abstract(state))
  np.testing.assert_array_equal(restored['w'], state['w'])
