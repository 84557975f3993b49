"""The interface every language model of the repository satisfies.

`train.lm.decoder.DecoderLM` (the in-project decoder) and
`train.lm.gemma.Gemma3` (Gemma 3, pretrained) are both a
`LanguageModel`: a Flax module called as `(tokens, valid, cache) ->
(logits, cache)`, whose blocks are the submodules `block_<i>` (the
residual stream after block i is their output, what `train.lm.hooks`
steers), with the shape attributes a cache is laid out from. On top of
that call this module gives what generation, the steering evaluation and
the held-out measures need, once for both:

- `apply`: a call with a steering operator at one layer (hooked apply),
  the norms or hidden states of watched layers recorded;
- `prefill` and `step`: KV-cached decoding (`decoder.init_cache`'s slots);
- `next_token_logprobs`: each position's log-probability of the next
  token, without a (batch, seq, vocab) log-softmax leaving the function;
- `Loaded`: a model with its parameters, its tokenizer (`tokenizer.kind`,
  `encode`, `decode`, `eos_id`, `fingerprint`) and its fingerprint.
"""

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from geom import steering as steering_lib
from train.lm import decoder
from train.lm import hooks as steering_hooks

Cache = decoder.Cache


class LanguageModel(Protocol):
  """What the code that runs an LM reads of it (both models have these)."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int | None
  head_dim: int
  max_len: int
  dtype: str

  def apply(self, variables: Any, tokens: jax.Array,
            valid: jax.Array | None = None, cache: Cache | None = None,
            last_only: bool = False) -> tuple[jax.Array, Cache | None]:
    ...


class Loaded(NamedTuple):
  """A model ready to run: parameters, tokenizer, and the fingerprint of
  what it was made from (its parameters', or its file's SHA-256)."""
  model: LanguageModel
  params: Any
  tokenizer: Any
  fingerprint: str


def apply(model: LanguageModel, params: Any, tokens: jax.Array,
          valid: jax.Array, cache: Cache | None = None, *,
          steering: steering_lib.Steering | None = None,
          layer_path: str | None = None,
          steer_mask: jax.Array | None = None,
          watch: tuple[str, ...] = (), capture: tuple[str, ...] = (),
          last_only: bool = False
          ) -> tuple[jax.Array, Cache | None, steering_hooks.Recorder]:
  """Logits, the cache, and what the hooks recorded, with the `steer_mask`
  tokens (None: all) steered at `layer_path` (see `train.lm.hooks`);
  `last_only`: the last position's logits alone, (batch, 1, vocab)."""
  with steering_hooks.steered(steering, layer_path, steer_mask, watch,
                              capture) as recorder:
    logits, cache = model.apply({'params': params}, tokens, valid, cache,
                                last_only=last_only)
  return logits, cache, recorder


def prefill(model: LanguageModel, params: Any, tokens: jax.Array,
            valid: jax.Array, slots: int, **hooks
            ) -> tuple[jax.Array, Cache, steering_hooks.Recorder]:
  """A cache of `slots` slots holding `tokens` (left-padded), their logits
  and the hooks' record (`hooks`: `apply`'s keyword arguments)."""
  cache = decoder.init_cache(model, tokens.shape[0], slots)
  return apply(model, params, tokens, valid, cache, **hooks)


def step(model: LanguageModel, params: Any, token: jax.Array, cache: Cache,
         **hooks) -> tuple[jax.Array, Cache, steering_hooks.Recorder]:
  """One decoding step: logits (batch, vocab) of `token` (batch,) after
  `cache`, the cache extended by it, and the hooks' record."""
  logits, cache, recorder = apply(
      model, params, token[:, None], jnp.ones((token.shape[0], 1), bool),
      cache, **hooks)
  return logits[:, 0], cache, recorder


def next_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log p(tokens[:, t + 1]) at each position t (the last one's is junk),
  (batch, seq) float32."""
  nxt = jnp.roll(tokens, -1, axis=1)
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, nxt[..., None], -1)[..., 0]
  return picked - jax.nn.logsumexp(logits, -1)
