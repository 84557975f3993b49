"""A Pallas kernel pair for SAM's perturbation: w + rho g / |g| (and ASAM's).

Two passes over the parameters, as in apex's multi-tensor L2-norm-and-scale:

1. `_norm_kernel`: per block of `BlockSizes.block` elements, the largest
   magnitude m and the sum of (x / m)^2, in float32 whatever the input
   dtype (x = g, or T g with T = |w| + eta for ASAM). Out-of-range elements
   of a ragged last block are masked. Combining the blocks as
   M sqrt(sum_b s_b (m_b / M)^2), M = max_b m_b, cannot overflow or
   underflow where a plain sum of squares would (|g| near 1e20 or 1e-25 in
   float32).
2. `_update_kernel`: w' = w + scale * g (ASAM: + scale * T^2 g) with
   scale = rho / (norm + eps), computed in float32 and cast to w's dtype.

Leaves are handled in few launches: each leaf of at least
`BlockSizes.pack_below` elements is one launch per pass, on its own buffer
(no copy); the smaller leaves of each dtype pair are packed into one
buffer. `sam_perturb_reference` is the same computation in plain jnp.

Inside `jax.jit` with sharded arrays XLA gathers the kernel's operands, so
the norm is the global one; inside `shard_map` each device gets its own
(what m-sharpness wants). The kernels are not differentiable: SAM never
differentiates through its perturbation, and `jax.grad` through
`sam_perturb` raises a clear error instead of failing to linearize.

`interpret=None` runs the kernels in Pallas's interpreter on a CPU backend
and compiles them elsewhere. Compiling them does not work yet: lowered for
GPU with `jax.export`, the default 64K-element block exceeds shared memory
and small leaves break the copy alignment; for TPU, rank-1 blocks must be
multiples of 1024 and the per-block scalars cannot be stored to VMEM.
"""

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from geom import tree_norm
from geom import validation

__all__ = ['BlockSizes', 'interprets_by_default', 'sam_perturb',
           'sam_perturb_reference']

Params = Any


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes.

  Attributes:
    block: elements per grid step (a power of two suits GPU and TPU).
    pack_below: leaves smaller than this are packed into one buffer per
      dtype pair, so that many small leaves cost one launch.
  """
  block: int = 64 * 1024
  pack_below: int = 64 * 1024

  def __post_init__(self):
    owner = 'geom.kernels.sam_perturb.BlockSizes'
    validation.check(owner, 'block', self.block, lambda v: v >= 1, '>= 1')
    validation.check(owner, 'pack_below', self.pack_below, lambda v: v >= 0,
                     '>= 0')


def interprets_by_default() -> bool:
  """Whether `sam_perturb(interpret=None)` runs in Pallas's interpreter
  (on a CPU backend) rather than compiled."""
  return jax.default_backend() == 'cpu'


def _scaled_sum_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(max |x|, sum (x / max)^2) of a float32 vector; (0, 0) for zeros."""
  a = jnp.abs(x)
  m = jnp.max(a)
  safe = jnp.where(m > 0, m, 1.0)
  return m, jnp.sum(jnp.square(a / safe))


def _combine(m: jax.Array, s: jax.Array) -> jax.Array:
  """Norm from per-block (max, scaled sum of squares)."""
  big = jnp.max(m)
  safe = jnp.where(big > 0, big, 1.0)
  return jnp.where(big > 0, big * jnp.sqrt(jnp.sum(s * jnp.square(m / safe))),
                   0.0)


def _ascent_direction(w, g, adaptive: bool, eta: float):
  if adaptive:
    t = jnp.abs(w) + eta
    return t, g * t
  return None, g


def _norm_kernel(*refs, n: int, block: int, adaptive: bool):
  if adaptive:
    eta_ref, w_ref, g_ref, m_ref, s_ref = refs
  else:
    g_ref, m_ref, s_ref = refs
  g = g_ref[...].astype(jnp.float32)
  w = w_ref[...].astype(jnp.float32) if adaptive else None
  _, x = _ascent_direction(w, g, adaptive, eta_ref[0] if adaptive else None)
  index = (pl.program_id(0) * block
           + jax.lax.broadcasted_iota(jnp.int32, (block,), 0))
  # Elements past the end of a ragged last block are undefined (NaN in the
  # interpreter): mask them before reducing.
  x = jnp.where(index < n, x, 0.0)
  m, s = _scaled_sum_stats(x)
  m_ref[0] = m
  s_ref[0] = s


def _update_kernel(scalars_ref, w_ref, g_ref, o_ref, *, adaptive: bool):
  # scalars: (scale, eta).
  w = w_ref[...].astype(jnp.float32)
  g = g_ref[...].astype(jnp.float32)
  t, _ = _ascent_direction(w, g, adaptive, scalars_ref[1])
  d = t * t * g if adaptive else g
  # Writes past the end of a ragged last block are dropped by Pallas.
  o_ref[...] = (w + scalars_ref[0] * d).astype(o_ref.dtype)


def _out_like(x: jax.Array, shape, dtype) -> jax.ShapeDtypeStruct:
  # Inside shard_map, an output varies over the mesh axes its input does.
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.typeof(x).mat)


