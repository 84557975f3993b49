"""Flax layers whose parameters carry logical axis names, shared by the image models.

Every parameter is created through `nn.with_logical_partitioning`, so
`train.training.sharding` can map its axes to mesh axes with the config's
`logical_axis_rules`: conv kernels are (None, None, 'conv_in', 'conv_out'),
a norm's scale and bias lie on its feature axis, dense kernels on the two
axes their caller names. Parameters are always float32; `dtype` is the
dtype of the computation (bfloat16 on accelerators), which Flax applies by
casting parameters and inputs inside each layer.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

# config.model.dtype -> the activations' dtype.
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}

CONV_AXES = (None, None, 'conv_in', 'conv_out')

# He et al. (2015): variance 2 / fan_out keeps the activations' scale
# through ReLU layers; torchvision's ResNets and the SAM code's WRN use it.
he_normal_fan_out = nn.initializers.variance_scaling(2.0, 'fan_out', 'normal')


def conv(features: int, kernel: int, name: str, *, strides: int = 1,
         padding: str | Sequence[tuple[int, int]] = 'SAME',
         dtype=jnp.float32) -> nn.Conv:
  """A bias-free square convolution (a norm follows it)."""
  return nn.Conv(
      features, (kernel, kernel), strides=(strides, strides),
      padding=padding, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
      name=name,
      kernel_init=nn.with_logical_partitioning(he_normal_fan_out, CONV_AXES))


def dense(features: int, axes: tuple[str, str], name: str, *,
          dtype=jnp.float32) -> nn.Dense:
  return nn.Dense(
      features, name=name, dtype=dtype, param_dtype=jnp.float32,
      kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), axes),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]))


def batch_norm(axis: str, train: bool, name: str, *, dtype=jnp.float32,
               zero_scale: bool = False) -> nn.BatchNorm:
  """Batch statistics in training, running averages (momentum 0.9) in
  evaluation. `zero_scale` starts the scale at 0, so a residual branch
  ending in this norm starts as zero and its block as the identity."""
  # Under jit with a data-sharded batch, the batch mean is already global
  # (XLA inserts the all-reduce), so no axis_name is needed. Flax computes
  # the statistics in float32 whatever `dtype` is.
  scale = nn.initializers.zeros if zero_scale else nn.initializers.ones
  return nn.BatchNorm(
      use_running_average=not train, momentum=0.9, epsilon=1e-5,
      dtype=dtype, param_dtype=jnp.float32, name=name,
      scale_init=nn.with_logical_partitioning(scale, (axis,)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axis,)))


def group_norm(axis: str, name: str, num_groups: int | None) -> nn.Module:
  """GroupNorm over `num_groups` groups, or LayerNorm when None."""
  scale = nn.with_logical_partitioning(nn.initializers.ones, (axis,))
  bias = nn.with_logical_partitioning(nn.initializers.zeros, (axis,))
  if num_groups is None:
    return nn.LayerNorm(name=name, scale_init=scale, bias_init=bias)
  return nn.GroupNorm(num_groups=num_groups, name=name, scale_init=scale,
                      bias_init=bias)


def scaled_pixels(images, pixel_max: float, dtype) -> jnp.ndarray:
  """uint8 images as `dtype` in [0, 1] (the division is done in float32)."""
  return (images.astype(jnp.float32) / pixel_max).astype(dtype)
