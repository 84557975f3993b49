"""Array fingerprints (train.run.checksums): exact, layout-free, and sensitive to one bit."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

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