def _norm_stats(eta, w, g, *, adaptive, block, interpret):
  n = g.shape[0]
  block = min(block, n)
  grid = pl.cdiv(n, block)
  vec = pl.BlockSpec((block,), lambda i: (i,))
  one = pl.BlockSpec((1,), lambda i: (i,))
  stats = _out_like(g, (grid,), jnp.float32)
  kernel = functools.partial(_norm_kernel, n=n, block=block,
                             adaptive=adaptive)
  if adaptive:
    operands = (eta.reshape(1), w, g)
    in_specs = [pl.BlockSpec((1,), lambda i: (0,)), vec, vec]
  else:
    operands, in_specs = (g,), [vec]
  return pl.pallas_call(
      kernel, out_shape=(stats, stats), grid=(grid,), in_specs=in_specs,
      out_specs=(one, one), interpret=interpret)(*operands)


def _update(scale, eta, w, g, *, adaptive, block, interpret):
  n = w.shape[0]
  block = min(block, n)
  vec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(
      functools.partial(_update_kernel, adaptive=adaptive),
      out_shape=_out_like(g, w.shape, w.dtype),
      grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)), vec, vec],
      out_specs=vec, interpret=interpret)(jnp.stack([scale, eta]), w, g)


def _buffers(params, grads, pack_below: int):
  """Flat (w, g) buffers: one per large leaf, one per dtype pair of small ones.

  Returns the buffers and a function that maps the perturbed buffers back
  to the tree of `params`.
  """
  leaves_w, treedef = jax.tree.flatten(params)
  leaves_g = treedef.flatten_up_to(grads)
  buffers, slots = [], []  # slots[leaf] = (buffer index, offset) or None.
  packs = {}
  for i, (w, g) in enumerate(zip(leaves_w, leaves_g)):
    if w.size >= pack_below:
      slots.append((len(buffers), None))
      buffers.append((w.reshape(-1), g.reshape(-1)))
    else:
      packs.setdefault((w.dtype, g.dtype), []).append(i)
      slots.append(None)
  for members in packs.values():
    offset = 0
    for i in members:
      slots[i] = (len(buffers), offset)
      offset += leaves_w[i].size
    buffers.append((
        jnp.concatenate([leaves_w[i].reshape(-1) for i in members]),
        jnp.concatenate([leaves_g[i].reshape(-1) for i in members])))

  def unflatten(outs):
    leaves = []
    for w, (b, offset) in zip(leaves_w, slots):
      flat = outs[b] if offset is None else outs[b][offset:offset + w.size]
      leaves.append(flat.reshape(w.shape))
    return jax.tree.unflatten(treedef, leaves)

  return buffers, unflatten


def _fused(params, grads, rho, eta, eps, *, adaptive, block_sizes,
           interpret):
  eta = jnp.asarray(eta, jnp.float32)
  buffers, unflatten = _buffers(params, grads, block_sizes.pack_below)
  stats = [_norm_stats(eta, w, g, adaptive=adaptive, block=block_sizes.block,
                       interpret=interpret)
           for w, g in buffers if w.size]
  if stats:
    norm = _combine(jnp.concatenate([m for m, _ in stats]),
                    jnp.concatenate([s for _, s in stats]))
  else:
    norm = jnp.zeros((), jnp.float32)
  scale = (jnp.asarray(rho, jnp.float32) / (norm + eps)).astype(jnp.float32)
  outs = [_update(scale, eta, w, g, adaptive=adaptive,
                  block=block_sizes.block, interpret=interpret)
          if w.size else w
          for w, g in buffers]
  return unflatten(outs), norm


@functools.lru_cache(maxsize=None)
def _differentiation_guarded(adaptive, block_sizes, interpret):
  """`_fused` for these static options, with a VJP that explains itself."""
  fn = functools.partial(_fused, adaptive=adaptive, block_sizes=block_sizes,
                         interpret=interpret)
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
                adaptive: bool = False, eta: float = 0.01,
                eps: float = 1e-12, block_sizes: BlockSizes | None = None,
                interpret: bool | None = None) -> tuple[Params, jax.Array]:
  """w + rho g / (|g| + eps) (ASAM: w + rho T^2 g / (|T g| + eps)), fused.

  Args:
    params: w (any float dtypes; each leaf keeps its dtype).
    grads: g, a tree like `params`.
    rho: the radius (a scalar; rho, eta and eps may be traced).
    adaptive: ASAM, with T = |w| + eta elementwise.
    eta: ASAM's offset.
    eps: added to the norm (g = 0 gives w back, not NaN).
    block_sizes: tile sizes; None for the defaults.
    interpret: run in Pallas's interpreter; None: on CPU only.

  Returns:
    (the perturbed params, the global norm |g| or |T g| in float32).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom.kernels import sam_perturb as k
    >>> w, g = {'a': jnp.ones(5)}, {'a': jnp.full(5, 2.0)}
    >>> perturbed, norm = k.sam_perturb(w, g, 0.5)
    >>> round(float(norm), 4), round(float(perturbed['a'][0]), 4)
    (4.4721, 1.2236)
  """
  if interpret is None:
    interpret = interprets_by_default()
  fn = _differentiation_guarded(bool(adaptive), block_sizes or BlockSizes(),
                                bool(interpret))
  return fn(params, grads, rho, eta, eps)


def sam_perturb_reference(params: Params, grads: Params, rho, *,
                          adaptive: bool = False, eta: float = 0.01,
                          eps: float = 1e-12) -> tuple[Params, jax.Array]:
  """`sam_perturb` in plain jnp (float32 arithmetic; the scale-safe norm of
  `geom.tree_norm`, as the kernel's blockwise one)."""
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
