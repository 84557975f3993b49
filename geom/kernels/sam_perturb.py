"""A Pallas kernel pair for SAM's perturbation: w + rho g / |g| (and ASAM's).

`sam_perturb(params, grads, rho)` returns w + rho g / (|g| + eps) and the
global norm |g| (ASAM, `adaptive=True`: w + rho T^2 g / (|T g| + eps),
T = |w| + eta) in two passes over the parameters, as apex's multi-tensor
L2-norm-and-scale does:

1. norm: per block of rows, each lane's largest magnitude and scaled sum
   of squares, in float32 whatever the dtype, combined without overflow
   or underflow (|g| = 1e20 or 1e-25 in float32);
2. update: w' = w + scale * g, scale = rho / (norm + eps) in float32, cast
   to w's dtype.

Large leaves are their own (rows, 128 n) buffers; small ones are packed, per
dtype pair, into one. Each pass has a TPU body (Mosaic) and a GPU body
(Triton), chosen where the call is lowered; on CPU the TPU bodies run in
Pallas's interpreter (`interpret`). `BlockSizes` holds the tile sizes and
`BlockSizes.for_target` each backend's defaults. The norm is always the
global one, and each device works on its own shards: under `jax.jit` the
SPMD partitioner splits the call (GPU, CPU; on a split TPU program it is
XLA's fusion of the same arithmetic), and `shardings=` runs the kernels
in a `shard_map`. The kernels are not differentiable (SAM never
differentiates through its ascent point). `sam_perturb_reference` is the
same computation in plain jnp.

Layout, lowering, sharding and what compiling for TPU v4/v5e/v5p/v6e and
H100/H200 showed: docs/methods/sam_perturb.md.

References:
  Foret et al., Sharpness-Aware Minimization for Efficiently Improving
  Generalization, ICLR 2021 (https://arxiv.org/abs/2010.01412).
  Kwon et al., ASAM: Adaptive Sharpness-Aware Minimization for
  Scale-Invariant Learning of Deep Neural Networks, ICML 2021
  (https://arxiv.org/abs/2102.11600).
"""

import dataclasses
import functools
import math
from typing import Any

import jax
from jax.experimental import custom_partitioning as cp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jax.extend import core as jex
from jax.interpreters import mlir
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from geom import tree_norm
from geom import validation

__all__ = ['BlockSizes', 'LANES', 'TARGETS', 'interprets_by_default',
           'sam_perturb', 'sam_perturb_reference']

Params = Any

