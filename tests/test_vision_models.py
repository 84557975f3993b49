"""The SAM recipes' models (WRN, ResNet v1.5): published parameter counts, a
float64 numpy forward pass, BatchNorm in training and evaluation, bfloat16,
logical axes and channel sharding on a ('data', 'model') mesh."""

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from train.training import sharding as sharding_lib
from train.errors import ConfigError
from train.vision import models


def _model(num_classes=10, **fields):
  return models.create_model(ml_collections.ConfigDict(fields), num_classes,
                             255.0)


def _images(n, size, channels=3, seed=0):
  return np.random.default_rng(seed).integers(
      0, 256, (n, size, size, channels), dtype=np.uint8)


def _init(model, size, channels=3):
  """The model's own initialisation, jitted (op by op it takes seconds on
  8 CPU devices). The 'rbg' key compiles 5x faster than threefry here;
  forward-pass tests use `_random_variables` and compile no init at all."""
  return jax.jit(lambda: model.init(
      jax.random.key(0, impl='rbg'),
      jnp.zeros((1, size, size, channels), jnp.uint8), train=False))()


def _random_variables(model, size, seed=1):
  """Variables of the model's tree and shapes, every value random (BN
  scales away from 0 and 1, variances positive), so a reference checks
  each one's place; made in numpy from `jax.eval_shape`."""
  abstract = nn.meta.unbox(jax.eval_shape(lambda: _init(model, size)))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    r = rng.standard_normal(leaf.shape).astype(np.float32)
    if name.endswith("['var']") or name.endswith("['scale']"):
      return 0.5 + np.abs(r)
    if 'kernel' in name:
      return r * np.float32(np.sqrt(2.0 / np.prod(leaf.shape[:-1])))
    return 0.1 * r

  return jax.tree_util.tree_map_with_path(draw, abstract)


def _apply(model, variables, images, train=False):
  fn = jax.jit(lambda v, x: model.apply(
      v, x, train=train, mutable=['batch_stats'] if train else False))
  return fn(variables, images)


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# Published counts (weights, biases, BN scales and offsets): Zagoruyko &
# Komodakis (WRN-28-10 on CIFAR-10, 36.5M) and torchvision's ResNets.
@pytest.mark.parametrize('fields,num_classes,size,published', [
    (dict(name='wrn'), 10, 32, 36_479_194),
    (dict(name='resnet'), 1000, 224, 25_557_032),
    (dict(name='resnet', block='basic', stage_sizes=(2, 2, 2, 2)), 1000, 224,
     11_689_512),
    (dict(name='resnet', block='basic', stage_sizes=(3, 4, 6, 3)), 1000, 224,
     21_797_672),
    (dict(name='resnet', stage_sizes=(3, 4, 23, 3)), 1000, 224, 44_549_160),
])
def test_parameter_counts_are_the_published_ones(fields, num_classes, size,
                                                 published):
  model = _model(num_classes, **fields)
  variables = jax.eval_shape(lambda: _init(model, size))
  assert _count(variables['params']) == published


# A float64 numpy reference, written from the papers, not from the models.

