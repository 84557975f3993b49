"""train.compilation.sharded_traffic: trees placed FSDP-style, traffic per chip.

The placement needs a target's compile-only devices (the compile
toolchain, `make compile-toolchain`): without it that test skips, saying
so. Traffic is counted here on programs compiled for this host's CPU.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import pytest

from train.compilation import sharded_traffic
from train.compilation import targets


def test_each_leaf_is_split_along_the_first_dimension_the_chips_divide():
  assert sharded_traffic.fsdp_spec((8, 3), 4) == P('data')
  assert sharded_traffic.fsdp_spec((6, 8), 4) == P(None, 'data')
  assert sharded_traffic.fsdp_spec((3, 5), 4) == P()
  assert sharded_traffic.fsdp_spec((), 4) == P()


def test_a_tree_placed_on_a_slice_holds_a_quarter_of_each_split_leaf():
  tree = {'w': jax.ShapeDtypeStruct((8, 6), jnp.float32),
          'b': jax.ShapeDtypeStruct((3,), jnp.float32)}
  try:
    placed = sharded_traffic.fsdp_placement('v5e:2x2', tree)
  except targets.ToolchainMissing as e:
    pytest.skip(f'compile toolchain missing: {e}')
  assert placed.mesh.devices.size == 4
  assert placed.shardings['w'].spec == P('data')
  assert placed.shardings['b'].spec == P()
  assert placed.params['w'].sharding == placed.shardings['w']
  # w: 8 x 6 float32 over 4 chips; b: 3 float32 on each.
  assert sharded_traffic.local_bytes(placed) == 8 * 6 * 4 // 4 + 3 * 4


def test_one_fusion_reads_its_operand_and_writes_its_result():
  x = jax.ShapeDtypeStruct((1000,), jnp.float32)
  compiled = jax.jit(lambda x: x * 2 + 1).lower(x).compile()
  traffic = sharded_traffic.traffic(compiled)
  assert (traffic.bytes, traffic.ops, traffic.kernel_bytes) == (8000, 1, 0)


def test_custom_calls_count_as_kernels():
  # On CPU a Cholesky factorisation is a LAPACK custom call.
  a = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  traffic = sharded_traffic.traffic(
      jax.jit(jnp.linalg.cholesky).lower(a).compile())
  # It reads the matrix and writes the factor and LAPACK's int32 status;
  # the fusions around it (the triangle, the NaN mask) are not kernels.
  assert traffic.kernel_bytes == 2 * 64 * 64 * 4 + 4
  assert traffic.kernel_bytes < traffic.bytes