#: Every buffer the kernels see is a multiple of this many lanes wide (the
#: TPU vector width, and whole 128-byte GPU memory transactions).
LANES = 128
#: The kernel bodies by backend, the values of `target=` in `sam_perturb`.
TARGETS = ('tpu', 'gpu')
_OWNER = 'geom.kernels.sam_perturb'
# VMEM a step may use: the scoped-VMEM default Mosaic kernels get on the
# older chips (v5e; v6e gets more). Lowering from a host does not see the
# chip's memory, so a block that needs more would fail only when compiled
# on the TPU: it is refused before any compute instead.
_TPU_SCOPED_VMEM_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the kernels; `BlockSizes.for_target` gives each
  backend's defaults (the field defaults are TPU's).

  Attributes:
    block_rows: rows of 128 lanes per grid step. TPU: a multiple of the
      sublane tiling (8 rows for 32-bit dtypes, 16 for 16-bit ones), or at
      least a buffer's rows (the block is then the whole buffer); the
      update's operands, double-buffered, must fit 16 MiB of VMEM. GPU
      (Triton): a power of two.
    pack_below: leaves with fewer elements, and larger ones whose size is
      not a multiple of 128, are packed into one buffer per dtype pair.
    num_warps: warps per Triton program (GPU only; None: Triton's choice).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom.kernels import sam_perturb as k
    >>> k.BlockSizes.for_target('gpu')
    BlockSizes(block_rows=64, pack_below=65536, num_warps=8)
    >>> w, g = {'a': jnp.ones(300)}, {'a': jnp.ones(300)}
    >>> sizes = k.BlockSizes(block_rows=8, pack_below=0)   # Several grid steps.
    >>> _, norm = k.sam_perturb(w, g, 0.1, block_sizes=sizes, interpret=True)
    >>> round(float(norm), 4)   # sqrt(300)
    17.3205
  """
  block_rows: int = 1024
  pack_below: int = 64 * 1024
  num_warps: int | None = None

  def __post_init__(self):
    owner = f'{_OWNER}.BlockSizes'
    validation.check(owner, 'block_rows', self.block_rows,
                     lambda v: v >= 1, '>= 1')
    validation.check(owner, 'pack_below', self.pack_below, lambda v: v >= 0,
                     '>= 0')
    if self.num_warps is not None:
      validation.check(owner, 'num_warps', self.num_warps,
                       lambda v: v in (1, 2, 4, 8, 16, 32),
                       'a power of two from 1 to 32, or None')

  @classmethod
  def for_target(cls, target: str) -> 'BlockSizes':
    """The defaults for 'tpu', 'gpu' or 'interpret' (Pallas's interpreter).

    Example:

      >>> from geom.kernels import sam_perturb as k
      >>> k.BlockSizes.for_target('tpu').block_rows
      1024
    """
    validation.check_choice(f'{_OWNER}.BlockSizes.for_target', 'target',
                            target, (*TARGETS, 'interpret'))
    return _DEFAULTS[target]


_DEFAULTS = {
    # 512 KiB of float32 per operand: the update's three operands,
    # double-buffered, take 3 MiB of VMEM, and a block's transfer is long
    # against the fixed cost of a grid step (about 0.35 us in Pallas's TPU
    # documentation).
    'tpu': BlockSizes(block_rows=1024),
    # 8192 elements per program, 32 per thread and operand with 8 warps:
    # eight 16-byte loads per thread and operand, few enough registers to
    # avoid spills in principle. A first choice, not yet tuned on a GPU.
    'gpu': BlockSizes(block_rows=64, num_warps=8),
    # Each interpreted grid step costs about 0.2 ms on CPU: few, large steps.
    'interpret': BlockSizes(block_rows=2048),
}


def interprets_by_default() -> bool:
  """Whether `sam_perturb(interpret=None)` runs in Pallas's interpreter here
  (a CPU default backend) rather than compiled.

  Example:

    >>> import jax
    >>> from geom.kernels import sam_perturb as k
    >>> k.interprets_by_default() == (jax.default_backend() == 'cpu')
    True
  """
  return jax.default_backend() == 'cpu'


def _sublane_tile(dtypes) -> int:
  """Rows of the smallest TPU tile of these dtypes (8 for 32-bit)."""
  return 8 * (4 // min(jnp.dtype(d).itemsize for d in dtypes))


def _tpu_width(w, g) -> int:
  """The lanes of a large leaf's TPU buffer: its own last dimension where
  that is a multiple of 128 and viewing the leaf as (rows, last) moves no
  data in TPU's tiled layout (the second-minor dimension a whole number of
  sublane tiles, or the leaf 2-D), and a block of one tile of rows fits
  VMEM; else 128 (a relayout copy)."""
  width = w.shape[-1] if w.ndim >= 2 else LANES
  tile = _sublane_tile((w.dtype, g.dtype))
  if width % LANES or (w.ndim > 2 and w.shape[-2] % tile):
    return LANES
  if (2 * tile * width * (2 * w.dtype.itemsize + g.dtype.itemsize)
      > _TPU_SCOPED_VMEM_BYTES // 2):
    return LANES
  return width


def _block_rows(rows: int, w, g, block_sizes: BlockSizes, target: str) -> int:
  """The rows of one block of a (rows, width) buffer, checked for `target`.

  `block_sizes.block_rows` counts rows of 128 lanes: a wider TPU buffer
  gets as many elements per block (rounded down to whole sublane tiles).
  """
  b = block_sizes.block_rows
  owner = f'{_OWNER}.BlockSizes'
  if target == 'gpu':
    if b & (b - 1):
      raise validation.ArgumentError(
          owner, 'block_rows', 'the GPU (Triton) kernels need a power of two',
          value=b)
    return min(b, pl.next_power_of_2(rows))
  if rows > b and b % _sublane_tile((w.dtype, g.dtype)):
    raise validation.ArgumentError(
        owner, 'block_rows',
        f'the TPU kernels need a multiple of {_sublane_tile((w.dtype, g.dtype))}'
        f' (the sublane tiling of {w.dtype}/{g.dtype}) for a buffer of '
        f'{rows} rows', value=b)
  width = w.shape[1]
  if width > LANES:
    tile = _sublane_tile((w.dtype, g.dtype))
    b = max(tile, b * LANES // width // tile * tile)
  b = min(b, rows)
  vmem = 2 * b * width * (2 * w.dtype.itemsize + g.dtype.itemsize)
  if vmem > _TPU_SCOPED_VMEM_BYTES:
    raise validation.ArgumentError(
        owner, 'block_rows',
        f'the TPU update would need {vmem / 2**20:.1f} MiB of VMEM per step '
        f'(three {w.dtype}/{g.dtype} operands, double-buffered); at most '
        f'{_TPU_SCOPED_VMEM_BYTES // 2**20} MiB', value=block_sizes.block_rows)
  return b


def _rows_valid(rows: int, block_rows: int, width: int) -> jax.Array:
  row = (pl.program_id(0) * block_rows
         + jax.lax.broadcasted_iota(jnp.int32, (block_rows, width), 0))
  return row < rows


def _read(ref, valid, masked: bool) -> jax.Array:
  if masked:  # Triton: reads past the end would touch other memory.
    return pltriton.load(ref, mask=valid, other=0).astype(jnp.float32)
  return ref[...].astype(jnp.float32)


def _norm_kernel(*refs, rows: int, block_rows: int, adaptive: bool,
                 masked: bool):
  if adaptive:
    eta_ref, w_ref, g_ref, m_ref, s_ref = refs
  else:
    g_ref, m_ref, s_ref = refs
  valid = _rows_valid(rows, block_rows, g_ref.shape[-1])
  x = _read(g_ref, valid, masked)
  if adaptive:
    x = (jnp.abs(_read(w_ref, valid, masked)) + eta_ref[0]) * x
  if masked:  # Triton's masked loads read 0 past the end.
    a = jnp.abs(x)
  else:  # TPU: rows past a ragged last block are undefined (NaN in the
    # interpreter): mask them before reducing.
    a = jnp.where(valid, jnp.abs(x), 0.0)
  m = jnp.max(a, axis=0, keepdims=True)
  s = jnp.sum(jnp.square(a / jnp.where(m > 0, m, 1.0)), axis=0,
              keepdims=True)
  m_ref[...] = m
  s_ref[...] = s


def _update_kernel(scalars_ref, w_ref, g_ref, o_ref, *, rows: int,
                   block_rows: int, adaptive: bool, masked: bool):
  # scalars: (scale, eta).
  valid = (_rows_valid(rows, block_rows, g_ref.shape[-1]) if masked
           else None)
  w = _read(w_ref, valid, masked)
  g = _read(g_ref, valid, masked)
  if adaptive:
    t = jnp.abs(w) + scalars_ref[1]
    g = t * t * g
  out = (w + scalars_ref[0] * g).astype(o_ref.dtype)
  if masked:
    pltriton.store(o_ref, out, mask=valid)
  else:  # Pallas drops the writes past the end of a ragged last block.
    o_ref[...] = out


def _out_like(x: jax.Array, shape, dtype) -> jax.ShapeDtypeStruct:
  # Inside shard_map, an output varies over the mesh axes its input does.
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.typeof(x).mat)


@dataclasses.dataclass(frozen=True)
class _Launch:
  """How the two passes launch on one (rows, 128) buffer."""
  target: str
  interpret: bool
  block_sizes: BlockSizes

  def layout(self, w, g):
    rows = w.shape[0]
    block_rows = _block_rows(rows, w, g, self.block_sizes, self.target)
    return rows, block_rows, pl.cdiv(rows, block_rows)

  def scalars_spec(self, n: int) -> pl.BlockSpec:
    if self.target == 'tpu':
      return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((n,), lambda i: (0,))

  def compiler_params(self):
    if self.target == 'tpu':
      return pltpu.CompilerParams(dimension_semantics=('parallel',))
    return pltriton.CompilerParams(num_warps=self.block_sizes.num_warps)

  def norm_stats(self, eta, w, g, adaptive: bool):
    """Per-lane (max |x|, sum (x / max)^2) of each block: (grid, 1, width)."""
    rows, block_rows, grid = self.layout(w, g)
    width = w.shape[1]
    tile = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
    per_block = pl.BlockSpec((None, 1, width), lambda i: (i, 0, 0))
    stats = _out_like(g, (grid, 1, width), jnp.float32)
    if adaptive:
      operands = (eta.reshape(1), w, g)
      in_specs = [self.scalars_spec(1), tile, tile]
    else:
      operands, in_specs = (g,), [tile]
    return pl.pallas_call(
        functools.partial(_norm_kernel, rows=rows, block_rows=block_rows,
                          adaptive=adaptive, masked=self.target == 'gpu'),
        out_shape=(stats, stats), grid=(grid,), in_specs=in_specs,
        out_specs=(per_block, per_block), interpret=self.interpret,
        compiler_params=self.compiler_params(),
        name='sam_perturb_norm')(*operands)

  def update(self, scale, eta, w, g, adaptive: bool):
    rows, block_rows, grid = self.layout(w, g)
    tile = pl.BlockSpec((block_rows, w.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_update_kernel, rows=rows, block_rows=block_rows,
                          adaptive=adaptive, masked=self.target == 'gpu'),
        out_shape=_out_like(g, w.shape, w.dtype), grid=(grid,),
        in_specs=[self.scalars_spec(2), tile, tile], out_specs=tile,
        interpret=self.interpret, compiler_params=self.compiler_params(),
        name='sam_perturb_update')(jnp.stack([scale, eta]), w, g)


def _buffers(params, grads, pack_below: int, leaf_axes=None,
             own_width: bool = False):
  """(rows, width) (w, g, axes) buffers: one per large aligned leaf, one
  per (dtype pair, axes) of the others (zero-padded, 128 wide).

  `own_width` (TPU): a large leaf keeps its last dimension as the width
  where that moves no data (`_tpu_width`); else every buffer is 128 wide.

  `leaf_axes[i]`: the mesh axes leaf i is sharded over (per device, the
  leaves are shards; leaves sharded over different axes are never packed
  together, since their norms combine over different axes); None: ().

  Returns the buffers and a function that maps the perturbed buffers back
  to the tree of `params`.
  """
  leaves_w, treedef = jax.tree.flatten(params)
  leaves_g = treedef.flatten_up_to(grads)
  if leaf_axes is None:
    leaf_axes = [()] * len(leaves_w)
  buffers, slots = [], []  # slots[leaf] = (buffer index, offset) or None.
  packs = {}
  for i, (w, g) in enumerate(zip(leaves_w, leaves_g)):
    if w.shape != g.shape:
      raise validation.ArgumentError(
          f'{_OWNER}.sam_perturb', 'grads',
          f'leaf {i} has shape {g.shape}, its parameter {w.shape}')
    if w.size >= max(pack_below, 1) and w.size % LANES == 0:
      slots.append((len(buffers), None))
      width = _tpu_width(w, g) if own_width else LANES
      buffers.append((w.reshape(-1, width), g.reshape(-1, width),
                      leaf_axes[i]))
    else:
      packs.setdefault((w.dtype, g.dtype, leaf_axes[i]), []).append(i)
      slots.append(None)
  for (_, _, axes), members in packs.items():
    offset = 0
    for i in members:
      slots[i] = (len(buffers), offset)
      offset += leaves_w[i].size
    pad = -offset % LANES

    def packed(leaves, members=members, pad=pad):
      flat = jnp.concatenate([leaves[i].reshape(-1) for i in members])
      return jnp.pad(flat, (0, pad)).reshape(-1, LANES)

    buffers.append((packed(leaves_w), packed(leaves_g), axes))

  def unflatten(outs):
    leaves = []
    for w, (b, offset) in zip(leaves_w, slots):
      flat = outs[b].reshape(-1)
      if offset is not None:
        flat = flat[offset:offset + w.size]
      leaves.append(flat.reshape(w.shape))
    return jax.tree.unflatten(treedef, leaves)

  return buffers, unflatten


def _combine(m: jax.Array, s: jax.Array) -> jax.Array:
  """Norm from per-lane (max, scaled sum of squares) pairs."""
  big = jnp.max(m)
  safe = jnp.where(big > 0, big, 1.0)
  return jnp.where(big > 0, big * jnp.sqrt(jnp.sum(s * jnp.square(m / safe))),
                   0.0)


def _combine_shards(stats, mesh_axes) -> jax.Array:
  """The global norm from each device's per-lane (max, scaled sum of
  squares) pairs of its shards, `stats` = [((m, s), axes)].

  The largest magnitude is a max over every device (a replica counted
  twice changes no max); each group of buffers then adds its scaled sums
  of squares over exactly the axes its leaves are sharded over, so a leaf
  replicated over an axis is counted once. Every device ends with the
  same norm.
  """
  local = [jnp.max(m) for (m, _), _ in stats]
  big = jax.lax.pmax(functools.reduce(jnp.maximum, local,
                                      jnp.zeros((), jnp.float32)),
                     tuple(mesh_axes))
  safe = jnp.where(big > 0, big, 1.0)
  groups = {}
  for (m, s), axes in stats:
    groups.setdefault(axes, []).append(jnp.sum(s * jnp.square(m / safe)))
  total = jnp.zeros((), jnp.float32)
  for axes, parts in groups.items():
    part = functools.reduce(jnp.add, parts)
    total = total + (jax.lax.psum(part, axes) if axes else part)
  return jnp.where(big > 0, big * jnp.sqrt(total), 0.0)


@dataclasses.dataclass(frozen=True)
class _Shards:
  """How a call's leaves are laid out on the devices (see `_partition`).

  Attributes:
    leaf_axes: per leaf of `params`, the mesh axes it is sharded over.
    mesh_axes: every axis of the mesh.
  """
  leaf_axes: tuple[tuple[str, ...], ...]
  mesh_axes: tuple[str, ...]


def _fused(params, grads, rho, eta, eps, *, adaptive: bool,
           launch: _Launch, shards: _Shards | None = None):
  """The perturbation on whole arrays (`shards` None) or, per device, on
  each device's shards with the norm combined across the mesh."""
  eta = jnp.asarray(eta, jnp.float32)
  buffers, unflatten = _buffers(params, grads, launch.block_sizes.pack_below,
                                shards and shards.leaf_axes,
                                own_width=launch.target == 'tpu')
  live = [(w, g, axes) for w, g, axes in buffers if w.size]
  stats = [(launch.norm_stats(eta, w, g, adaptive), axes)
           for w, g, axes in live]
  if shards is not None:
    norm = _combine_shards(stats, shards.mesh_axes)
  elif live:
    norm = _combine(jnp.concatenate([m.reshape(-1) for (m, _), _ in stats]),
                    jnp.concatenate([s.reshape(-1) for (_, s), _ in stats]))
  else:
    norm = jnp.zeros((), jnp.float32)
  scale = (jnp.asarray(rho, jnp.float32) / (norm + eps)).astype(jnp.float32)
  outs = [launch.update(scale, eta, w, g, adaptive) if w.size else w
          for w, g, _ in buffers]
  return unflatten(outs), norm


