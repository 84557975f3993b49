"""Gemma 3 (text) in Flax linen, with the in-project decoder's interface.

Google's Gemma 3 decoder (Gemma Team, 2025), as DeepMind's JAX `gemma`
library (`gemma.gm.nn._modules`, 3.3.0) and llama.cpp
(`src/models/gemma3.cpp`) define it:

- grouped-query attention (`num_kv_heads` key/value heads shared by
  `num_heads` query heads) with RMS-normalised queries and keys (qk-norm)
  before the rotary embedding, and queries scaled by 1/sqrt(head_dim);
- layers alternate local (sliding-window) and global attention: layer i is
  global when (i + 1) % `global_every` == 0 (5 local : 1 global), local
  layers attend to the `sliding_window` previous positions (a query at
  position p sees keys at p - window < q <= p) with rotary base
  `local_base`, global layers to all of them with `global_base` and
  positions divided by `global_scale` (linear RoPE scaling; 1 below 4B);
- GeGLU feed-forward (gelu, tanh approximation, times the up projection);
- RMSNorm before and after both the attention and the feed-forward (the
  "sandwich"), each scaling by (1 + w), so zero weights are the identity;
- input embeddings scaled by sqrt(d_model) (in the compute dtype), the
  output head tied to them, no logit soft-capping.

The call is `train.lm.decoder.DecoderLM`'s: `(tokens, valid, cache) ->
(logits, cache)`, with left padding, absolute cache slots and positions
counting valid tokens, so `train.lm.generate`, `train.lm.hooks` (blocks
are `block_<i>`, whose output is the residual stream) and the trainer run
on it unchanged. Parameters carry the decoder's logical axes ('vocab',
'embed', 'heads', 'kv_heads', 'mlp') for `train.sharding`.

`SHAPES` holds the published text-model shapes (270m, 1b, 4b, from the
`gemma` library's `Gemma3_270M/1B/4B`); `train.lm.gguf_gemma` loads the
270M's weights from the registry's GGUF file.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from train.lm import decoder

DTYPES = decoder.DTYPES


@dataclasses.dataclass(frozen=True)
class Shape:
  """A Gemma 3 text model's hyperparameters (see the module docstring)."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  sliding_window: int
  local_base: float = 10_000.0
  global_base: float = 1_000_000.0
  global_scale: float = 1.0
  global_every: int = 6
  rms_eps: float = 1e-6


SHAPES = {
    '270m': Shape(vocab_size=262_144, d_model=640, num_layers=18,
                  num_heads=4, num_kv_heads=1, head_dim=256, mlp_dim=2048,
                  sliding_window=512),
    '1b': Shape(vocab_size=262_144, d_model=1152, num_layers=26,
                num_heads=4, num_kv_heads=1, head_dim=256, mlp_dim=6 * 1152,
                sliding_window=512),
    '4b': Shape(vocab_size=262_208, d_model=2560, num_layers=34,
                num_heads=8, num_kv_heads=4, head_dim=256,
                mlp_dim=2560 * 8 // 2, sliding_window=1024,
                global_scale=8.0),
}


# The longest context any Gemma 3 text model was trained for (4B: 128k).
MAX_CONTEXT = 131_072


def same_dims(a: Shape, b: Shape) -> bool:
  """Whether two shapes have the same parameters (sizes and heads)."""
  dims = lambda s: (s.vocab_size, s.d_model, s.num_layers, s.num_heads,
                    s.num_kv_heads, s.head_dim, s.mlp_dim)
  return dims(a) == dims(b)


def _param(init, axes):
  return nn.with_logical_partitioning(init, axes)


class RMSNorm(nn.Module):
  """RMS normalisation scaling by (1 + scale); scale starts at zero."""
  eps: float = 1e-6
  axis_name: str | None = 'embed'

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', _param(nn.initializers.zeros,
                                       (self.axis_name,)), (x.shape[-1],))
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
    return (y * (1.0 + scale)).astype(x.dtype)


class Attention(nn.Module):
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_base: float
  rope_scale: float
  window: int | None  # None: global attention.
  eps: float

  @nn.compact
  def __call__(self, x, positions, key_valid, key_positions, query_slots,
               layer_cache):
    dense = lambda name, axes, shape: self.param(
        name, _param(nn.initializers.lecun_normal(), axes),
        shape).astype(x.dtype)
    d = x.shape[-1]
    h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
    kv_axis = 'heads' if kvh == h else 'kv_heads'
    q = jnp.einsum('bsd,dhk->bshk', x,
                   dense('query', ('embed', 'heads', None), (d, h, hd)))
    k = jnp.einsum('bsd,dhk->bshk', x,
                   dense('key', ('embed', kv_axis, None), (d, kvh, hd)))
    v = jnp.einsum('bsd,dhk->bshk', x,
                   dense('value', ('embed', kv_axis, None), (d, kvh, hd)))
    q = RMSNorm(self.eps, None, name='query_norm')(q)
    k = RMSNorm(self.eps, None, name='key_norm')(k)
    rope_positions = positions.astype(jnp.float32) / self.rope_scale
    q = decoder.rotary(q, rope_positions, self.rope_base)
    k = decoder.rotary(k, rope_positions, self.rope_base)
    q = q * jnp.asarray(hd ** -0.5, q.dtype)
    q = decoder.constrain(q, ('batch', None, 'heads', None))
    k, v = decoder.write_cache(layer_cache, k, v)
    allowed = decoder.causal_mask(k.shape[1], key_valid, query_slots)
    if self.window is not None:
      allowed &= (positions[:, :, None] - key_positions[:, None, :]
                  < self.window)
    out = decoder.attend(q, k, v, allowed)
    o = dense('out', ('heads', None, 'embed'), (h, hd, d))
    return jnp.einsum('bshk,hkd->bsd', out, o), (k, v)


