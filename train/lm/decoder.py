"""A small decoder-only language model: pre-RMSNorm blocks, rotary positions, KV cache.

Llama's layout at toy scale (pre-RMSNorm attention and SwiGLU MLP blocks
on a residual stream, rotary position embeddings, untied output head):
spherical steering's argument rests on pre-norm blocks, where the
residual stream's direction, not its norm, is what the next block reads.

One call handles both full sequences and cached decoding. Token slots
are absolute positions in a buffer; `valid` marks real tokens (False for
left padding and for not-yet-generated slots), and a token's rotary
position counts the valid tokens before it, so a left-padded prompt gets
the same positions as the same prompt alone. A query attends to the
valid keys at slots up to its own. The cache holds every layer's keys
and values for `max_len` slots, which slots are valid, and the number of
slots written.

The blocks (`Block`: attention, MLP, norms) serve Gemma 3 as well
(`train.lm.gemma`): what its blocks do differently is a `Recipe`, and
`run_blocks` runs either family's blocks over the cache.

Parameters carry logical axes ('vocab', 'embed', 'heads', 'kv_heads',
'mlp') for `train.training.sharding`; block i is the submodule `block_i`, whose
output (the residual stream after the block) is what
`train.lm.hooks` steers.

For pod-scale sizes (configs/lm.py `size=`): grouped-query attention
(`num_kv_heads` < `num_heads`: each group of query heads shares one key
and value head, as Llama 2/3 do), a compute `dtype` ('bfloat16': the
activations and matmuls, with float32 parameters, norms, softmax and
logits, MaxText's default mixed precision), and `remat` (each block's
activations recomputed in the backward pass instead of kept). Their
defaults (one key/value head per query head, float32, no remat) compute
exactly what the model computed before they existed.
"""

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

_NEG = -1e9  # Finite, so a fully masked (padding) query gives no NaN.
DTYPES = ('float32', 'bfloat16')


class Cache(NamedTuple):
  """Keys and values of every layer for `max_len` slots.

  Attributes:
    keys, values: per layer, (batch, max_len, key/value heads, head_dim).
    valid: (batch, max_len) bool, the slots holding real tokens.
    length: slots written so far (int32 scalar); the next call writes at
      [length, length + seq).
  """
  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  valid: jax.Array
  length: jax.Array


