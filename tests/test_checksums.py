"""Array fingerprints (train.run.checksums): exact, layout-free, and sensitive to one bit."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from tests import compile_events
from train.run import checksums


def _tree(rng):
  return {
      'f32': rng.standard_normal((64, 24)).astype(np.float32),
      'bf16': jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16),
      'i32': rng.integers(-9, 9, (3, 4, 2)).astype(np.int32),
      'u8': rng.integers(0, 255, (17,)).astype(np.uint8),
      'flag': np.array([True, False, True]),
      'scalar': np.float32(3.5),
      'empty': np.zeros((0, 3), np.float32),
      'key': jax.random.key(3),
  }


def test_the_fingerprint_does_not_depend_on_the_layout():
  tree = _tree(np.random.default_rng(0))
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  sharded = dict(tree, f32=jax.device_put(
      tree['f32'], NamedSharding(mesh, P('data', 'model'))))
  assert checksums.fingerprint(sharded) == checksums.fingerprint(tree)
  # Nor on where it is computed: under another jit, on a copy.
  copy = jax.tree.map(lambda x: x.copy() if hasattr(x, 'copy') else x, tree)
  assert checksums.fingerprint(copy) == checksums.fingerprint(tree)


@pytest.mark.parametrize('leaf', ['f32', 'bf16', 'i32', 'u8', 'scalar'])
def test_one_flipped_bit_changes_that_leaf_only(leaf):
  rng = np.random.default_rng(1)
  tree = _tree(rng)
  want = checksums.fingerprint(tree)
  x = np.array(tree[leaf])
  bits = x.reshape(-1).view(f'u{x.dtype.itemsize}')
  for trial in range(20):  # Random element, random bit (sign and exponent too).
    i, bit = rng.integers(bits.size), rng.integers(8 * x.dtype.itemsize)
    flipped = bits.copy()
    flipped[i] ^= np.array(1 << bit, flipped.dtype)
    damaged = dict(tree, **{leaf: jnp.asarray(
        flipped.view(x.dtype).reshape(x.shape))})
    got = checksums.fingerprint(damaged)
    assert checksums.mismatches(want, got) == [f"['{leaf}']"], (trial, i, bit)


def test_moved_elements_change_the_fingerprint():
  tree = _tree(np.random.default_rng(2))
  swapped = tree['f32'].copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # Same multiset of values.
  transposed = dict(tree, f32=swapped)
  assert checksums.mismatches(checksums.fingerprint(tree),
                              checksums.fingerprint(transposed)) == ["['f32']"]


def test_a_missing_or_extra_leaf_is_a_mismatch():
  tree = _tree(np.random.default_rng(3))
  full = checksums.fingerprint(tree)
  less = checksums.fingerprint({k: v for k, v in tree.items() if k != 'u8'})
  assert checksums.mismatches(full, less) == ["['u8']"]
  assert checksums.mismatches(less, full) == ["['u8']"]


@pytest.mark.parametrize('seed', range(4))
def test_the_host_sum_of_small_cpu_leaves_is_the_programs(seed):
  """Small leaves on CPU devices are summed by numpy: bit for bit the
  device program's sums (what every stored fingerprint was made with), on
  random leaves of every dtype, the edges included."""
  rng = np.random.default_rng(seed)
  shape = tuple(rng.integers(1, 9, rng.integers(0, 4)))
  leaves = {
      'f32': rng.standard_normal(shape).astype(np.float32) * 1e20,
      'bf16': jnp.asarray(rng.standard_normal(shape), jnp.bfloat16),
      'f16': rng.standard_normal(shape).astype(np.float16),
      'i8': rng.integers(-128, 128, shape).astype(np.int8),
      'u32': rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32),
      'i32': rng.integers(-2**31, 2**31, shape).astype(np.int32),
      'bool': rng.integers(0, 2, shape).astype(bool),
      'nan_inf': np.array([np.nan, np.inf, -np.inf, -0.0], np.float32),
      'empty': np.zeros((0, 3), np.float32),
      'scalar': np.float32(rng.standard_normal()),
  }
  for name, leaf in leaves.items():
    x = jnp.asarray(leaf)
    assert checksums._on_host(x), name  # pylint: disable=protected-access
    np.testing.assert_array_equal(
        checksums._leaf_on_host(np.asarray(x)),  # pylint: disable=protected-access
        np.asarray(checksums._leaf_program(x)), err_msg=name)  # pylint: disable=protected-access
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  sharded = jax.device_put(rng.standard_normal((8, 6)).astype(np.float32),
                           NamedSharding(mesh, P('data', 'model')))
  assert checksums._on_host(sharded)  # pylint: disable=protected-access
  np.testing.assert_array_equal(
      checksums._leaf_on_host(np.asarray(sharded)),  # pylint: disable=protected-access
      np.asarray(checksums._leaf_program(sharded)))  # pylint: disable=protected-access


def test_small_cpu_leaves_compile_no_program():
  # Shapes no other test sums; a large leaf still takes the program.
  small = jax.device_put(np.ones((13, 11), np.float32))
  large = jax.device_put(np.ones((checksums.HOST_MAX_ELEMENTS + 1,),
                                 np.int8))
  with compile_events.compiled() as compiled:
    checksums.fingerprint({'small': small})
  assert 'jit(_leaf)' not in compiled, compiled
  with compile_events.compiled() as compiled:
    checksums.fingerprint({'large': large})
  assert 'jit(_leaf)' in compiled, compiled
