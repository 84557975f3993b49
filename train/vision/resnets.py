"""Residual networks of the SAM paper's recipes: Wide ResNets and ResNet v1.5.

`WideResNet` is WRN-depth-k of Zagoruyko & Komodakis (2016), the model of
the SAM paper's CIFAR results (WRN-28-10, 36.5M parameters): a 3x3 stem
with 16 channels, then three groups of (depth - 4) / 6 pre-activation
basic blocks (BN-ReLU-conv3x3-BN-ReLU-conv3x3) of widths 16k, 32k and 64k,
the last two starting with stride 2; a 1x1 convolution of the
pre-activated input is the shortcut where the shape changes. A final
BN-ReLU, global average pooling and a dense head end it.

`ResNet` is ResNet v1.5 (He et al. 2016, with the stride on the 3x3
convolution of a bottleneck, as in torchvision, flax's ImageNet example and
the SAM code): a 7x7 stride-2 stem, BN-ReLU, 3x3 stride-2 max pooling,
then stages of bottleneck (1x1, 3x3, 1x1 with 4x expansion) or basic
blocks; a 1x1 convolution and BN project the shortcut where the shape
changes. ResNet-50 is `stage_sizes=(3, 4, 6, 3)` with bottlenecks: 25.6M
parameters for 1000 classes.

The last BN of each ResNet block starts with scale 0
(`zero_init_residual`, default True), so every block starts as the
identity: Goyal et al. (2017) found this helps large-batch training, the
regime of the SAM paper's ImageNet runs (batch 4096), and the SAM code's
ResNet (forked from flax's example) does the same. A WRN block ends in a
convolution, not a BN, so the option does not apply to it.

Parameters carry logical axes (`train.vision.layers`): convolutions
(None, None, 'conv_in', 'conv_out'), norms ('conv_out',), the head
('conv_out', 'classes'); computation runs in `dtype` ('float32' or
'bfloat16'), parameters are float32 and the logits are returned as float32.
"""

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from train.errors import ConfigError
from train.vision import layers

BLOCKS = ('bottleneck', 'basic')


class PreActBlock(nn.Module):
  """A WRN block: BN-ReLU-conv3x3-BN-ReLU-conv3x3 plus the shortcut."""
  width: int
  strides: int = 1
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, *, train: bool):
    norm = lambda name: layers.batch_norm('conv_out', train, name,  # pylint: disable=g-long-lambda
                                          dtype=self.dtype)
    y = nn.relu(norm('bn1')(x))
    shortcut = x
    if x.shape[-1] != self.width or self.strides != 1:
      # Zagoruyko & Komodakis project the pre-activated input, so the
      # shortcut and the branch share the first BN-ReLU.
      shortcut = layers.conv(self.width, 1, 'shortcut', strides=self.strides,
                             dtype=self.dtype)(y)
    y = layers.conv(self.width, 3, 'conv1', strides=self.strides,
                    dtype=self.dtype)(y)
    y = nn.relu(norm('bn2')(y))
    y = layers.conv(self.width, 3, 'conv2', dtype=self.dtype)(y)
    return y + shortcut


class WideResNet(nn.Module):
  """WRN-depth-k for small images (see module docstring)."""
  num_classes: int
  depth: int = 28
  widen_factor: int = 10
  pixel_max: float = 255.0
  dtype: str = 'float32'

  @nn.compact
  def __call__(self, images, *, train: bool):
    dtype = layers.DTYPES[self.dtype]
    blocks = (self.depth - 4) // 6
    x = layers.scaled_pixels(images, self.pixel_max, dtype)
    x = layers.conv(16, 3, 'stem', dtype=dtype)(x)
    for g, width in enumerate(w * self.widen_factor for w in (16, 32, 64)):
      for b in range(blocks):
        x = PreActBlock(width, strides=2 if g > 0 and b == 0 else 1,
                        dtype=dtype, name=f'group{g}_block{b}')(x, train=train)
    x = nn.relu(layers.batch_norm('conv_out', train, 'final_bn',
                                  dtype=dtype)(x))
    x = jnp.mean(x, axis=(1, 2))
    logits = layers.dense(self.num_classes, ('conv_out', 'classes'), 'head',
                          dtype=dtype)(x)
    return logits.astype(jnp.float32)


