"""train.lm.quantization against an independent per-channel loop: codes on the
grid, per-channel scales, the round trip's error bound, edges (zero
channels, bf16, 1-D arrays untouched) and bad arguments."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.lm import quantization


def _reference(w: np.ndarray, bits: int) -> np.ndarray:
  """Loop over the last axis' channels in float64."""
  top = 2 ** (bits - 1) - 1
  out = np.empty_like(w, dtype=np.float64)
  for c in range(w.shape[-1]):
    col = w[..., c].astype(np.float64)
    s = np.abs(col).max() / top
    out[..., c] = 0.0 if s == 0 else np.clip(np.round(col / s), -top - 1,
                                             top) * s
  return out


@pytest.mark.parametrize('bits', [2, 4, 8])
@pytest.mark.parametrize('shape', [(5, 3), (4, 2, 6), (1, 1)])
def test_matches_the_per_channel_loop_and_stays_on_the_grid(bits, shape):
  w = np.random.default_rng(bits).normal(size=shape).astype(np.float32) * 3
  codes, scale = quantization.quantize_array(jnp.asarray(w), bits)
  top = 2 ** (bits - 1) - 1
  assert codes.dtype == jnp.int8
  assert int(codes.min()) >= -top - 1 and int(codes.max()) <= top
  assert scale.shape == (1,) * (len(shape) - 1) + (shape[-1],)
  np.testing.assert_allclose(
      np.asarray(scale).reshape(-1),
      np.abs(w).reshape(-1, shape[-1]).max(0) / top, rtol=1e-6)
  got = quantization.fake_quantize({'k': jnp.asarray(w)}, bits)['k']
  np.testing.assert_allclose(np.asarray(got), _reference(w, bits),
                             rtol=1e-5, atol=1e-6)
  # Round trip: within half a step of each channel's grid, and each
  # channel's largest |w| exactly representable.
  step = np.asarray(scale)
  assert np.all(np.abs(np.asarray(got) - w) <= step / 2 + 1e-6)
  for c in range(shape[-1]):
    i = np.unravel_index(np.argmax(np.abs(w[..., c])), w[..., c].shape)
    np.testing.assert_allclose(np.asarray(got)[..., c][i], w[..., c][i],
                               rtol=1e-6)


def test_four_bits_have_at_most_sixteen_levels_per_channel():
  w = jax.random.normal(jax.random.key(0), (1000, 4))
  got = np.asarray(quantization.fake_quantize(w, 4))
  for c in range(4):
    assert len(np.unique(got[:, c])) <= 16


def test_zero_channels_small_arrays_and_dtypes():
  w = jnp.asarray(np.array([[0.0, 1.0], [0.0, -2.0]], np.float32))
  params = {'w': w, 'scale': jnp.asarray([0.3, 0.7]),
            'count': jnp.asarray([[1, 2]], jnp.int32),
            'half': w.astype(jnp.bfloat16)}
  out = quantization.fake_quantize(params, 4)
  assert np.all(np.asarray(out['w'])[:, 0] == 0.0)  # No NaN from scale 0.
  np.testing.assert_array_equal(out['scale'], params['scale'])  # 1-D kept.
  np.testing.assert_array_equal(out['count'], params['count'])
  assert out['half'].dtype == jnp.bfloat16
  assert jax.tree.structure(out) == jax.tree.structure(params)
  jitted = jax.jit(lambda p: quantization.fake_quantize(p, 4))(params)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_quantisation_error_falls_with_bits():
  w = jax.random.normal(jax.random.key(1), (64, 32))
  errors = [float(jnp.abs(quantization.fake_quantize(w, b) - w).mean())
            for b in (2, 4, 8)]
  assert all(a > 2 * b for a, b in itertools.pairwise(errors))


@pytest.mark.parametrize('bits, shape', [(1, (2, 2)), (17, (2, 2)),
                                         (4, (3,))])
def test_bad_arguments(bits, shape):
  with pytest.raises(ValueError, match='bits|dimensions'):
    quantization.quantize_array(jnp.ones(shape), bits)


def _group_reference(w: np.ndarray, bits: int, group: int) -> np.ndarray:
  """Loop over (group of `group` rows, channel) in float64, the rows being
  every axis but the last flattened."""
  top = 2 ** (bits - 1) - 1
  rows = w.reshape(-1, w.shape[-1]).astype(np.float64)
  out = np.empty_like(rows)
  for start in range(0, rows.shape[0], group):
    for c in range(rows.shape[1]):
      col = rows[start:start + group, c]
      s = np.abs(col).max() / top
      out[start:start + group, c] = (
          0.0 if s == 0 else np.clip(np.round(col / s), -top - 1, top) * s)
  return out.reshape(w.shape)


@pytest.mark.parametrize('bits', [3, 4, 8])
@pytest.mark.parametrize('shape, group', [((64, 5), 32), ((70, 3), 32),
                                          ((3, 10, 4), 4), ((5, 2), 1),
                                          ((6, 2), 100)])
def test_groups_match_the_per_group_loop(bits, shape, group):
  # Ragged last groups (70 rows, 30 rows in groups of 4), a group of one
  # (exact) and a group larger than the array (per channel).
  rng = np.random.default_rng(bits + group)
  w = (rng.standard_t(2, size=shape) * 3).astype(np.float32)
  got = jax.jit(lambda a: quantization.fake_quantize_array(a, bits, group))(
      jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(got), _group_reference(w, bits, group),
                             rtol=1e-5, atol=1e-6)
  if group == 1:
    np.testing.assert_allclose(np.asarray(got), w, rtol=1e-6)
  if group >= w.size // w.shape[-1]:
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(quantization.fake_quantize(w, bits)))


def test_groups_confine_an_outlier():
  # One huge weight coarsens its whole channel's grid per channel, only
  # its own group's with groups: the rest keep a 4-bit error.
  w = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
  w[3, 2] = 1000.0
  per_channel = np.asarray(quantization.fake_quantize(w, 4))
  grouped = np.asarray(quantization.fake_quantize(w, 4, group_size=32))
  rest = np.ones(w.shape, bool)
  rest[:32, 2] = False
  assert np.abs(grouped - w)[rest].max() < 0.3
  assert np.abs(per_channel - w)[32:, 2].mean() > 0.5
  assert np.abs(grouped - w)[32:, 2].mean() < 0.2


def test_groups_keep_dtypes_and_skip_small_arrays():
  params = {'k': jnp.ones((8, 2), jnp.bfloat16) * 0.3,
            'b': jnp.asarray([0.3, 0.7]), 'i': jnp.ones((4, 4), jnp.int32)}
  out = quantization.fake_quantize(params, 4, group_size=3)
  assert out['k'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(out['b'], params['b'])
  np.testing.assert_array_equal(out['i'], params['i'])


@pytest.mark.parametrize('group', [0, -2, 2.5, '32'])
def test_bad_group_sizes(group):
  with pytest.raises(ValueError, match='group_size'):
    quantization.fake_quantize({'k': jnp.ones((4, 2))}, 4, group_size=group)