def _same_pads(size, kernel, stride):
  """TF/Flax 'SAME' padding: output ceil(size / stride), extra pad after."""
  out = -(-size // stride)
  total = max((out - 1) * stride + kernel - size, 0)
  return (total // 2, total - total // 2)


def _conv(x, kernel, stride=1, pads=None):
  kh, kw = kernel.shape[:2]
  if pads is None:
    pads = (_same_pads(x.shape[1], kh, stride),
            _same_pads(x.shape[2], kw, stride))
  x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
  h = (x.shape[1] - kh) // stride + 1
  w = (x.shape[2] - kw) // stride + 1
  return sum(x[:, a:a + stride * (h - 1) + 1:stride,
               b:b + stride * (w - 1) + 1:stride] @ kernel[a, b]
             for a in range(kh) for b in range(kw))


def _max_pool_3x3_stride_2(x):
  pads = (_same_pads(x.shape[1], 3, 2), _same_pads(x.shape[2], 3, 2))
  x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=-np.inf)
  h, w = (x.shape[1] - 3) // 2 + 1, (x.shape[2] - 3) // 2 + 1
  return np.max([x[:, a:a + 2 * (h - 1) + 1:2, b:b + 2 * (w - 1) + 1:2]
                 for a in range(3) for b in range(3)], axis=0)


def _bn(x, params, stats):
  return ((x - stats['mean']) / np.sqrt(stats['var'] + 1e-5)
          * params['scale'] + params['bias'])


relu = lambda x: np.maximum(x, 0)


def _wrn_reference(p, s, images, depth, k):
  x = _conv(images / 255.0, p['stem']['kernel'])
  channels = 16
  for g, width in enumerate((16 * k, 32 * k, 64 * k)):
    for b in range((depth - 4) // 6):
      stride = 2 if g > 0 and b == 0 else 1
      name = f'group{g}_block{b}'
      q, t = p[name], s[name]
      y = relu(_bn(x, q['bn1'], t['bn1']))
      projected = channels != width or stride != 1
      assert ('shortcut' in q) == projected
      shortcut = (_conv(y, q['shortcut']['kernel'], stride) if projected
                  else x)
      y = _conv(y, q['conv1']['kernel'], stride)
      y = relu(_bn(y, q['bn2'], t['bn2']))
      x = _conv(y, q['conv2']['kernel']) + shortcut
      channels = width
  x = relu(_bn(x, p['final_bn'], s['final_bn'])).mean(axis=(1, 2))
  return x @ p['head']['kernel'] + p['head']['bias']


def _resnet_reference(p, s, images, stage_sizes, width):
  x = _conv(images / 255.0, p['stem_conv']['kernel'], 2, ((3, 3), (3, 3)))
  x = _max_pool_3x3_stride_2(relu(_bn(x, p['stem_bn'], s['stem_bn'])))
  for i, size in enumerate(stage_sizes):
    for j in range(size):
      stride = 2 if i > 0 and j == 0 else 1
      w = width * 2**i
      q, t = p[f'stage{i}_block{j}'], s[f'stage{i}_block{j}']
      y = relu(_bn(_conv(x, q['conv1']['kernel']), q['bn1'], t['bn1']))
      # v1.5: the stride is on the 3x3 convolution.
      y = relu(_bn(_conv(y, q['conv2']['kernel'], stride), q['bn2'],
                   t['bn2']))
      y = _bn(_conv(y, q['conv3']['kernel']), q['bn3'], t['bn3'])
      if x.shape[-1] != 4 * w or stride != 1:
        x = _bn(_conv(x, q['proj_conv']['kernel'], stride), q['proj_bn'],
                t['proj_bn'])
      else:
        assert 'proj_conv' not in q
      x = relu(y + x)
  x = x.mean(axis=(1, 2))
  return x @ p['head']['kernel'] + p['head']['bias']


def _as_f64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def test_wide_resnet_matches_a_numpy_forward_pass():
  model = _model(depth=10, widen_factor=1, name='wrn')
  variables = _random_variables(model, 8)
  images = _images(3, 8)
  got = _apply(model, variables, images)
  want = _wrn_reference(_as_f64(variables['params']),
                        _as_f64(variables['batch_stats']),
                        images.astype(np.float64), depth=10, k=1)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_resnet_matches_a_numpy_forward_pass():
  model = _model(name='resnet', stage_sizes=(2, 1), width=4)
  variables = _random_variables(model, 16)
  images = _images(3, 16)
  got = _apply(model, variables, images)
  want = _resnet_reference(_as_f64(variables['params']),
                           _as_f64(variables['batch_stats']),
                           images.astype(np.float64), (2, 1), 4)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_resnet_blocks_start_as_the_identity_with_zero_init_residual():
  """The last BN of every block starts at scale 0 (Goyal et al. 2017), so
  at initialisation a block passes on relu(its shortcut)."""
  params = nn.meta.unbox(_init(_model(name='resnet', stage_sizes=(2, 1),
                                      width=4), 16)['params'])
  for block in ('stage0_block0', 'stage0_block1', 'stage1_block0'):
    assert np.all(params[block]['bn3']['scale'] == 0.0)
    assert np.all(params[block]['bn3']['bias'] == 0.0)
    for norm in ('bn1', 'bn2'):
      assert np.all(params[block][norm]['scale'] == 1.0)
  assert np.all(params['stage1_block0']['proj_bn']['scale'] == 1.0)


@pytest.mark.parametrize('fields,size', [
    (dict(name='wrn', depth=10, widen_factor=2), 12),
    (dict(name='resnet', stage_sizes=(1, 1), width=4, block='basic'), 32),
])
def test_batch_norm_uses_batch_statistics_only_in_training(fields, size):
  model = _model(**fields)
  variables = _random_variables(model, size)
  images = _images(4, size)
  other = images.copy()
  other[1:] = _images(3, size, seed=7)
  # Training: example 0's output depends on the rest of its batch, and the
  # running statistics move.
  out, updates = _apply(model, variables, images, train=True)
  out_other, _ = _apply(model, variables, other, train=True)
  assert not np.allclose(out[0], out_other[0], atol=1e-6)
  moved = jax.tree.map(lambda a, b: not np.allclose(a, b),
                       updates['batch_stats'], variables['batch_stats'])
  assert all(jax.tree.leaves(moved))
  # Evaluation: each example alone, through the running averages.
  ev = _apply(model, variables, images)
  ev_other = _apply(model, variables, other)
  np.testing.assert_allclose(ev[0], ev_other[0], rtol=1e-6)


def test_running_statistics_follow_the_first_norms_input():
  """The first BN of a WRN normalises the stem's output: after one training
  step its running mean and variance are 0.9 * init + 0.1 * the batch's,
  with the stem convolution done in numpy."""
  model = _model(name='wrn', depth=10, widen_factor=1)
  variables = _random_variables(model, 8)
  # The statistics' initial values (Flax's: mean 0, variance 1).
  variables['batch_stats'] = jax.tree.map(
      lambda x: np.zeros_like(x), variables['batch_stats'])
  stats = variables['batch_stats']['group0_block0']['bn1']
  stats['var'] = np.ones_like(stats['var'])
  images = _images(6, 8)
  _, updates = _apply(model, variables, images, train=True)
  stem = np.asarray(variables['params']['stem']['kernel'], np.float64)
  x = _conv(images.astype(np.float64) / 255.0, stem)
  stats = updates['batch_stats']['group0_block0']['bn1']
  np.testing.assert_allclose(stats['mean'], 0.1 * x.mean(axis=(0, 1, 2)),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(stats['var'],
                             0.9 + 0.1 * x.var(axis=(0, 1, 2)), rtol=1e-4)


@pytest.mark.parametrize('fields,size', [
    (dict(name='wrn', depth=10, widen_factor=1), 8),
    (dict(name='resnet', stage_sizes=(1, 1), width=4), 32),
])
def test_bfloat16_computes_with_float32_parameters_and_logits(fields, size):
  full = _model(**fields)
  half = _model(dtype='bfloat16', **fields)
  abstract = jax.eval_shape(lambda: _init(half, size))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(abstract))
  variables = _random_variables(half, size)
  images = _images(4, size)
  want = _apply(full, variables, images)
  got = _apply(half, variables, images)
  assert got.dtype == jnp.float32 and got.shape == (4, 10)
  # bfloat16 keeps 8 bits of mantissa: close, not equal.
  assert not np.array_equal(got, want)
  np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
  jaxpr = str(jax.make_jaxpr(lambda v, x: half.apply(v, x, train=False))(
      variables, images))
  assert 'bf16' in jaxpr


@pytest.mark.parametrize('fields,size', [
    (dict(name='wrn', depth=10, widen_factor=2), 8),
    (dict(name='resnet', stage_sizes=(2, 1), width=4), 16),
])
def test_every_parameter_has_logical_axes(fields, size):
  boxed = jax.eval_shape(lambda: _init(_model(**fields), size))['params']
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert leaves
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    assert isinstance(leaf, nn.Partitioned), name
    assert len(leaf.names) == leaf.value.ndim, name
    if name.endswith("['kernel']") and leaf.value.ndim == 4:
      assert leaf.names == (None, None, 'conv_in', 'conv_out'), name
    elif "['head']" in name:
      assert leaf.names[-1] == 'classes', name
    else:  # BatchNorm scales and offsets: the channel axis.
      assert leaf.names == ('conv_out',), name


def test_channels_shard_over_the_model_axis_and_the_output_is_unchanged():
  """On a (4, 2) ('data', 'model') mesh with channels over 'model', conv
  kernels and norms are split in two, and the forward pass equals one
  device's."""
  model = _model(name='resnet', stage_sizes=(2, 1), width=4)
  mesh = jax.make_mesh((4, 2), ('data', 'model'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = [('batch', 'data'), ('conv_in', None), ('conv_out', 'model'),
           ('classes', None)]
  boxed = jax.eval_shape(lambda: _init(model, 16))
  shardings = {'params': sharding_lib.logical_to_shardings(
      boxed['params'], mesh, rules),
               'batch_stats': sharding_lib.logical_to_shardings(
                   boxed['batch_stats'], mesh, rules)}
  local = _random_variables(model, 16)
  variables = jax.device_put(local, shardings)
  kernel = variables['params']['stage1_block0']['conv2']['kernel']
  assert kernel.sharding.spec == P(None, None, None, 'model')
  assert kernel.addressable_shards[0].data.shape == (3, 3, 8, 4)
  scale = variables['params']['stage1_block0']['bn3']['scale']
  assert scale.sharding.spec == P('model')
  assert scale.addressable_shards[0].data.shape == (16,)
  images = _images(8, 16)
  batch = jax.device_put(images, NamedSharding(mesh, P('data')))
  got = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables,
                                                              batch)
  want = _apply(model, local, images)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('fields,match', [
    (dict(name='wrn', depht=28),
     r"config.model.depht=28: not a field of model 'wrn'; valid choices: "
     r"'depth', 'dtype', 'widen_factor'"),
    (dict(name='wrn', depth=27),
     r'config.model.depth=27: a WRN is 6n \+ 4 layers deep.*valid choices: '
     r'10, 16, 22, 28'),
    (dict(name='wrn', widen_factor=0),
     r'config.model.widen_factor=0: must be a positive integer'),
    (dict(name='wrn', dtype='float16'),
     r"config.model.dtype='float16': unknown activation dtype.*valid "
     r"choices: 'float32', 'bfloat16'"),
    (dict(name='resnet', block='wide'),
     r"config.model.block='wide': unknown residual block; valid choices: "
     r"'bottleneck', 'basic'"),
    (dict(name='resnet', stage_sizes=()),
     r'config.model.stage_sizes=\(\): blocks per stage'),
    (dict(name='resnet', stage_sizes=(3, 0)),
     r'config.model.stage_sizes=\(3, 0\): blocks per stage'),
    (dict(name='resnet', width=-4),
     r'config.model.width=-4: must be a positive integer'),
    (dict(name='resnet50'),
     r"config.model.name='resnet50': unknown model; valid choices: 'cnn', "
     r"'mlp', 'resnet', 'wrn'"),
    (dict(name='mlp', widths=(256, -1)),
     r'config.model.widths=\(256, -1\): units per hidden layer: a non-empty'),
    (dict(name='mlp', widths=()),
     r'config.model.widths=\(\): units per hidden layer'),
    (dict(name='cnn', features=()),
     r'config.model.features=\(\): channels per conv block'),
])
def test_bad_model_settings_name_the_field_and_the_choices(fields, match):
  with pytest.raises(ConfigError, match=match):
    _model(**fields)
