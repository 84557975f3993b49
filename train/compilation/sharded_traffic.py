"""HBM traffic per chip of programs compiled for a target on FSDP-placed trees.

A parameter tree is placed on a target's compile-only devices
(`targets.devices`) FSDP-style: each leaf split over the chips along its
first dimension they divide, the others replicated. Programs lowered on
those abstract arrays compile from any host; `traffic` then counts what
each chip reads and writes from the optimized HLO (`hlo_traffic`), and
takes the compiler's own `bytes accessed` where it gives one (TPU; GPU
compilers do not). Estimates from the compiler's plan, never measurements.
"""

from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from train.compilation import hlo_traffic
from train.compilation import targets

AXIS = 'data'


def fsdp_spec(shape, n: int) -> P:
  """Split along the first dimension `n` divides; replicated if none."""
  for d, size in enumerate(shape):
    if size % n == 0:
      return P(*([None] * d), AXIS)
  return P()


class Placement(NamedTuple):
  """A tree on a target: the mesh of its chips (one axis, AXIS), each
  leaf's sharding, and abstract arrays carrying them to lower on."""
  mesh: Mesh
  shardings: Any
  params: Any


def fsdp_placement(target: str, tree) -> Placement:
  """`tree` (arrays or ShapeDtypeStructs) placed FSDP-style on `target`."""
  devices = targets.devices(targets.parse(target))
  mesh = Mesh(np.array(devices), (AXIS,))
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, fsdp_spec(x.shape, len(devices))), tree)
  params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
      shardings)
  return Placement(mesh, shardings, params)


def local_bytes(placement: Placement) -> int:
  """Bytes of the tree that each chip holds."""
  return sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
             for x, s in zip(jax.tree.leaves(placement.params),
                             jax.tree.leaves(placement.shardings)))


class Traffic(NamedTuple):
  """Per chip: HBM bytes read plus written, the top-level instructions
  that touch memory (launches, on GPU), the bytes of those that are
  custom calls (kernels), and the compiler's `bytes accessed` (None where
  it gives none)."""
  bytes: int
  ops: int
  kernel_bytes: int
  cost_bytes: float | None


def traffic(compiled: jax.stages.Compiled) -> Traffic:
  instructions = hlo_traffic.instructions(compiled.as_text())
  cost = compiled.cost_analysis()
  return Traffic(
      bytes=sum(i.bytes for i in instructions),
      ops=sum(1 for i in instructions if i.bytes),
      kernel_bytes=sum(i.bytes for i in instructions
                       if i.opcode == 'custom-call'),
      cost_bytes=cost.get('bytes accessed') if cost else None)
