"""Fingerprints of a train state, computed on its devices, for verified checkpoints.

Every leaf gets a 64-bit fingerprint: each element's bits (its dtype's
width, as an unsigned integer) are mixed with its position by two
murmur3-style finalisers, and the mixed words are summed modulo 2^32, one
sum per finaliser seed. Integer sums are exact and order-free, so the
fingerprint does not depend on the mesh, the sharding or the reduction
order: a checkpoint saved on 8 devices verifies when restored on 4. One
flipped bit changes an element's mixed word in each lane, so it changes
both sums unless two 32-bit collisions coincide (about 2^-64).

The work is a reduction over the state on the devices that hold it, run at
checkpoint steps only (where the loop waits for the state anyway to copy
it to the host); no accelerator's array goes to the host for it. A small
leaf on CPU devices (already in host memory) is summed by numpy with the
same arithmetic: a program per leaf shape cost each process 30-40 ms of
tracing and compiling apiece, far more than the sum.
"""

from collections.abc import Mapping
import hashlib
import json
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

_SEEDS = (0x9E3779B9, 0x85EBCA6B)


def _fmix32(h, uint32=jnp.uint32):
  """murmur3's finaliser on uint32 words: jnp's, or numpy's with
  `uint32=np.uint32` (the same wrapping arithmetic on the host)."""
  h = h ^ (h >> 16)
  h = h * uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
  """Each element's bits as uint32 (64-bit elements as two words)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  width = np.dtype(x.dtype).itemsize
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
  bits = lax.bitcast_convert_type(x, unsigned[width])
  return bits.astype(jnp.uint32)


def _position(shape: tuple[int, ...]) -> jax.Array:
  """Each element's row-major index (mod 2^32), built without a reshape
  so that a sharded leaf stays sharded."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(
        stride % 2**32)
    stride *= shape[dim]
  return index


def _leaf(x: jax.Array) -> jax.Array:
  bits = _bits(x)
  position = _position(bits.shape)
  lanes = [jnp.sum(_fmix32(bits ^ _fmix32(position + jnp.uint32(seed))),
                   dtype=jnp.uint32) for seed in _SEEDS]
  return jnp.stack(lanes)


# One program per leaf, not one for the tree: XLA's CPU backend keeps a
# leaf's mixed words (twice its size) in the program's temporary buffers,
# and one program over a whole tree held them for every leaf at once (6
# GiB over the 270M Gemma's RL state, its run's peak; now twice the
# largest leaf).
_leaf_program = jax.jit(_leaf)


# Up to this many elements, a leaf on CPU devices is summed by numpy (its
# temporaries are a few times the leaf); larger ones by the program.
HOST_MAX_ELEMENTS = 1 << 20


def _leaf_on_host(x: np.ndarray) -> np.ndarray:
  """`_leaf` in numpy (uint32 arithmetic wraps alike), for `x` on the
  host with the dtype the program would see."""
  width = x.dtype.itemsize
  if x.dtype == np.bool_:
    bits = x.astype(np.uint32)
  elif width == 8:  # Two words per element, low word first, as XLA's bitcast.
    bits = np.ascontiguousarray(x).view(np.uint32).reshape(x.shape + (2,))
  else:
    bits = np.ascontiguousarray(x).view(f'u{width}').astype(np.uint32)
  position = (np.arange(bits.size, dtype=np.uint64) % 2**32).astype(
      np.uint32).reshape(bits.shape)
  with np.errstate(over='ignore'):
    return np.stack([np.sum(_fmix32(bits ^ _fmix32(
        position + np.uint32(seed), np.uint32), np.uint32), dtype=np.uint32)
                     for seed in _SEEDS])


def _on_host(x: Any) -> bool:
  """Whether `x` is a small jax.Array whose devices are this host's CPU."""
  return (isinstance(x, jax.Array) and x.is_fully_addressable
          and x.size <= HOST_MAX_ELEMENTS
          and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
          and all(d.platform == 'cpu' for d in x.sharding.device_set))


def fingerprint(tree: Any) -> dict[str, str]:
  """`{leaf path: 16 hex digits}` for every array leaf of `tree`."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get([
      _leaf_on_host(np.asarray(x)) if _on_host(x) else _leaf_program(x)
      for _, x in leaves])
  return {jax.tree_util.keystr(path): f'{int(v[0]):08x}{int(v[1]):08x}'
          for (path, _), v in zip(leaves, sums)}


def mismatches(saved: Mapping[str, str], actual: Mapping[str, str]
               ) -> list[str]:
  """The leaf paths whose fingerprints differ (or exist on one side only)."""
  return sorted(k for k in set(saved) | set(actual)
                if saved.get(k) != actual.get(k))


def digest(tree: Any) -> str:
  """One 'sha256:<hex>' for all of `tree`'s arrays (their `fingerprint`s
  and paths): what a run records of an input it reads, e.g. a source
  model's parameters, to find it changed on resume."""
  text = json.dumps(fingerprint(tree), sort_keys=True)
  return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()
