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

The layers are the in-project decoder's (`train.lm.decoder.Block`,
attention, cache and masks), with the differences above stated once in
`RECIPE` and per layer in `block`; the embedding scale and the tied head
are in `Gemma3.__call__`. Both models satisfy `train.lm.interface`'s
`LanguageModel`: `(tokens, valid, cache) -> (logits, cache)`, with left
padding, absolute cache slots and positions counting valid tokens, so
`train.lm.generate`, `train.lm.hooks` (blocks are `block_<i>`, whose
output is the residual stream), the steering evaluation and the trainer
run on either. Parameters carry the decoder's logical axes ('vocab',
'embed', 'heads', 'kv_heads', 'mlp') for `train.training.sharding`.

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


# Gemma 3's blocks against the in-project decoder's (`decoder.Recipe`).
RECIPE = decoder.Recipe(activation='gelu_tanh', norm_plus_one=True,
                        sandwich_norms=True, qk_norm=True,
                        prescaled_queries=True)


def block(shape: Shape, is_global: bool, module=decoder.Block,
          name: str | None = None) -> decoder.Block:
  """Block of a layer: global ones attend to every position with
  `global_base` and positions divided by `global_scale`, local ones to the
  `sliding_window` previous positions with `local_base`."""
  return module(shape.num_heads, shape.head_dim, shape.mlp_dim,
                shape.num_kv_heads,
                dataclasses.replace(RECIPE, eps=shape.rms_eps),
                rope_base=shape.global_base if is_global else shape.local_base,
                rope_scale=shape.global_scale if is_global else 1.0,
                window=None if is_global else shape.sliding_window,
                name=name)


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

  # The shape attributes of `train.lm.interface.LanguageModel`.
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
        'embedding', nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                                  ('vocab', 'embed')),
        (sh.vocab_size, sh.d_model))
    module = nn.remat(decoder.Block) if self.remat else decoder.Block
    self.blocks = [block(sh, self.is_global(i), module, name=f'block_{i}')
                   for i in range(sh.num_layers)]
    self.final_norm = decoder.RMSNorm(sh.rms_eps, plus_one=True)

  def __call__(self, tokens: jax.Array, valid: jax.Array | None = None,
               cache: decoder.Cache | None = None, last_only: bool = False
               ) -> tuple[jax.Array, decoder.Cache | None]:
    """Logits (batch, seq, vocab) float32, and the updated cache (or
    None): the call of `decoder.DecoderLM.__call__`."""
    dtype = jnp.dtype(self.dtype)
    x = jnp.take(self.embed, tokens, axis=0).astype(dtype)
    x = x * jnp.sqrt(jnp.float32(self.shape.d_model)).astype(dtype)
    x, cache = decoder.run_blocks(self.blocks, x, valid, cache)
    x = x[:, -1:] if last_only else x
    # The head is the embedding, tied.
    logits = jnp.einsum('bsd,vd->bsv', self.final_norm(x),
                        self.embed.astype(dtype)).astype(jnp.float32)
    return decoder.constrain(logits, ('batch', None, 'vocab')), cache


def param_count(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