class MLP(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    param = lambda name, axes, shape: self.param(
        name, _param(nn.initializers.lecun_normal(), axes),
        shape).astype(x.dtype)
    gate = param('gate', ('embed', 'mlp'), (d, self.hidden))
    up = param('up', ('embed', 'mlp'), (d, self.hidden))
    down = param('down', ('mlp', 'embed'), (self.hidden, d))
    hidden = jax.nn.gelu(x @ gate, approximate=True) * (x @ up)
    return decoder.constrain(hidden, ('batch', None, 'mlp')) @ down


class Block(nn.Module):
  """Sandwich-normed attention then GeGLU; returns (residual stream, k/v)."""
  shape: Shape
  is_global: bool

  @nn.compact
  def __call__(self, x, positions, key_valid, key_positions, query_slots,
               layer_cache=None):
    sh = self.shape
    norm = lambda name: RMSNorm(sh.rms_eps, name=name)
    attn, kv = Attention(
        sh.num_heads, sh.num_kv_heads, sh.head_dim,
        rope_base=sh.global_base if self.is_global else sh.local_base,
        rope_scale=sh.global_scale if self.is_global else 1.0,
        window=None if self.is_global else sh.sliding_window,
        eps=sh.rms_eps, name='attention')(
            norm('attention_norm')(x), positions, key_valid, key_positions,
            query_slots, layer_cache)
    x = x + norm('post_attention_norm')(attn)
    x = x + norm('post_mlp_norm')(MLP(sh.mlp_dim, name='mlp')(
        norm('mlp_norm')(x)))
    return x, kv


class Gemma3(nn.Module):
  """Gemma 3's text decoder.

  Attributes:
    shape: the hyperparameters (`SHAPES[...]`).
    max_len: the longest sequence (cache slots) it is used with.
    dtype: what activations and matmuls compute in ('float32' or
      'bfloat16'); parameters keep theirs, logits are float32.
    remat: recompute each block's activations in the backward pass.
  """
  shape: Shape = SHAPES['270m']
  max_len: int = 1024
  dtype: str = 'float32'
  remat: bool = False

  # The attributes `train.lm.decoder.init_cache` and the generators read.
  @property
  def num_layers(self) -> int:
    return self.shape.num_layers

  @property
  def num_kv_heads(self) -> int:
    return self.shape.num_kv_heads

  @property
  def num_heads(self) -> int:
    return self.shape.num_heads

  @property
  def head_dim(self) -> int:
    return self.shape.head_dim

  @property
  def d_model(self) -> int:
    return self.shape.d_model

  @property
  def vocab_size(self) -> int:
    return self.shape.vocab_size

  def is_global(self, layer: int) -> bool:
    return (layer + 1) % self.shape.global_every == 0

  def setup(self):
    sh = self.shape
    if sh.num_kv_heads < 1 or sh.num_heads % sh.num_kv_heads:
      raise ValueError(f'num_heads={sh.num_heads} is not divisible by '
                       f'num_kv_heads={sh.num_kv_heads}')
    self.embed = self.param(
        'embedding', _param(nn.initializers.normal(1.0), ('vocab', 'embed')),
        (sh.vocab_size, sh.d_model))
    block = nn.remat(Block) if self.remat else Block
    self.blocks = [block(sh, self.is_global(i), name=f'block_{i}')
                   for i in range(sh.num_layers)]
    self.final_norm = RMSNorm(sh.rms_eps)

  def __call__(self, tokens: jax.Array, valid: jax.Array | None = None,
               cache: decoder.Cache | None = None
               ) -> tuple[jax.Array, decoder.Cache | None]:
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
    else:
      start = cache.length
      key_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid,
                                                      start, axis=1)
    # A slot's position counts the valid slots before it, for queries and
    # keys alike, so left padding shifts nothing.
    key_positions = jnp.cumsum(key_valid, axis=1, dtype=jnp.int32) - 1
    positions = jnp.maximum(jax.lax.dynamic_slice_in_dim(
        key_positions, start, seq, axis=1), 0)
    query_slots = start + jnp.arange(seq)
    dtype = jnp.dtype(self.dtype)
    x = jnp.take(self.embed, tokens, axis=0).astype(dtype)
    x = x * jnp.sqrt(jnp.float32(self.shape.d_model)).astype(dtype)
    new_keys, new_values = [], []
    for i, block in enumerate(self.blocks):
      layer_cache = (None if cache is None
                     else (cache.keys[i], cache.values[i], start))
      x, (k, v) = block(decoder.constrain(x, ('batch', None, None)),
                        positions, key_valid, key_positions, query_slots,
                        layer_cache)
      new_keys.append(k)
      new_values.append(v)
    logits = jnp.einsum('bsd,vd->bsv', self.final_norm(x),
                        self.embed.astype(dtype)).astype(jnp.float32)
    logits = decoder.constrain(logits, ('batch', None, 'vocab'))
    if cache is None:
      return logits, None
    return logits, decoder.Cache(tuple(new_keys), tuple(new_values),
                                 key_valid, start + seq)


def param_count(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
