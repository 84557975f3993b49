"""Image classifiers with logical axis names on every parameter.

Kernels carry logical axes ('conv_in', 'conv_out', 'hidden', 'classes', ...)
through `nn.with_logical_partitioning` (`train.vision.layers`);
`train.training.sharding` maps them to mesh axes with the config's rules, so the
same model runs data-parallel or model-parallel without edits. Inputs are
uint8 images scaled in the model, which keeps host-to-device copies small.

`create_model` builds any model of `_MODELS` by name: the small CNN and
MLP here, and the SAM paper's residual networks (`train.vision.resnets`:
'wrn', WRN-depth-k; 'resnet', ResNet v1.5, ResNet-50 by default).
"""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from train.errors import ConfigError
from train.vision import layers
from train.vision import resnets


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
      return layers.batch_norm(axis, train, name)
    if self.norm == 'layer':
      return layers.group_norm(axis, name, None)
    groups = next(g for g in (8, 4, 2, 1) if width % g == 0)
    return layers.group_norm(axis, name, groups)

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
    x = layers.dense(self.hidden, ('flat', 'hidden'), 'hidden')(x)
    x = nn.relu(self._norm('hidden', self.hidden, train, 'bn_hidden')(x))
    return layers.dense(self.num_classes, ('hidden', 'classes'), 'head')(x)


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
      x = layers.dense(w, (in_axis, out_axis), f'dense{i}')(x)
      x = nn.relu(layers.batch_norm(out_axis, train, f'bn{i}')(x))
      in_axis = out_axis
    return layers.dense(self.num_classes, (in_axis, 'classes'), 'head')(x)


def _check_widths(field: str, widths: Any, what: str) -> None:
  if (not isinstance(widths, (tuple, list)) or not widths
      or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
             for w in widths)):
    raise ConfigError(field, widths, f'{what}: a non-empty list of positive '
                      'integers')


def check_cnn(fields: dict[str, Any]) -> None:
  """ConfigError naming the field unless CNN can be built from `fields`."""
  _check_widths('model.features', fields.get('features', CNN.features),
                'channels per conv block')
  hidden = fields.get('hidden', CNN.hidden)
  if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
    raise ConfigError('model.hidden', hidden, 'must be a positive integer')


def check_mlp(fields: dict[str, Any]) -> None:
  """ConfigError naming the field unless MLP can be built from `fields`."""
  _check_widths('model.widths', fields.get('widths', MLP.widths),
                'units per hidden layer')


_MODELS: dict[str, Callable[..., nn.Module]] = {
    'cnn': CNN, 'mlp': MLP, 'wrn': resnets.WideResNet, 'resnet': resnets.ResNet}
# Checks of a model's own fields beyond their names (ConfigError).
_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    'cnn': check_cnn, 'mlp': check_mlp,
    'wrn': resnets.check_wide_resnet, 'resnet': resnets.check_resnet}


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
  if 'dtype' in kwargs and kwargs['dtype'] not in layers.DTYPES:
    raise ConfigError('model.dtype', kwargs['dtype'],
                      'unknown activation dtype (parameters stay float32)',
                      list(layers.DTYPES))
  if name in _CHECKS:
    _CHECKS[name](kwargs)
  return _MODELS[name](num_classes=num_classes, pixel_max=pixel_max, **kwargs)
