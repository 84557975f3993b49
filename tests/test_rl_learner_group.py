"""The learner group's pieces in one process (train.rl.learner_group,
train.rl.processes' roles): the views between a process's devices and the
group's, the layout checks, and how a job splits into roles. The loopback
job with two learner processes is in test_rl_multihost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train.errors import ConfigError
from train.rl import learner_group
from train.rl import processes


def _pointers(x):
  return sorted(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)


def test_views_share_the_buffers_and_the_values():
  devices = np.array(jax.devices())
  group = NamedSharding(Mesh(devices, ('data',)), P())
  # This process's own view lists its devices in another order.
  local = NamedSharding(Mesh(devices[::-1], ('data',)), P())
  rng = np.random.default_rng(0)
  tree = {'w': jax.device_put(rng.normal(size=(3, 5)).astype(np.float32),
                              local),
          'b': jax.device_put(jnp.asarray(rng.normal(size=(7,)),
                                          jnp.bfloat16), local),
          'empty': jax.device_put(np.zeros((0, 4), np.float32), local)}
  shardings = jax.tree.map(lambda _: group, tree)
  on_group = learner_group.global_view(tree, shardings)
  back = learner_group.local_view(on_group, local)
  for name in tree:
    assert on_group[name].sharding == group
    assert back[name].sharding == local
    assert back[name].dtype == tree[name].dtype
    np.testing.assert_array_equal(np.asarray(back[name]),
                                  np.asarray(tree[name]))
    if tree[name].size:  # No copy either way.
      assert _pointers(on_group[name]) == _pointers(tree[name])
      assert _pointers(back[name]) == _pointers(tree[name])


def test_a_step_places_the_batch_over_the_group_and_returns_local_views():
  devices = np.array(jax.devices())
  mesh = Mesh(devices, ('data',))
  group = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, P('data'))
  local = NamedSharding(Mesh(devices[:], ('data',)), P())

  def update(params, opt_state, batch, reference):
    grad = jnp.mean(batch[:, None] * reference['w'], axis=0)
    return ({'w': params['w'] - grad}, opt_state + 1,
            {'mean': jnp.mean(batch)})

  compiled = jax.jit(update, out_shardings=(
      {'w': group}, group, {'mean': group})).lower(
          {'w': jax.ShapeDtypeStruct((4,), jnp.float32, sharding=group)},
          jax.ShapeDtypeStruct((), jnp.int32, sharding=group),
          jax.ShapeDtypeStruct((16,), jnp.float32, sharding=rows),
          {'w': jax.ShapeDtypeStruct((4,), jnp.float32, sharding=group)}
      ).compile()
  g = learner_group.Group(mesh, {'w': group}, group, rows, local, compiled)
  batch = np.arange(16, dtype=np.float32)
  w = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
  reference = g.group_reference({'w': jax.device_put(w, local)})
  params, count, m = g.step({'w': jax.device_put(w, local)},
                            jax.device_put(np.int32(2), local), batch,
                            reference)
  np.testing.assert_allclose(np.asarray(params['w']), w - 7.5 * w)
  assert int(count) == 3 and float(m['mean']) == 7.5
  assert params['w'].sharding == local


def test_wait_ready_runs_the_check_until_the_step_is_done():
  calls = []
  x = jax.jit(lambda a: a @ a)(jnp.ones((256, 256)))
  assert learner_group.wait_ready({'x': x}, lambda: calls.append(1)) == {
      'x': x}

  class Never:
    def is_ready(self):
      return False

  def dead():
    raise RuntimeError('process 2 (learner) stopped responding')
  with pytest.raises(RuntimeError, match='process 2'):
    learner_group.wait_ready([Never()], dead)


def test_the_group_keeps_the_policy_replicated_and_the_rows_even():
  mesh = Mesh(np.array(jax.devices()), ('data',))
  replicated = {'w': NamedSharding(mesh, P())}
  learner_group.check_replicated(replicated, 64, mesh)
  with pytest.raises(ConfigError, match=r"^config.learner_mesh='shards the "
                     r"policy': a learner over several processes keeps"):
    learner_group.check_replicated({'w': NamedSharding(mesh, P('data'))},
                                   64, mesh)
  with pytest.raises(ConfigError, match=r'^config.prompts_per_batch=12: .* '
                     r"12 rows must split evenly over the learner group's 8 "
                     'devices'):
    learner_group.check_replicated(replicated, 12, mesh)


def test_roles_of_a_job_with_a_learner_group():
  roles = [processes.Roles(p, 5, 2) for p in range(5)]
  assert [r.role(p) for r in roles[:1] for p in range(5)] == [
      'rollout', 'rollout', 'learner', 'learner', 'learner']
  assert roles[0].learner == 2 and list(roles[0].learners) == [2, 3, 4]
  assert [r.is_learner for r in roles] == [False, False, True, False, False]
  assert [r.is_follower for r in roles] == [False, False, False, True, True]
  assert list(roles[0].followers) == [3, 4]
  # One learner process: the lead is the last process, as before groups.
  one = processes.Roles(2, 3, 2)
  assert one.is_learner and not one.is_follower and list(one.learners) == [2]
  assert not one.followers
  assert processes.learner_group_size(2, 5) == 3
  assert processes.learner_group_size(None, 5) == 1
  assert processes.learner_group_size(1, 1) == 1


@pytest.mark.parametrize('value', [0, 3, -1, True, 1.5, '1'])
def test_rollout_processes_out_of_range_is_one_line(value):
  with pytest.raises(ConfigError, match=r'^config.rollout_processes=.*: must '
                     r'be in \[1, 2\] with 3 processes: processes 0..R-1 '
                     'generate, the others learn$'):
    processes.check_rollout_processes(value, 3)
  processes.check_rollout_processes(1, 3)
  processes.check_rollout_processes(2, 3)
