"""Image classifiers with logical axis names on every parameter.

Kernels carry logical axes ('conv_in', 'conv_out', 'hidden', 'classes', ...)
through `nn.with_logical_partitioning`; `train.sharding` maps them to mesh
axes with the config's rules, so the same model runs data-parallel or
model-parallel without edits. Inputs are uint8 images scaled in the model,
which keeps host-to-device copies small.
"""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from train.errors import ConfigError


def _dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
  return nn.Dense(
      features, name=name,
      kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), axes),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]))


def _batch_norm(axis: str, train: bool, name: str) -> nn.BatchNorm:
  # Under jit with a data-sharded batch, the batch mean is already global
  # (XLA inserts the all-reduce), so no axis_name is needed.
  return nn.BatchNorm(
      use_running_average=not train, momentum=0.9, name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axis,)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axis,)))


def _group_norm(axis: str, name: str, num_groups: int | None) -> nn.Module:
  scale = nn.with_logical_partitioning(nn.initializers.ones, (axis,))
  bias = nn.with_logical_partitioning(nn.initializers.zeros, (axis,))
  if num_groups is None:  # LayerNorm over the features.
    return nn.LayerNorm(name=name, scale_init=scale, bias_init=bias)
  return nn.GroupNorm(num_groups=num_groups, name=name, scale_init=scale,
                      bias_init=bias)


NORMS = ('batch', 'group', 'layer')


class CNN(nn.Module):
  """Conv-norm-ReLU blocks, 2x2 average pooling, then a norm-ReLU hidden layer.

  `norm` 'batch' (the default) normalises with batch statistics in training
  and running averages in evaluation; 'group' (8 groups, or fewer when the
  features do not split into 8) and 'layer' use each example alone, so
  their output does not depend on the batch: the variant test-time
  adaptation needs to show the batch-size and label-shift failure modes of
  batch statistics. All keep their affine parameters in `bn*` modules
  (`scale`, `bias`), the parameters test-time adaptation adapts.
  """
  num_classes: int
  features: Sequence[int] = (32, 64)
  hidden: int = 128
  pixel_max: float = 255.0
  norm: str = 'batch'

  def _norm(self, axis: str, width: int, train: bool, name: str):
    if self.norm == 'batch':
      return _batch_norm(axis, train, name)
    if self.norm == 'layer':
      return _group_norm(axis, name, None)
    groups = next(g for g in (8, 4, 2, 1) if width % g == 0)
    return _group_norm(axis, name, groups)

  @nn.compact
  def __call__(self, images, *, train: bool):
    x = images.astype(jnp.float32) / self.pixel_max
    for i, f in enumerate(self.features):
      x = nn.Conv(
          f, (3, 3), use_bias=False, name=f'conv{i}',
          kernel_init=nn.with_logical_partitioning(
              nn.initializers.lecun_normal(),
              (None, None, 'conv_in', 'conv_out')))(x)
      x = nn.relu(self._norm('conv_out', f, train, f'bn{i}')(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2), padding='SAME')
    x = x.reshape((x.shape[0], -1))
    x = _dense(self.hidden, ('flat', 'hidden'), 'hidden')(x)
    x = nn.relu(self._norm('hidden', self.hidden, train, 'bn_hidden')(x))
    return _dense(self.num_classes, ('hidden', 'classes'), 'head')(x)


class MLP(nn.Module):
  """Flatten, then Dense-BN-ReLU layers and a linear head."""
  num_classes: int
  widths: Sequence[int] = (256, 256)
  pixel_max: float = 255.0

  @nn.compact
  def __call__(self, images, *, train: bool):
    x = images.astype(jnp.float32) / self.pixel_max
    x = x.reshape((x.shape[0], -1))
    in_axis = 'flat'
    for i, w in enumerate(self.widths):
      # Alternate column- and row-parallel splits so consecutive kernels
      # need no resharding between them.
      out_axis = 'hidden' if i % 2 == 0 else 'hidden_out'
      x = _dense(w, (in_axis, out_axis), f'dense{i}')(x)
      x = nn.relu(_batch_norm(out_axis, train, f'bn{i}')(x))
      in_axis = out_axis
    return _dense(self.num_classes, (in_axis, 'classes'), 'head')(x)


_MODELS: dict[str, Callable[..., nn.Module]] = {'cnn': CNN, 'mlp': MLP}


def model_names() -> list[str]:
  return sorted(_MODELS)


def create_model(model_config: Any, num_classes: int,
                 pixel_max: float) -> nn.Module:
  """Builds `model_config.name` with the config's remaining fields as kwargs."""
  kwargs = dict(model_config)
  name = kwargs.pop('name')
  if name not in _MODELS:
    raise ConfigError('model.name', name, 'unknown model', model_names())
  fields = set(_MODELS[name].__dataclass_fields__) - {'parent', 'name'}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ConfigError(f'model.{unknown[0]}', kwargs[unknown[0]],
                      f'not a field of model {name!r}',
                      sorted(fields - {'num_classes', 'pixel_max'}))
  if 'norm' in kwargs and kwargs['norm'] not in NORMS:
    raise ConfigError('model.norm', kwargs['norm'], 'unknown normalisation',
                      NORMS)
  return _MODELS[name](num_classes=num_classes, pixel_max=pixel_max, **kwargs)