def _param(init, axes):
  return nn.with_logical_partitioning(init, axes)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """x's sharding by logical axes, where a step is traced under a mesh and
  rules (`train.training.aot.Program`); elsewhere nothing. Without it XLA may follow
  an FSDP weight's split and shard activations by features instead of by
  batch (measured: the 1b config's train step then needs 147 GiB per v5e
  chip)."""
  return nn.with_logical_constraint(x, axes)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a family's blocks differ from the in-project decoder's (the
  defaults); Gemma 3 (`train.lm.gemma`) sets every field.

  Attributes:
    activation: the gated MLP's gate, 'silu' (SwiGLU) or 'gelu_tanh'
      (GeGLU, gelu's tanh approximation).
    norm_plus_one: RMSNorm scales by (1 + w), w zero at init, instead of
      by w, one at init.
    sandwich_norms: RMSNorm after the attention and the MLP too.
    qk_norm: RMS-normalised queries and keys before the rotary embedding.
    prescaled_queries: queries times 1/sqrt(head_dim) before the logits,
      instead of the logits divided by sqrt(head_dim) (the same product,
      rounded differently: each family keeps its reference's order).
    eps: every RMSNorm's epsilon.
  """
  activation: str = 'silu'
  norm_plus_one: bool = False
  sandwich_norms: bool = False
  qk_norm: bool = False
  prescaled_queries: bool = False
  eps: float = 1e-6


DECODER = Recipe()
ACTIVATIONS = {'silu': nn.silu,
               'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True)}


class RMSNorm(nn.Module):
  """RMS normalisation, scaling by w (ones at init), or with `plus_one` by
  (1 + w) (zeros at init, so zero weights are the identity)."""
  eps: float = 1e-6
  axis_name: str | None = 'embed'
  plus_one: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param('scale', _param(init, (self.axis_name,)),
                       (x.shape[-1],))
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
    return (y * ((1.0 + scale) if self.plus_one else scale)).astype(x.dtype)


class Slots(NamedTuple):
  """Where one call's tokens sit among the cache's slots.

  Attributes:
    positions: (batch, seq) rotary position of each query: the valid
      tokens before it, so left padding shifts nothing.
    key_valid: (batch, slots) the keys holding real tokens.
    key_positions: (batch, slots) each key's position (for windows).
    query_slots: (seq,) the queries' slots.
    start: the first slot this call writes.
  """
  positions: jax.Array
  key_valid: jax.Array
  key_positions: jax.Array
  query_slots: jax.Array
  start: jax.Array


def slots(valid: jax.Array, cache: 'Cache | None') -> Slots:
  """The slots of a call on `valid` (batch, seq), after `cache` (or none)."""
  seq = valid.shape[1]
  if cache is None:
    start = jnp.zeros((), jnp.int32)
    key_valid = valid
  else:
    start = cache.length
    key_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid,
                                                    start, axis=1)
  key_positions = jnp.cumsum(key_valid, axis=1, dtype=jnp.int32) - 1
  positions = jnp.maximum(jax.lax.dynamic_slice_in_dim(
      key_positions, start, seq, axis=1), 0)
  return Slots(positions, key_valid, key_positions, start + jnp.arange(seq),
               start)


def rotary(x: jax.Array, positions: jax.Array,
           base: float = 10000.0) -> jax.Array:
  """Rotary embedding of x (batch, seq, heads, dim) at integer positions (batch, seq)."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None].astype(jnp.float32) * freq  # (b, s, half)
  sin, cos = jnp.sin(angle)[:, :, None], jnp.cos(angle)[:, :, None]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         -1).astype(x.dtype)


def write_cache(layer_cache, k: jax.Array, v: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
  """The layer's keys and values over all cache slots, this call's written
  at the cache's `start` (no cache: this call's alone)."""
  if layer_cache is None:
    return k, v
  cache_k, cache_v, start = layer_cache
  k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype),
                                          start, axis=1)
  v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype),
                                          start, axis=1)
  return k, v


def causal_mask(num_slots: int, key_valid: jax.Array,
                query_slots: jax.Array) -> jax.Array:
  """(batch, seq, slots) bool: the valid keys at slots up to the query's."""
  key_slots = jnp.arange(num_slots)
  return ((key_slots[None, :] <= query_slots[:, None])[None]
          & key_valid[:, None, :])


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array,
           divisor: jax.Array | None = None) -> jax.Array:
  """Softmax attention (float32 logits, masked keys at _NEG) of q (b, s, h,
  d) over k, v (b, T, kv_heads, d): each group of h // kv_heads query heads
  reads one key/value head. Logits are divided by `divisor` (None: q comes
  scaled)."""
  b, s, h, hd = q.shape
  kv_heads = k.shape[2]
  group = h // kv_heads
  if group == 1:
    logits = jnp.einsum('bshk,bthk->bhst', q, k)
  else:  # Query heads (g, r): group g reads key/value head g.
    logits = jnp.einsum('bsgrk,btgk->bgrst',
                        q.reshape(b, s, kv_heads, group, hd), k
                        ).reshape(b, h, s, -1)
  if divisor is not None:
    logits = logits / divisor
  logits = jnp.where(allowed[:, None], logits.astype(jnp.float32), _NEG)
  weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  if group == 1:
    return jnp.einsum('bhst,bthk->bshk', weights, v)
  return jnp.einsum('bgrst,btgk->bsgrk',
                    weights.reshape(b, kv_heads, group, s, -1),
                    v).reshape(b, s, h, hd)


