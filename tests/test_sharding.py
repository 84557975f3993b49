"""Shardings of parameters, optimizer state and batch follow the logical-axis rules."""

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from configs import digits
from train.training import aot
from train.training import input_pipeline
from train.training import sharding as sharding_lib
from train.errors import ConfigError
from train.vision import datasets
from train.vision import experiment


@pytest.fixture(scope='module')
def exp_and_state(tmp_path_factory):
  config = digits.get_config('runlocal')
  config.mesh.shape = (4, 2)
  exp = experiment.build(config, str(tmp_path_factory.mktemp('wd')))
  return exp, exp.init_state()


def _specs(tree):
  return jax.tree.map(lambda a: a.sharding.spec, tree)


def test_parameters_follow_the_rules(exp_and_state):
  exp, state = exp_and_state
  specs = _specs(state.params)
  # rules: conv_out, hidden -> 'model'; conv_in, flat, classes -> replicated.
  assert specs['conv0']['kernel'] == P(None, None, None, 'model')
  assert specs['conv1']['kernel'] == P(None, None, None, 'model')
  assert specs['hidden']['kernel'] == P(None, 'model')
  assert specs['hidden']['bias'] == P('model')
  assert specs['head']['kernel'] == P('model', None)
  assert specs['head']['bias'] == P(None)
  assert specs['bn0']['scale'] == P('model')
  # The large kernels are really split: each device holds half the columns.
  kernel = state.params['hidden']['kernel']
  shard_shapes = {s.data.shape for s in kernel.addressable_shards}
  assert shard_shapes == {(kernel.shape[0], kernel.shape[1] // 2)}
  assert len(kernel.addressable_shards) == 8
  # BatchNorm statistics carry no annotation: replicated.
  for leaf in jax.tree.leaves(state.batch_stats):
    assert leaf.sharding.is_fully_replicated
  del exp


def test_optimizer_state_is_sharded_like_the_parameters(exp_and_state):
  _, state = exp_and_state
  param_specs = _specs(state.params)
  is_trace = lambda x: isinstance(x, optax.TraceState)
  traces = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_trace)
            if is_trace(s)]
  assert len(traces) == 1
  assert _specs(traces[0].trace) == param_specs
  for leaf in (state.step, state.skipped_steps):
    assert leaf.sharding.is_fully_replicated


def test_batch_is_split_over_data_and_replicated_over_model(exp_and_state):
  exp, _ = exp_and_state
  batch = {'image': np.zeros((64, 8, 8, 1), np.uint8),
           'label': np.zeros((64,), np.int32)}
  placed = input_pipeline.to_global(batch, exp.batch_sharding)
  assert placed['image'].sharding.spec == P('data')
  shards = placed['image'].addressable_shards
  assert {s.data.shape for s in shards} == {(16, 8, 8, 1)}
  # Devices that differ only in their 'model' coordinate hold the same rows.
  assert len({str(s.index) for s in shards}) == 4


@pytest.mark.parametrize('data_on_device', [True, False])
def test_train_step_keeps_the_shardings_and_both_data_paths_agree(
    exp_and_state, data_on_device):
  exp, _ = exp_and_state
  train_data = datasets.load_split('digits', 'train', None)
  exp.config.device_data_max_mb = 256 if data_on_device else 0
  compiled = aot.compile_steps(exp, train_data)
  assert compiled.data_on_device == data_on_device
  batches = input_pipeline.TrainBatches(train_data, exp.config.batch_size, 0)
  host_batch = next(batches.iterate(3, 4, indices_only=data_on_device))
  state = exp.init_state()
  before = _specs(state)
  new_state, metrics = compiled.train(
      state, input_pipeline.to_global(host_batch, exp.batch_sharding), 0)
  assert _specs(new_state) == before
  assert metrics['loss'].sharding.spec == P('data')
  # Both paths see the same examples: the loss of step 3 is the same.
  ref = jax.jit(lambda s, b: exp.model.apply(
      {'params': s.params, 'batch_stats': s.batch_stats}, b['image'],
      train=True, mutable=['batch_stats'])[0])(
          exp.init_state(), batches.local_batch(3))
  want = optax.softmax_cross_entropy_with_integer_labels(
      ref, batches.local_batch(3)['label'])
  np.testing.assert_allclose(np.asarray(metrics['loss']), want, rtol=1e-5)


def test_mesh_shape_resolution_and_errors():
  assert sharding_lib.mesh_shape((-1, 2), ('data', 'model'), 8) == (4, 2)
  assert sharding_lib.mesh_shape((8, 1), ('data', 'model'), 8) == (8, 1)
  with pytest.raises(ConfigError, match=r'config.mesh.shape=\(3, 2\): needs 6 '
                     r'devices but there are 8'):
    sharding_lib.mesh_shape((3, 2), ('data', 'model'), 8)
  with pytest.raises(ConfigError, match='cannot be split'):
    sharding_lib.mesh_shape((-1, 3), ('data', 'model'), 8)
  with pytest.raises(ConfigError, match='one size per axis'):
    sharding_lib.mesh_shape((8,), ('data', 'model'), 8)


def test_a_dimension_that_does_not_divide_is_reported(tmp_path):
  config = digits.get_config('runlocal')
  config.mesh.shape = (1, 8)
  config.model.hidden = 36
  with pytest.raises(ConfigError, match=r"of shape \(36,?.*mesh axis "
                     r"'model' of size 8"):
    experiment.build(config, str(tmp_path))
