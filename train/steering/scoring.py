"""Steered scoring of multiple-choice items and held-out text, for any LM.

Both scorers take a `train.lm.interface.LanguageModel` (the in-project
decoder or Gemma 3) and run the unsteered part of their work once, then
one pass per steering operator:

- `MCScorer`: a choice's context except its last token is never steered,
  so it runs once, unsteered, into a KV cache; every operator then runs
  only the last context token and the choice on that cache, steered from
  the last context token through the choice (the reference's evaluation).
  A choice is scored by its summed and its mean (length-normalised)
  log-probability (tests/test_steering_evaluation.py checks this against
  one full-sequence pass per row, on both models);
- `HeldoutScorer`: windows of held-out text steered at every token:
  KL(unsteered || steered) per token, the steered cross-entropy, the norm
  ratio steered / unsteered at the steered block, the next one and the
  last, and the gate's trigger rate. Only each token's log-probability and
  KL leave the compiled function (Gemma has 262,144 logits per token).

Rows are processed in chunks of about `CHUNK_TOKENS` tokens, so that a
chunk's logits stay near 1 GB at Gemma's vocabulary. `MCScorer` orders
the items by their longest choice and cuts each chunk's tails to that
chunk's longest (rounded up to a power of two, so that few shapes are
compiled): padding had been most of the positions whose logits it
computed (3.6 times the scored positions on the Gemma selection's
validation items, 6.5 on the real-text task's).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from train.lm import corpus as text_corpus
from train.lm import interface
from train.lm import tokenizer as lm_tokenizer

CHUNK_TOKENS = 1024


def _sum_stats(stats: list[Any]) -> Any:
  return jax.tree.map(lambda *x: sum(x), *stats)


class MCBatch(NamedTuple):
  """All choices of a task as rows (item-major, choice-minor): the context
  but its last token (left-padded), then the last context token and the
  choice (right-padded)."""
  prefix: np.ndarray        # (rows, P)
  prefix_valid: np.ndarray  # (rows, P)
  tail: np.ndarray          # (rows, T): last context token, choice tokens
  tail_valid: np.ndarray    # (rows, T)
  score: np.ndarray         # (rows, T): tail positions whose NEXT token is
                            # a choice token
  labels: np.ndarray        # (items,) index of the positive choice

  @property
  def longest(self) -> int:
    """Tokens of the longest row (context and choice)."""
    return int((self.prefix_valid.sum(1) + self.tail_valid.sum(1)).max())


def encode_mc(items: list[text_corpus.MCItem],
              tokenizer: lm_tokenizer.Tokenizer | None = None) -> MCBatch:
  """Every choice after its item's context. The context is the tokens that
  lie wholly in `prefix()`; a token that straddles the boundary (a subword
  holding the separator's space) is scored with the choice
  (`lm_tokenizer.split`); for bytes that is exactly BOS + prefix bytes,
  then the choice's."""
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  parts = [lm_tokenizer.split(tokenizer, item.prefix(), choice)
           for item in items for choice in item.choices]
  p_len = max(len(c) - 1 for c, _ in parts)
  t_len = max(1 + len(a) for _, a in parts)
  rows = len(parts)
  prefix = np.zeros((rows, p_len), np.int32)
  prefix_valid = np.zeros((rows, p_len), bool)
  tail = np.zeros((rows, t_len), np.int32)
  tail_valid = np.zeros((rows, t_len), bool)
  score = np.zeros((rows, t_len), bool)
  for i, (ctx, ans) in enumerate(parts):
    if len(ctx) < 2 or not len(ans):
      raise ValueError(f'item row {i}: a context of {len(ctx)} tokens and a '
                       f'choice of {len(ans)}; both must be non-empty')
    head = ctx[:-1]
    prefix[i, p_len - len(head):] = head
    prefix_valid[i, p_len - len(head):] = True
    seq = np.concatenate([ctx[-1:], ans])
    tail[i, :len(seq)] = seq
    tail_valid[i, :len(seq)] = True
    score[i, :len(ans)] = True
  return MCBatch(prefix, prefix_valid, tail, tail_valid, score,
                 np.array([it.label for it in items], np.int32))


@functools.partial(jax.jit, static_argnames=('model', 'slots'))
def _prefill(model, params, tokens, valid, slots):
  return interface.prefill(model, params, tokens, valid, slots)[1]


@functools.partial(jax.jit, static_argnames=('model', 'layer_path'))
def _tail_logprobs(model, params, cache, tokens, valid, steering, layer_path):
  logits, _, rec = interface.apply(model, params, tokens, valid, cache,
                                   steering=steering, layer_path=layer_path,
                                   steer_mask=valid)
  return interface.next_token_logprobs(logits, tokens), rec.stats


def _bucket(length: int, cap: int) -> int:
  """The smallest power of two >= `length` (at least 8), at most `cap`."""
  return min(cap, max(8, 1 << (max(length, 1) - 1).bit_length()))


class MCScorer:
  """A task's contexts prefilled once; `accuracy(steering)` per operator."""

  def __init__(self, model, params, batch: MCBatch, layer_path: str):
    self.model, self.params, self.batch = model, params, batch
    self.layer_path = layer_path
    rows, p_len = batch.prefix.shape
    # Items by their longest tail, an item's two choices side by side; row
    # chunks of even size keep them together.
    lengths = batch.tail_valid.sum(1)
    self.order = (2 * np.argsort(lengths.reshape(-1, 2).max(1),
                                 kind='stable')[:, None]
                  + np.arange(2)).reshape(-1)
    step = max(2, (CHUNK_TOKENS // max(p_len, 1)) // 2 * 2)
    slots = p_len + batch.tail.shape[1]
    self.chunks = []
    for i in range(0, rows, step):
      rows_i = self.order[i:i + step]
      width = _bucket(int(lengths[rows_i].max()), batch.tail.shape[1])
      self.chunks.append((rows_i, width, _prefill(
          model, params, batch.prefix[rows_i], batch.prefix_valid[rows_i],
          slots)))

  def logprobs(self, steering) -> tuple[np.ndarray, np.ndarray, Any]:
    """Summed and mean log-probs of each choice (items, 2), and the
    steering statistics."""
    total = np.zeros(len(self.order), np.float32)
    stats = []
    b = self.batch
    for rows, width, cache in self.chunks:
      lp, st = _tail_logprobs(self.model, self.params, cache,
                              b.tail[rows, :width],
                              b.tail_valid[rows, :width], steering,
                              self.layer_path)
      total[rows] = (np.asarray(lp) * b.score[rows, :width]).sum(1)
      stats.append(jax.device_get(st))
    total = total.reshape(-1, 2)
    mean = total / b.score.sum(1).reshape(-1, 2)
    return total, mean, _sum_stats(stats)

  def accuracy(self, steering) -> dict[str, Any]:
    """Accuracy on summed and on mean log-prob, the trigger rate, and each
    item's correctness (0/1 lists `correct_sum`, `correct_mean`, in item
    order: what a bootstrap over items resamples)."""
    total, mean, stats = self.logprobs(steering)
    correct_sum = total.argmax(1) == self.batch.labels
    correct_mean = mean.argmax(1) == self.batch.labels
    return {'acc_sum': float(np.mean(correct_sum)),
            'acc_mean': float(np.mean(correct_mean)),
            'trigger_rate': float(stats.trigger_rate),
            'correct_sum': correct_sum.astype(int).tolist(),
            'correct_mean': correct_mean.astype(int).tolist()}


@functools.partial(jax.jit, static_argnames=('model', 'layer_path', 'watch'))
def window_logprobs(model, params, tokens, steering, layer_path, watch):
  """Log-probabilities (batch, seq, vocab) of windows steered at every
  token, the steering statistics and the watched layers' norms."""
  valid = jnp.ones(tokens.shape, bool)
  logits, _, rec = interface.apply(model, params, tokens, valid,
                                   steering=steering, layer_path=layer_path,
                                   steer_mask=valid, watch=watch)
  return jax.nn.log_softmax(logits), rec.stats, rec.norms


@functools.partial(jax.jit, static_argnames=('model', 'layer_path', 'watch'))
def _window_kl(model, params, tokens, targets, base_logp, steering,
               layer_path, watch):
  logp, stats, norms = window_logprobs(model, params, tokens, steering,
                                       layer_path, watch)
  kl = jnp.sum(jnp.exp(base_logp) * (base_logp - logp), -1)
  nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return kl, nll, stats, norms


class HeldoutScorer:
  """Windows (N, len + 1) of held-out text; the unsteered pass kept per
  chunk; `metrics(steering)` per operator.

  The norms are watched at the steered block, the next one and the last
  (`layer_paths`: every block's path, in order)."""

  def __init__(self, model, params, windows: np.ndarray, layer_path: str,
               layer_paths: list[str], unsteered):
    self.model, self.params, self.layer_path = model, params, layer_path
    k = layer_paths.index(layer_path)
    self.at_next_last = (layer_path, layer_paths[min(k + 1,
                                                     len(layer_paths) - 1)],
                         layer_paths[-1])
    self.watch = tuple(dict.fromkeys(self.at_next_last))
    tokens = np.asarray(windows[:, :-1], np.int32)
    targets = np.asarray(windows[:, 1:], np.int32)
    step = max(1, CHUNK_TOKENS // tokens.shape[1])
    self.chunks = [(tokens[i:i + step], targets[i:i + step])
                   for i in range(0, len(tokens), step)]
    self.base = [window_logprobs(model, params, c, unsteered, layer_path,
                                 self.watch)[::2] for c, _ in self.chunks]

  def metrics(self, steering, delta_hist: bool = False) -> dict[str, Any]:
    """KL, CE, the norm ratios and the trigger rate over the windows; with
    `delta_hist`, also the gate value's counts per bin
    (`SteerStats.delta_hist` over every window token: a list of
    `geom.steering.DELTA_BINS` ints)."""
    kls, nlls, stats, ratios = [], [], [], {p: [] for p in self.watch}
    for (c, y), (logp0, norms0) in zip(self.chunks, self.base):
      kl, nll, st, norms = _window_kl(self.model, self.params, c, y, logp0,
                                      steering, self.layer_path, self.watch)
      kls.append(np.asarray(kl).ravel())
      nlls.append(np.asarray(nll).ravel())
      stats.append(jax.device_get(st))
      for p in self.watch:
        ratios[p].append(np.asarray(norms[p] / jnp.maximum(norms0[p], 1e-12)
                                    ).ravel())
    st = _sum_stats(stats)
    ratio = {p: float(np.mean(np.concatenate(v))) for p, v in ratios.items()}
    at, nxt, last = self.at_next_last
    # A gate that leaves every token alone gives the unsteered logits; their
    # KL then rounds to +-1e-9, and the matched-KL reading needs KL >= 0.
    out = {'kl': max(float(np.mean(np.concatenate(kls))), 0.0),
           'ce': float(np.mean(np.concatenate(nlls))),
           'trigger_rate': float(st.triggered / st.tokens),
           'norm_ratio_at': ratio[at], 'norm_ratio_next': ratio[nxt],
           'norm_ratio_last': ratio[last]}
    if delta_hist:  # Counts below 2**24 are exact in float32.
      out['delta_hist'] = [int(round(float(v))) for v in st.delta_hist]
    return out