class Attention(nn.Module):
  """Grouped-query attention with rotary positions at `rope_base`
  (positions divided by `rope_scale`), over every earlier valid key or,
  with `window`, the keys less than `window` positions back."""
  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None  # None: one per query head.
  recipe: Recipe = DECODER
  rope_base: float = 10000.0
  rope_scale: float = 1.0
  window: int | None = None

  @nn.compact
  def __call__(self, x, at: Slots, layer_cache):
    # Parameters are float32; they compute in x's dtype.
    dense = lambda name, axes, shape: self.param(
        name, _param(nn.initializers.lecun_normal(), axes),
        shape).astype(x.dtype)
    d = x.shape[-1]
    h, hd = self.num_heads, self.head_dim
    kv_heads = self.num_kv_heads or h
    # Shared key/value heads get their own logical axis: they may not
    # split over as many devices as the query heads.
    kv_axis = 'heads' if kv_heads == h else 'kv_heads'
    q = jnp.einsum('bsd,dhk->bshk', x,
                   dense('query', ('embed', 'heads', None), (d, h, hd)))
    k = jnp.einsum('bsd,dhk->bshk', x,
                   dense('key', ('embed', kv_axis, None), (d, kv_heads, hd)))
    v = jnp.einsum('bsd,dhk->bshk', x,
                   dense('value', ('embed', kv_axis, None),
                         (d, kv_heads, hd)))
    r = self.recipe
    if r.qk_norm:
      q = RMSNorm(r.eps, None, r.norm_plus_one, name='query_norm')(q)
      k = RMSNorm(r.eps, None, r.norm_plus_one, name='key_norm')(k)
    rope_positions = at.positions.astype(jnp.float32) / self.rope_scale
    q = rotary(q, rope_positions, self.rope_base)
    k = rotary(k, rope_positions, self.rope_base)
    if r.prescaled_queries:
      q = q * jnp.asarray(hd ** -0.5, q.dtype)
      divisor = None
    else:
      divisor = jnp.sqrt(jnp.float32(hd)).astype(q.dtype)
    q = constrain(q, ('batch', None, 'heads', None))
    k, v = write_cache(layer_cache, k, v)
    allowed = causal_mask(k.shape[1], at.key_valid, at.query_slots)
    if self.window is not None:
      allowed &= (at.positions[:, :, None] - at.key_positions[:, None, :]
                  < self.window)
    out = attend(q, k, v, allowed, divisor)
    o = dense('out', ('heads', None, 'embed'), (h, hd, d))
    return jnp.einsum('bshk,hkd->bsd', out, o), (k, v)


class MLP(nn.Module):
  """The gated MLP: down(act(x gate) * (x up))."""
  hidden: int
  activation: str = 'silu'

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    init = nn.initializers.lecun_normal()
    param = lambda name, axes, shape: self.param(
        name, _param(init, axes), shape).astype(x.dtype)
    gate = param('gate', ('embed', 'mlp'), (d, self.hidden))
    up = param('up', ('embed', 'mlp'), (d, self.hidden))
    down = param('down', ('mlp', 'embed'), (self.hidden, d))
    hidden = ACTIVATIONS[self.activation](x @ gate) * (x @ up)
    return constrain(hidden, ('batch', None, 'mlp')) @ down


class Block(nn.Module):
  """x + attn(norm(x)), then + mlp(norm(.)) (with `sandwich_norms` each
  output normed too); returns (residual stream, new k/v)."""
  num_heads: int
  head_dim: int
  mlp_dim: int
  num_kv_heads: int | None = None
  recipe: Recipe = DECODER
  rope_base: float = 10000.0
  rope_scale: float = 1.0
  window: int | None = None

  @nn.compact
  def __call__(self, x, at: Slots, layer_cache=None):
    r = self.recipe
    norm = lambda name: RMSNorm(r.eps, plus_one=r.norm_plus_one, name=name)
    post = lambda name, y: norm(name)(y) if r.sandwich_norms else y
    attn, kv = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                         r, self.rope_base, self.rope_scale, self.window,
                         name='attention')(
        norm('attention_norm')(x), at, layer_cache)
    x = x + post('post_attention_norm', attn)
    x = x + post('post_mlp_norm', MLP(self.mlp_dim, r.activation,
                                      name='mlp')(norm('mlp_norm')(x)))
    return x, kv