class Bottleneck(nn.Module):
  """conv1x1-BN-ReLU, conv3x3 (strided)-BN-ReLU, conv1x1 (4x)-BN, + shortcut, ReLU."""
  width: int
  strides: int = 1
  zero_init_residual: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, *, train: bool):
    norm = lambda name, zero=False: layers.batch_norm(  # pylint: disable=g-long-lambda
        'conv_out', train, name, dtype=self.dtype, zero_scale=zero)
    out = 4 * self.width
    y = nn.relu(norm('bn1')(layers.conv(self.width, 1, 'conv1',
                                        dtype=self.dtype)(x)))
    y = nn.relu(norm('bn2')(layers.conv(self.width, 3, 'conv2',
                                        strides=self.strides,
                                        dtype=self.dtype)(y)))
    y = norm('bn3', self.zero_init_residual)(
        layers.conv(out, 1, 'conv3', dtype=self.dtype)(y))
    return nn.relu(y + _shortcut(x, out, self.strides, train, self.dtype))


class BasicBlock(nn.Module):
  """conv3x3 (strided)-BN-ReLU, conv3x3-BN, + shortcut, ReLU (ResNet-18/34)."""
  width: int
  strides: int = 1
  zero_init_residual: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, *, train: bool):
    norm = lambda name, zero=False: layers.batch_norm(  # pylint: disable=g-long-lambda
        'conv_out', train, name, dtype=self.dtype, zero_scale=zero)
    y = nn.relu(norm('bn1')(layers.conv(self.width, 3, 'conv1',
                                        strides=self.strides,
                                        dtype=self.dtype)(x)))
    y = norm('bn2', self.zero_init_residual)(
        layers.conv(self.width, 3, 'conv2', dtype=self.dtype)(y))
    return nn.relu(y + _shortcut(x, self.width, self.strides, train,
                                 self.dtype))


def _shortcut(x, features: int, strides: int, train: bool, dtype):
  """The identity, or a 1x1 conv + BN where the shape changes."""
  if x.shape[-1] == features and strides == 1:
    return x
  x = layers.conv(features, 1, 'proj_conv', strides=strides, dtype=dtype)(x)
  return layers.batch_norm('conv_out', train, 'proj_bn', dtype=dtype)(x)


class ResNet(nn.Module):
  """ResNet v1.5 (see module docstring); the defaults are ResNet-50."""
  num_classes: int
  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  block: str = 'bottleneck'
  width: int = 64
  zero_init_residual: bool = True
  pixel_max: float = 255.0
  dtype: str = 'float32'

  @nn.compact
  def __call__(self, images, *, train: bool):
    dtype = layers.DTYPES[self.dtype]
    block = Bottleneck if self.block == 'bottleneck' else BasicBlock
    x = layers.scaled_pixels(images, self.pixel_max, dtype)
    x = layers.conv(self.width, 7, 'stem_conv', strides=2,
                    padding=[(3, 3), (3, 3)], dtype=dtype)(x)
    x = nn.relu(layers.batch_norm('conv_out', train, 'stem_bn',
                                  dtype=dtype)(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        x = block(self.width * 2**i, strides=2 if i > 0 and j == 0 else 1,
                  zero_init_residual=self.zero_init_residual, dtype=dtype,
                  name=f'stage{i}_block{j}')(x, train=train)
    x = jnp.mean(x, axis=(1, 2))
    logits = layers.dense(self.num_classes, ('conv_out', 'classes'), 'head',
                          dtype=dtype)(x)
    return logits.astype(jnp.float32)


def _positive_int(field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ConfigError(field, value, 'must be a positive integer')


def check_wide_resnet(fields: dict[str, Any]) -> None:
  """ConfigError naming the field unless WideResNet can be built from `fields`."""
  depth = fields.get('depth', WideResNet.depth)
  if (isinstance(depth, bool) or not isinstance(depth, int) or depth < 10
      or (depth - 4) % 6):
    raise ConfigError('model.depth', depth,
                      'a WRN is 6n + 4 layers deep (n >= 1 blocks per group)',
                      [10, 16, 22, 28, 34, 40])
  _positive_int('model.widen_factor',
                fields.get('widen_factor', WideResNet.widen_factor))


def check_resnet(fields: dict[str, Any]) -> None:
  """ConfigError naming the field unless ResNet can be built from `fields`."""
  block = fields.get('block', ResNet.block)
  if block not in BLOCKS:
    raise ConfigError('model.block', block, 'unknown residual block', BLOCKS)
  stages = fields.get('stage_sizes', ResNet.stage_sizes)
  if (not isinstance(stages, (tuple, list)) or not stages
      or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
             for s in stages)):
    raise ConfigError('model.stage_sizes', stages,
                      'blocks per stage: a non-empty list of positive '
                      'integers, e.g. (3, 4, 6, 3) for ResNet-50')
  _positive_int('model.width', fields.get('width', ResNet.width))
