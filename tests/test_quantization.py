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