# The platforms `platform_dependent` names, and the bodies each one gets
# when `target` is None.
_PLATFORM_TARGETS = {'cpu': 'tpu', 'tpu': 'tpu', 'cuda': 'gpu', 'rocm': 'gpu'}


def _per_platform(adaptive: bool, block_sizes: BlockSizes | None,
                  target: str | None, interpret: bool | None):
  """`_fused` for each platform, keyed by (body, interpreted)."""
  choices = {}
  for platform, default_target in _PLATFORM_TARGETS.items():
    t = target or default_target
    interp = platform == 'cpu' if interpret is None else interpret
    sizes = block_sizes or BlockSizes.for_target('interpret' if interp else t)
    choices[platform] = functools.partial(
        _fused, adaptive=adaptive, launch=_Launch(t, interp, sizes))
  return choices


def _on_platform(choices, shards: _Shards | None, platforms=None):
  """`_fused` with the bodies of the platform the call is lowered for."""
  per_platform = {p: functools.partial(f, shards=shards)
                  for p, f in choices.items()
                  if platforms is None or p in platforms}
  distinct = {f.keywords['launch']: f for f in per_platform.values()}
  if len(distinct) == 1:
    return next(iter(distinct.values()))
  return lambda *args: jax.lax.platform_dependent(*args, **per_platform)


