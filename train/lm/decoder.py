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

Parameters carry logical axes ('vocab', 'embed', 'heads', 'mlp') for
`train.sharding`; block i is the submodule `block_i`, whose output (the
residual stream after the block) is what `train.steering.hooks` steers.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

_NEG = -1e9  # Finite, so a fully masked (padding) query gives no NaN.


class Cache(NamedTuple):
  """Keys and values of every layer for `max_len` slots.

  Attributes:
    keys, values: per layer, (batch, max_len, heads, head_dim).
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


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', _param(nn.initializers.ones, ('embed',)),
                       (x.shape[-1],))
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
    return (y * scale).astype(x.dtype)


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


class Attention(nn.Module):
  num_heads: int
  head_dim: int

  @nn.compact
  def __call__(self, x, positions, key_valid, query_slots, layer_cache):
    dense = lambda name, axes, shape: self.param(
        name, _param(nn.initializers.lecun_normal(), axes), shape)
    d = x.shape[-1]
    q = jnp.einsum('bsd,dhk->bshk', x,
                   dense('query', ('embed', 'heads', None),
                         (d, self.num_heads, self.head_dim)))
    k = jnp.einsum('bsd,dhk->bshk', x,
                   dense('key', ('embed', 'heads', None),
                         (d, self.num_heads, self.head_dim)))
    v = jnp.einsum('bsd,dhk->bshk', x,
                   dense('value', ('embed', 'heads', None),
                         (d, self.num_heads, self.head_dim)))
    q, k = rotary(q, positions), rotary(k, positions)
    if layer_cache is not None:
      cache_k, cache_v, start = layer_cache
      k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype),
                                              start, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype),
                                              start, axis=1)
    key_slots = jnp.arange(k.shape[1])
    allowed = ((key_slots[None, :] <= query_slots[:, None])[None]
               & key_valid[:, None, :])  # (b, s, T)
    logits = jnp.einsum('bshk,bthk->bhst', q, k) / jnp.sqrt(
        jnp.float32(self.head_dim)).astype(q.dtype)
    logits = jnp.where(allowed[:, None], logits.astype(jnp.float32), _NEG)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum('bhst,bthk->bshk', weights, v)
    o = self.param('out', _param(nn.initializers.lecun_normal(),
                                 ('heads', None, 'embed')),
                   (self.num_heads, self.head_dim, d))
    return jnp.einsum('bshk,hkd->bsd', out, o), (k, v)


class MLP(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    init = nn.initializers.lecun_normal()
    gate = self.param('gate', _param(init, ('embed', 'mlp')), (d, self.hidden))
    up = self.param('up', _param(init, ('embed', 'mlp')), (d, self.hidden))
    down = self.param('down', _param(init, ('mlp', 'embed')),
                      (self.hidden, d))
    return (nn.silu(x @ gate) * (x @ up)) @ down


class Block(nn.Module):
  """x + attn(norm(x)), then + mlp(norm(.)); returns (residual stream, new k/v)."""
  num_heads: int
  head_dim: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, positions, key_valid, query_slots, layer_cache=None):
    attn, kv = Attention(self.num_heads, self.head_dim, name='attention')(
        RMSNorm(name='attention_norm')(x), positions, key_valid, query_slots,
        layer_cache)
    x = x + attn
    x = x + MLP(self.mlp_dim, name='mlp')(RMSNorm(name='mlp_norm')(x))
    return x, kv


class DecoderLM(nn.Module):
  """Byte-level (or any vocabulary) decoder-only LM.

  Attributes:
    vocab_size, d_model, num_layers, num_heads, mlp_dim: the shape.
    max_len: the longest sequence (cache slots) it is used with.
  """
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  mlp_dim: int = 384
  max_len: int = 256

  def setup(self):
    if self.d_model % self.num_heads:
      raise ValueError(f'd_model={self.d_model} is not divisible by '
                       f'num_heads={self.num_heads}')
    self.embed = self.param(
        'embedding', _param(nn.initializers.normal(1.0), ('vocab', 'embed')),
        (self.vocab_size, self.d_model))
    self.blocks = [Block(self.num_heads, self.d_model // self.num_heads,
                         self.mlp_dim, name=f'block_{i}')
                   for i in range(self.num_layers)]
    self.final_norm = RMSNorm()
    self.head = self.param(
        'head', _param(nn.initializers.lecun_normal(), ('embed', 'vocab')),
        (self.d_model, self.vocab_size))

  def __call__(self, tokens: jax.Array, valid: jax.Array | None = None,
               cache: Cache | None = None) -> tuple[jax.Array, Cache | None]:
    """Logits (batch, seq, vocab) float32, and the updated cache (or None).

    Args:
      tokens: (batch, seq) int token ids.
      valid: (batch, seq) bool, real tokens (default: all).
      cache: None for a full sequence; else the cache to extend by `seq`
        slots (prefill or one decoding step).
    """
    if valid is None:
      valid = jnp.ones(tokens.shape, bool)
    seq = tokens.shape[1]
    if cache is None:
      start = jnp.zeros((), jnp.int32)
      key_valid = valid
      prior = jnp.zeros((tokens.shape[0],), jnp.int32)
    else:
      start = cache.length
      key_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid,
                                                      start, axis=1)
      prior = jnp.sum(cache.valid, axis=1, dtype=jnp.int32)
    positions = prior[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    positions = jnp.maximum(positions, 0)
    query_slots = start + jnp.arange(seq)
    x = jnp.take(self.embed, tokens, axis=0)
    new_keys, new_values = [], []
    for i, block in enumerate(self.blocks):
      layer_cache = (None if cache is None
                     else (cache.keys[i], cache.values[i], start))
      x, (k, v) = block(x, positions, key_valid, query_slots, layer_cache)
      new_keys.append(k)
      new_values.append(v)
    logits = (self.final_norm(x) @ self.head).astype(jnp.float32)
    if cache is None:
      return logits, None
    return logits, Cache(tuple(new_keys), tuple(new_values), key_valid,
                         start + seq)


def init_cache(model: DecoderLM, batch: int, max_len: int | None = None,
               dtype: Any = jnp.float32) -> Cache:
  """An empty cache of `max_len` slots (default `model.max_len`)."""
  max_len = model.max_len if max_len is None else max_len
  head_dim = model.d_model // model.num_heads
  zeros = jnp.zeros((batch, max_len, model.num_heads, head_dim), dtype)
  return Cache(keys=(zeros,) * model.num_layers,
               values=(zeros,) * model.num_layers,
               valid=jnp.zeros((batch, max_len), bool),
               length=jnp.zeros((), jnp.int32))
