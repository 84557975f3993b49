"""geom.tree_norm: the plain sum of squares, bit for bit, wherever that does not
overflow or underflow; finite and accurate where it does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geom import sam
from geom.tree_norm import tree_norm_f32


def _plain(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree.leaves(tree)))


def _float64(tree):
  return np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                     for x in jax.tree.leaves(tree)))


def _random_tree(rng, magnitude, a_size=None, b_rows=None):
  a_size = rng.integers(1, 400) if a_size is None else a_size
  b_rows = rng.integers(1, 9) if b_rows is None else b_rows
  return {
      'a': jnp.asarray(rng.standard_normal(a_size) * magnitude, jnp.float32),
      'b': jnp.asarray(rng.standard_normal((b_rows, 3)), jnp.bfloat16),
      'empty': jnp.zeros((0, 4), jnp.float32),
  }


def test_equals_the_plain_sum_bit_for_bit_in_range():
  rng = np.random.default_rng(0)
  norm, plain = jax.jit(tree_norm_f32), jax.jit(_plain)
  # Six ragged shapes (each one compile), random values at random scales.
  for i in range(100):
    tree = _random_tree(rng, 10.0 ** rng.uniform(-8, 8),
                        a_size=(1, 7, 399)[i % 3], b_rows=(1, 8)[i % 2])
    assert (np.asarray(norm(tree)).view(np.uint32)
            == np.asarray(plain(tree)).view(np.uint32))


@pytest.mark.parametrize('magnitude', [1e20, 1e30, 1e-25, 1e-35])
def test_accurate_where_the_plain_sum_overflows_or_underflows(magnitude):
  tree = _random_tree(np.random.default_rng(1), magnitude)
  tree['b'] = tree['b'] * 0  # bfloat16 holds 1e30 but not 1e-35 exactly.
  assert float(_plain(tree)) in (0.0, float('inf'))
  np.testing.assert_allclose(float(jax.jit(tree_norm_f32)(tree)),
                             _float64(tree), rtol=2e-6)


def test_edges():
  assert float(tree_norm_f32({})) == 0.0
  assert float(tree_norm_f32({'e': jnp.zeros((0,))})) == 0.0
  assert float(tree_norm_f32({'z': jnp.zeros((3, 2))})) == 0.0
  assert float(tree_norm_f32([jnp.array([np.inf, 1.0])])) == np.inf
  assert np.isnan(float(tree_norm_f32([jnp.array([np.nan, 1.0])])))
  # Near float32's largest value the scaled squares still fit.
  big = [jnp.full((4,), 1e38, jnp.float32)]
  np.testing.assert_allclose(float(tree_norm_f32(big)), 2e38, rtol=1e-6)


@pytest.mark.parametrize('adaptive', [False, True])
@pytest.mark.parametrize('magnitude', [1e20, 1e-25])
def test_sams_ascent_step_keeps_its_length_at_extreme_gradients(adaptive,
                                                                magnitude):
  rng = np.random.default_rng(2)
  params = {'w': jnp.asarray(rng.standard_normal(50), jnp.float32)}
  grads = {'w': jnp.asarray(rng.standard_normal(50) * magnitude,
                            jnp.float32)}
  e, norm = jax.jit(lambda g, p: sam.perturbation(
      g, p, 0.05, adaptive=adaptive, eps=0.0))(grads, params)
  assert np.isfinite(float(norm)) and float(norm) > 0
  if not adaptive:  # |e| = rho; ASAM's e = rho T^2 g / |T g| has another length.
    np.testing.assert_allclose(float(tree_norm_f32(e)), 0.05, rtol=1e-5)
  else:
    t = np.abs(np.asarray(params['w'], np.float64)) + 0.01
    g = np.asarray(grads['w'], np.float64)
    want = 0.05 * t * t * g / np.linalg.norm(t * g)
    np.testing.assert_allclose(np.asarray(e['w']), want, rtol=1e-5)