def run_blocks(blocks, x: jax.Array, valid: jax.Array | None,
               cache: 'Cache | None') -> tuple[jax.Array, 'Cache | None']:
  """The residual stream after `blocks` (each a `Block`) from x (batch,
  seq, d) of the tokens `valid` marks (None: all), and the cache extended
  by this call's slots (None without a cache)."""
  if valid is None:
    valid = jnp.ones(x.shape[:2], bool)
  at = slots(valid, cache)
  new_keys, new_values = [], []
  for i, block in enumerate(blocks):
    layer_cache = (None if cache is None
                   else (cache.keys[i], cache.values[i], at.start))
    x, (k, v) = block(constrain(x, ('batch', None, None)), at, layer_cache)
    new_keys.append(k)
    new_values.append(v)
  if cache is None:
    return x, None
  return x, Cache(tuple(new_keys), tuple(new_values), at.key_valid,
                  at.start + valid.shape[1])


class DecoderLM(nn.Module):
  """Byte-level (or any vocabulary) decoder-only LM.

  Attributes:
    vocab_size, d_model, num_layers, num_heads, mlp_dim: the shape.
    max_len: the longest sequence (cache slots) it is used with.
    num_kv_heads: key/value heads (grouped-query attention); None: one
      per query head.
    dtype: what activations and matmuls compute in ('float32' or
      'bfloat16'); parameters stay float32, logits are float32.
    remat: recompute each block's activations in the backward pass.
  """
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  mlp_dim: int = 384
  max_len: int = 256
  num_kv_heads: int | None = None
  dtype: str = 'float32'
  remat: bool = False

  def setup(self):
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model={self.d_model} is not divisible by '
                       f'num_heads={self.num_heads}')
    if self.num_heads % (self.num_kv_heads or self.num_heads):
      raise ValueError(f'num_heads={self.num_heads} is not divisible by '
                       f'num_kv_heads={self.num_kv_heads}')
    self.embed = self.param(
        'embedding', _param(nn.initializers.normal(1.0), ('vocab', 'embed')),
        (self.vocab_size, self.d_model))
    # Rematerialised blocks keep only their input for the backward pass:
    # one block's activations live at a time instead of every block's.
    block = nn.remat(Block) if self.remat else Block
    self.blocks = [block(self.num_heads, self.d_model // self.num_heads,
                         self.mlp_dim, self.num_kv_heads, name=f'block_{i}')
                   for i in range(self.num_layers)]
    self.final_norm = RMSNorm()
    self.head = self.param(
        'head', _param(nn.initializers.lecun_normal(), ('embed', 'vocab')),
        (self.d_model, self.vocab_size))

  def __call__(self, tokens: jax.Array, valid: jax.Array | None = None,
               cache: Cache | None = None, last_only: bool = False
               ) -> tuple[jax.Array, Cache | None]:
    """Logits (batch, seq, vocab) float32, and the updated cache (or None).

    Args:
      tokens: (batch, seq) int token ids.
      valid: (batch, seq) bool, real tokens (default: all).
      cache: None for a full sequence; else the cache to extend by `seq`
        slots (prefill or one decoding step).
      last_only: logits of the last position only, (batch, 1, vocab): a
        prompt's prefill before decoding needs no others.
    """
    dtype = jnp.dtype(self.dtype)
    x = jnp.take(self.embed, tokens, axis=0).astype(dtype)
    x, cache = run_blocks(self.blocks, x, valid, cache)
    x = x[:, -1:] if last_only else x
    logits = constrain((self.final_norm(x) @ self.head.astype(dtype)
                         ).astype(jnp.float32), ('batch', None, 'vocab'))
    return logits, cache

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def init_cache(model: Any, batch: int, max_len: int | None = None,
               dtype: Any = None) -> Cache:
  """An empty cache of `max_len` slots (default `model.max_len`), in
  `dtype` (default: the model's compute dtype)."""
  max_len = model.max_len if max_len is None else max_len
  zeros = jnp.zeros((batch, max_len, model.num_kv_heads or model.num_heads,
                     model.head_dim), model.dtype if dtype is None else dtype)
  return Cache(keys=(zeros,) * model.num_layers,
               values=(zeros,) * model.num_layers,
               valid=jnp.zeros((batch, max_len), bool),
               length=jnp.zeros((), jnp.int32))
