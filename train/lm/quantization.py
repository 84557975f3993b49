"""Post-training weight quantisation, simulated: per-channel symmetric integers.

`fake_quantize(params, bits=4)` rounds every weight matrix to a signed
`bits`-bit grid with one scale per output channel and returns the
dequantised floats, so a model evaluates exactly as its quantised weights
would (the arithmetic after dequantisation stays in float). This is what a
study of "forgetting after 4-bit quantisation" needs; it does not save
memory or time.

Our choices (the usual weight-only scheme, e.g. GPTQ's and AWQ's
round-to-nearest baseline):
- symmetric: q = clip(round(w / s), -2^(b-1), 2^(b-1) - 1), w' = q s, with
  s = max |w| / (2^(b-1) - 1) per channel, the channels being the last
  axis (a kernel's output features; the feature axis of the LM's
  embedding and head tables): the maximum runs over every other axis, so
  the largest weight of each channel is representable exactly and the
  grid never clips it;
- only arrays with at least 2 dimensions are quantised: norms' scales and
  biases are tiny and stay in float, as in common weight-only schemes;
- a channel that is all zero keeps scale 0 and stays zero (no division by
  zero);
- `group_size=G` (round-to-nearest per group, as GGUF's Q4_0 with G = 32
  and GPTQ/AWQ with G = 128): one scale per output channel and per G
  consecutive weights along the input, i.e. along every axis but the last
  flattened in row-major order (a kernel's input features; the
  vocabulary of an embedding table); the last group of an axis not
  divisible by G is shorter. Scales from a whole channel let one outlier
  weight coarsen the grid of every other weight in it; groups confine it.

qwix (Google's JAX quantisation library) would do this and more, but it
is not in the pinned stack and a fake-quant is a few lines that the tests
check against an independent loop.
"""

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ['fake_quantize', 'fake_quantize_array', 'quantize_array']


def quantize_array(w: jax.Array, bits: int = 4, channel_axis: int = -1
                   ) -> tuple[jax.Array, jax.Array]:
  """(integer codes, per-channel scales) of `w`, symmetric.

  Args:
    w: a float array with >= 2 dimensions.
    bits: 2..16.
    channel_axis: the axis that keeps one scale per index.

  Returns:
    codes (int8 for bits <= 8, else int16) of `w`'s shape, and float32
    scales broadcastable against it (size 1 on every other axis).
  """
  if not 2 <= bits <= 16:
    raise ValueError(f'bits={bits}: must be in [2, 16]')
  if w.ndim < 2:
    raise ValueError(f'an array of shape {w.shape} has no channels to '
                     'quantise per (need >= 2 dimensions)')
  axis = channel_axis % w.ndim
  reduce = tuple(a for a in range(w.ndim) if a != axis)
  top = 2 ** (bits - 1) - 1
  w32 = w.astype(jnp.float32)
  scale = jnp.max(jnp.abs(w32), axis=reduce, keepdims=True) / top
  safe = jnp.where(scale > 0, scale, 1.0)
  codes = jnp.clip(jnp.round(w32 / safe), -top - 1, top)
  return codes.astype(jnp.int8 if bits <= 8 else jnp.int16), scale


def fake_quantize_array(w: jax.Array, bits: int = 4,
                        group_size: int | None = None) -> jax.Array:
  """`w` rounded to its symmetric `bits`-bit grid, per output channel (the
  last axis) or per (group of `group_size` input weights, channel), and
  dequantised to `w`'s dtype.

  Raises:
    ValueError: bits outside [2, 16], `w` under 2 dimensions, or a
      group_size under 1.
  """
  if group_size is None:
    codes, scale = quantize_array(w, bits)
    return (codes.astype(jnp.float32) * scale).astype(w.dtype)
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f'group_size={group_size!r}: must be an int >= 1 '
                     '(or None: one scale per channel)')
  if w.ndim < 2:
    raise ValueError(f'an array of shape {w.shape} has no channels to '
                     'quantise per (need >= 2 dimensions)')
  rows = w.reshape(-1, w.shape[-1])
  groups = -(-rows.shape[0] // group_size)
  # Zero rows pad the last group: they never raise its max |w|.
  padded = jnp.pad(rows, ((0, groups * group_size - rows.shape[0]), (0, 0)))
  codes, scale = quantize_array(
      padded.reshape(groups, group_size, w.shape[-1]).transpose(1, 0, 2)
      .reshape(group_size, groups * w.shape[-1]), bits)
  out = (codes.astype(jnp.float32) * scale).reshape(
      group_size, groups, w.shape[-1]).transpose(1, 0, 2)
  return out.reshape(-1, w.shape[-1])[:rows.shape[0]].reshape(
      w.shape).astype(w.dtype)


def fake_quantize(params: Any, bits: int = 4,
                  group_size: int | None = None) -> Any:
  """`params` with every floating >= 2-D array replaced by its symmetric
  `bits`-bit quantisation (per channel, or per group of `group_size`
  input weights and channel), dequantised to its own dtype."""

  def one(w):
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
      return w
    return fake_quantize_array(w, bits, group_size)

  if group_size is not None and (not isinstance(group_size, int)
                                 or group_size < 1):
    raise ValueError(f'group_size={group_size!r}: must be an int >= 1 '
                     '(or None: one scale per channel)')
  return jax.tree.map(one, params)