def _axes_of(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _even_spec(sharding, shape, mesh) -> P:
  """The sharding's PartitionSpec, each dimension kept only where the mesh
  axes divide it evenly (an uneven one is replicated, so that no device
  holds padding the kernels would read)."""
  spec = getattr(sharding, 'spec', None) or P()
  entries = []
  for d, size in enumerate(shape):
    entry = spec[d] if d < len(spec) else None
    axes = _axes_of(entry)
    split = math.prod(mesh.shape[a] for a in axes)
    entries.append(entry if axes and size % split == 0 else None)
  return P(*entries)


def _layout(mesh, leaves, shardings):
  """Per leaf, the PartitionSpec the kernels run on, and the `_Shards`."""
  specs = [_even_spec(s, x.shape, mesh) for x, s in zip(leaves, shardings)]
  # The axes of each leaf in the mesh's order: leaves split over the same
  # axes, in any order or dimension, share a packed buffer and a sum.
  split = [{a for entry in spec for a in _axes_of(entry)} for spec in specs]
  shards = _Shards(
      tuple(tuple(a for a in mesh.axis_names if a in axes) for axes in split),
      tuple(mesh.axis_names))
  return specs, shards


def _sharding_rule(params) -> cp.SdyShardingRule:
  """Shardy's rule: w, g and w' of a leaf share one factor per dimension
  (elementwise); rho, eta, eps and the norm are replicated scalars."""
  leaves = jax.tree.leaves(params)
  maps = tuple(cp.ArrayMapping(*(f'l{i}d{d}' for d in range(jnp.ndim(x))))
               for i, x in enumerate(leaves))
  scalar = cp.ArrayMapping()
  return cp.SdyShardingRule(operand_mappings=maps + maps + (scalar,) * 3,
                            result_mappings=maps + (scalar,))


def _custom_partitioned(fused, args):
  """`fused` as one op that the SPMD partitioner splits (GPU, CPU).

  Unpartitioned (one device, or inside a `shard_map` over every mesh axis)
  it is `fused` on whole arrays. Under `jax.jit` over several devices the
  partitioner calls `partition`: each device runs the kernels on its own
  shard of every leaf, laid out as the partitioner chose (`_even_spec`),
  the norm is combined over the mesh (`_combine_shards`), and w' keeps
  w's layout. Where the partitioner names no mesh (a `shard_map` that
  leaves some axes automatic) the leaves are taken whole over those axes.
  """
  params = args[0]

  def whole(params, grads, rho, eta, eps):
    return fused(params, grads, rho, eta, eps, shards=None)

  op = cp.custom_partitioning(whole)

  def layout(mesh, params_shapes):
    leaves, treedef = jax.tree.flatten(params_shapes)
    if mesh.empty:
      specs, shards = [P()] * len(leaves), None
    else:
      specs, shards = _layout(mesh, leaves, [x.sharding for x in leaves])
    tree = jax.tree.unflatten(treedef, [NamedSharding(mesh, s)
                                        for s in specs])
    return tree, shards

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    shardings, shards = layout(mesh, arg_shapes[0])
    scalar = NamedSharding(mesh, P())
    return (mesh, functools.partial(fused, shards=shards),
            (shardings, scalar), (shardings, shardings, scalar, scalar, scalar))

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    # The GSPMD partitioner's question (Shardy reads the rule instead).
    del result_shape
    return layout(mesh, arg_shapes[0])[0], NamedSharding(mesh, P())

  op.def_partition(partition=partition,
                   infer_sharding_from_operands=infer_sharding_from_operands,
                   sharding_rule=_sharding_rule(params))
  return op(*args)


def _automatically_partitioned(axis_context) -> bool:
  """Whether code lowered in this context is split by the SPMD partitioner
  (where Pallas refuses Mosaic kernels): a jit over several devices, or a
  `shard_map` that leaves some mesh axes automatic. Pallas's own test."""
  if hasattr(axis_context, 'manual_axes'):  # Inside a shard_map.
    mesh = axis_context.mesh
    manual = set(axis_context.manual_axes) | set(getattr(mesh, 'manual_axes',
                                                         ()))
    return bool(axis_context.manual_axes) and manual != set(mesh.axis_names)
  return getattr(axis_context, 'num_devices', 1) != 1


# TPU: Mosaic kernels where nothing is partitioned, XLA's fusion of the same
# arithmetic where the partitioner splits the call (Mosaic kernels cannot be
# partitioned automatically, and libtpu has no custom_partitioning).
_kernels_or_xla_p = jex.Primitive('sam_perturb_kernels_or_xla')
_kernels_or_xla_p.multiple_results = True
_kernels_or_xla_p.def_impl(
    lambda *args, kernels, xla: jex.jaxpr_as_fun(kernels)(*args))
_kernels_or_xla_p.def_abstract_eval(
    lambda *avals, kernels, xla: kernels.out_avals)


def _kernels_or_xla_lowering(ctx, *args, kernels, xla):
  chosen = (xla if _automatically_partitioned(ctx.module_context.axis_context)
            else kernels)
  return mlir.lower_fun(jex.jaxpr_as_fun(chosen), multiple_results=True)(
      ctx, *args)


mlir.register_lowering(_kernels_or_xla_p, _kernels_or_xla_lowering)


def _kernels_or_xla(fused, adaptive: bool, args):
  params, grads, rho, eta, eps = args

  def xla(params, grads, rho, eta, eps):
    out, norm = sam_perturb_reference(params, grads, rho, adaptive=adaptive,
                                      eta=eta, eps=eps)
    return out, norm.astype(jnp.float32)

  kernels, out_shape = jax.make_jaxpr(
      functools.partial(fused, shards=None), return_shape=True)(*args)
  outs = _kernels_or_xla_p.bind(*jax.tree.leaves(args), kernels=kernels,
                                xla=jax.make_jaxpr(xla)(*args))
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _shard_mapped(choices, shardings, args):
  """The kernels in a `shard_map` over the mesh of `shardings`, each device
  on its own shards (every backend, TPU included)."""
  params = args[0]
  leaves, treedef = jax.tree.flatten(params)
  per_leaf = treedef.flatten_up_to(jax.tree.broadcast(
      shardings, params, is_leaf=lambda x: isinstance(x, NamedSharding)))
  meshes = {s.mesh for s in per_leaf}
  if len(meshes) != 1 or not all(isinstance(s, NamedSharding)
                                 for s in per_leaf):
    raise validation.ArgumentError(
        f'{_OWNER}.sam_perturb', 'shardings',
        'must be NamedShardings over one mesh (one for all leaves, or a '
        'tree like params)')
  mesh = meshes.pop()
  specs, shards = _layout(mesh, leaves, per_leaf)
  spec_tree = jax.tree.unflatten(treedef, specs)
  return jax.shard_map(
      _on_platform(choices, shards), mesh=mesh,
      in_specs=(spec_tree, spec_tree, P(), P(), P()),
      out_specs=(spec_tree, P()), check_vma=False)(*args)


def _one_device_context() -> bool:
  """Whether the call is traced under a mesh of one device (e.g. the
  abstract mesh that names a TPU chip for lowering from a host), where
  there is nothing to partition."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size == 1


@functools.lru_cache(maxsize=None)
def _differentiation_guarded(adaptive, block_sizes, target, interpret,
                             shardings_key):
  """The kernels for these static options, picked where they are lowered,
  partitioned per shard, with a VJP that explains itself.

  `shardings_key`: None, or the `shardings` argument as (treedef, leaves).
  """
  choices = _per_platform(adaptive, block_sizes, target, interpret)
  shardings = (None if shardings_key is None
               else jax.tree.unflatten(*shardings_key))

  def fn(params, grads, rho, eta, eps):
    args = (params, grads, *(jnp.asarray(x, jnp.float32)
                             for x in (rho, eta, eps)))
    if shardings is not None:
      return _shard_mapped(choices, shardings, args)
    if not jax.tree.leaves(params) or _one_device_context():
      return _on_platform(choices, None)(*args)
    # One branch per distinct body (CUDA and ROCm share theirs): each is
    # traced once.
    branches, per_platform = {}, {}
    for platform, fused in choices.items():
      key = (platform == 'tpu', fused.keywords['launch'])
      if key not in branches:
        branches[key] = (functools.partial(_kernels_or_xla, fused, adaptive)
                         if platform == 'tpu' else
                         functools.partial(_custom_partitioned, fused))
      per_platform[platform] = branches[key]
    return jax.lax.platform_dependent(args, **per_platform)

  guarded = jax.custom_vjp(fn)

  def fwd(*args):
    return fn(*args), None

  def bwd(_, cotangents):
    del cotangents
    raise TypeError(
        'geom.kernels.sam_perturb is not differentiable: it computes SAM\'s '
        'ascent point, which SAM does not differentiate through. Call it '
        'outside jax.grad (as geom.sam does), or use '
        'sam_perturb_reference or geom.sam.perturbation (plain jnp).')

  guarded.defvjp(fwd, bwd)
  return guarded


def sam_perturb(params: Params, grads: Params, rho: float | jax.Array, *,
                adaptive: bool = False, eta: float | jax.Array = 0.01,
                eps: float | jax.Array = 1e-12,
                block_sizes: BlockSizes | None = None,
                target: str | None = None,
                interpret: bool | None = None,
                shardings: Any = None) -> tuple[Params, jax.Array]:
  """w + rho g / (|g| + eps) (ASAM: w + rho T^2 g / (|T g| + eps)), fused.

  Args:
    params: w (any float dtypes; each leaf keeps its dtype).
    grads: g, a tree like `params` with leaves of the same shapes.
    rho: the radius (a scalar; rho, eta and eps may be traced).
    adaptive: ASAM, with T = |w| + eta elementwise.
    eta: ASAM's offset.
    eps: added to the norm (g = 0 gives w back, not NaN).
    block_sizes: tile sizes; None: `BlockSizes.for_target` of each
      platform's kernels ('interpret' for interpreted ones).
    target: the kernel bodies: 'tpu' (Mosaic) or 'gpu' (Triton); None:
      chosen where the call is lowered (TPU bodies on TPU and, interpreted,
      on CPU; Triton bodies on CUDA and ROCm GPUs).
    interpret: run in Pallas's interpreter; None: on CPU only.
    shardings: None, or NamedShardings (one for all leaves, or a tree like
      `params`) of the leaves over one mesh: the kernels then run in a
      `shard_map` over it, each device on its shards
      (docs/methods/sam_perturb.md). Without it, under `jax.jit` the SPMD
      partitioner splits the call (GPU, CPU) or XLA's fusion runs where it
      splits it (TPU).

  Returns:
    (the perturbed params, the global norm |g| or |T g| in float32).

  Raises:
    ArgumentError: `target` is not a valid choice, a leaf of `grads` has
      another shape than its parameter, `block_sizes` does not suit
      the kernels, or `shardings` are not over one mesh (named, before
      any compute).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom.kernels import sam_perturb as k
    >>> w, g = {'a': jnp.ones(5)}, {'a': jnp.full(5, 2.0)}
    >>> perturbed, norm = k.sam_perturb(w, g, 0.5)
    >>> round(float(norm), 4), round(float(perturbed['a'][0]), 4)
    (4.4721, 1.2236)
  """
  if target is not None:
    validation.check_choice(f'{_OWNER}.sam_perturb', 'target', target,
                            TARGETS)
  if shardings is not None:
    leaves, treedef = jax.tree.flatten(shardings)
    shardings = (treedef, tuple(leaves))
  fn = _differentiation_guarded(
      bool(adaptive), block_sizes, target,
      None if interpret is None else bool(interpret), shardings)
  return fn(params, grads, rho, eta, eps)


def sam_perturb_reference(params: Params, grads: Params, rho, *,
                          adaptive: bool = False, eta: float = 0.01,
                          eps: float = 1e-12) -> tuple[Params, jax.Array]:
  """`sam_perturb` in plain jnp (float32 arithmetic; the scale-safe norm of
  `geom.tree_norm`, as the kernel's blockwise one).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom.kernels import sam_perturb as k
    >>> w, g = {'a': jnp.ones(5)}, {'a': jnp.full(5, 2.0)}
    >>> reference, norm = k.sam_perturb_reference(w, g, 0.5)
    >>> fused, _ = k.sam_perturb(w, g, 0.5)
    >>> bool(jnp.allclose(fused['a'], reference['a'])), round(float(norm), 4)
    (True, 4.4721)
  """
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  w, g = f32(params), f32(grads)
  if adaptive:
    t = jax.tree.map(lambda x: jnp.abs(x) + eta, w)
    x = jax.tree.map(jnp.multiply, t, g)
    d = jax.tree.map(lambda ti, gi: ti * ti * gi, t, g)
  else:
    x, d = g, g
  norm = tree_norm.tree_norm_f32(x)
  scale = jnp.asarray(rho, jnp.float32) / (norm + eps)
  perturbed = jax.tree.map(lambda p, wi, di: (wi + scale * di).astype(p.dtype),
                           params, w, d)
  return perturbed, norm
