"""Steered generations after neutral prompts, and what is measured of them.

For any `train.lm.interface.LanguageModel`: KV-cached (or recomputed)
generation with one fixed sampling key for every method
(`train.lm.generate`), then

- the sentiment of the texts, by a `JUDGES` judge: 'lexicon', the share
  of sentiment words that are positive (the lexicons are the template
  grammar's words that occur only on one side: what the in-project LMs
  write), or 'vader', the share VADER (vaderSentiment 3.3.2) rates
  positive (compound >= 0.05, VADER's own threshold) and its mean compound
  score (`vader_compound`: free English, what a pretrained LM writes;
  ActAdd's love/hate setting);
- distinct-1/2 and the 3-gram repetition rate;
- `gen_ce`: the cross-entropy of the generated tokens under the unsteered
  model (nats per token: how far the text strays from what the model
  itself writes).

A text ends at the tokenizer's EOS where it has one (sampling past EOS is
not the model's text); the in-project tokenizers have none.

Prompts: `template_prompts` (the template grammar's neutral premises, for
the in-project LMs) or `open_prompts` (`PROMPTS`: neutral openings of
English sentences, for a pretrained LM).
"""

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.lm import corpus as text_corpus
from train.lm import generate as lm_generate
from train.lm import interface
from train.lm import tokenizer as lm_tokenizer

JUDGES = ('lexicon', 'vader')

# Neutral openings for open-ended continuations (ours; ActAdd's own
# "I hate you because" among them). None states a sentiment.
PROMPTS = (
    'I hate you because', 'I went up to my friend and said',
    'Yesterday I went to the market and', 'The weather this morning was',
    'My neighbour told me that the new restaurant', 'When I opened the door,',
    'The meeting on Monday', 'I think the movie', 'Last week my brother',
    'The train was late, so', 'Our teacher said that the exam',
    'After dinner we talked about', 'The book I am reading',
    'When the package arrived,', 'My first day at the new job',
    'The city council decided to', 'On the way home I saw',
    'The coffee at the station', 'She looked at the painting and',
    'The software update', 'At the end of the concert,',
    'The hotel room was', 'My grandmother always says that',
    'The new phone', 'We spent the weekend at the lake and',
    'The interview went', 'He read the letter twice and',
    'The team finished the season', 'I tried the recipe and',
    'The flight to Chicago', 'When I think about school,',
    'The customer service agent')


def _lexicon(sentences, others) -> frozenset[str]:
  words = lambda pool: {w for s in pool for w in re.findall(r'[a-z]+', s)}
  return frozenset(words(sentences) - words(others))


POSITIVE_WORDS = _lexicon(text_corpus.POSITIVE_SENTENCES,
                          text_corpus.NEGATIVE_SENTENCES
                          | set(text_corpus.NEUTRAL_SENTENCES))
NEGATIVE_WORDS = _lexicon(text_corpus.NEGATIVE_SENTENCES,
                          text_corpus.POSITIVE_SENTENCES
                          | set(text_corpus.NEUTRAL_SENTENCES))


def positive_share(texts: list[str]) -> float:
  """Positive / (positive + negative) sentiment words in `texts` (nan if none)."""
  pos = neg = 0
  for t in texts:
    for w in re.findall(r'[a-z]+', t.lower()):
      pos += w in POSITIVE_WORDS
      neg += w in NEGATIVE_WORDS
  return pos / (pos + neg) if pos + neg else float('nan')


def vader_scores(texts: list[str]) -> np.ndarray:
  """VADER's compound score (-1..1) of each text."""
  from vaderSentiment import vaderSentiment  # pylint: disable=g-import-not-at-top
  analyzer = vaderSentiment.SentimentIntensityAnalyzer()
  return np.array([analyzer.polarity_scores(t)['compound'] for t in texts])


def _left_pad(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  length = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), length), np.int32)
  valid = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    tokens[i, length - len(s):] = s
    valid[i, length - len(s):] = True
  return tokens, valid


def template_prompts(n: int, tokenizer: lm_tokenizer.Tokenizer | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded BOS + neutral premise + ' ' prompts. With subwords the
  trailing space is left out: it starts the next word's token, which the
  model is to choose, rather than standing alone as a token it rarely saw."""
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  separator = text_corpus.MCItem.SEPARATOR if tokenizer.kind == 'byte' else ''
  premises = [text_corpus.PREMISES[i % len(text_corpus.PREMISES)]
              for i in range(n)]
  return _left_pad([lm_tokenizer.encode_document(tokenizer, p + separator)
                    for p in premises])


def open_prompts(n: int, tokenizer: lm_tokenizer.Tokenizer
                 ) -> tuple[np.ndarray, np.ndarray]:
  """BOS + the first `n` of `PROMPTS`, left-padded."""
  return _left_pad([lm_tokenizer.encode_document(tokenizer, p)
                    for p in PROMPTS[:n]])


def until_eos(rows: np.ndarray, eos: int) -> np.ndarray:
  """(rows, steps) bool: the generated tokens up to and including the first
  EOS (what the text is; sampling past EOS is not the model's text)."""
  rows = np.asarray(rows)
  after = np.cumsum(rows == eos, axis=1) - (rows == eos)
  return after == 0


@functools.partial(jax.jit, static_argnames=('model', 'layer_path',
                                             'num_steps', 'mode', 'temperature'))
def _generate(model, params, prompt, valid, steering, rng, layer_path,
              num_steps, mode, temperature):
  return lm_generate.generate(model, params, prompt, valid, num_steps,
                              steering=steering, layer_path=layer_path,
                              mode=mode, temperature=temperature, rng=rng)


@functools.partial(jax.jit, static_argnames=('model',))
def _generated_nll(model, params, prompt, valid, generated, keep):
  tokens = jnp.concatenate([prompt, generated], axis=1)
  mask = jnp.concatenate([valid, keep], axis=1)
  logits, _, _ = interface.apply(model, params, tokens, mask)
  # The logits at the last prompt position onward predict the generation.
  logits = logits[:, prompt.shape[1] - 1:-1]
  picked = jnp.take_along_axis(logits, generated[..., None], -1)[..., 0]
  nll = jax.nn.logsumexp(logits, -1) - picked
  return jnp.sum(nll * keep), jnp.sum(keep)


def generation_metrics(model, params, prompts, steering, layer_path: str,
                       num_steps: int, temperature: float, seed: int,
                       mode: str = 'cached',
                       tokenizer: lm_tokenizer.Tokenizer | None = None,
                       judge: str = 'lexicon') -> dict[str, Any]:
  """Measures of the texts generated after `prompts` (tokens, valid)."""
  if judge not in JUDGES:
    raise ValueError(f'judge={judge!r}: unknown; valid choices: '
                     f'{", ".join(JUDGES)}')
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  tokens, valid = prompts
  generated = np.asarray(_generate(
      model, params, tokens, valid, steering, jax.random.key(seed),
      layer_path, num_steps, mode, temperature).tokens)
  eos = getattr(tokenizer, 'eos_id', -1)
  keep = (until_eos(generated, eos) if eos >= 0
          else np.ones(generated.shape, bool))
  texts = [tokenizer.decode(row[k]) for row, k in zip(generated, keep)]
  nll, count = _generated_nll(model, params, tokens, valid, generated, keep)
  if judge == 'vader':
    compound = vader_scores(texts)
    out = {'positive_share': float(np.mean(compound >= 0.05)),
           'vader_compound': float(np.mean(compound))}
  else:
    out = {'positive_share': positive_share(texts)}
  out.update({'distinct_1': text_corpus.distinct_n(texts, 1),
              'distinct_2': text_corpus.distinct_n(texts, 2),
              'repetition_3': text_corpus.repetition_rate(texts, 3),
              'gen_ce': float(nll / count),
              'samples': texts[:3]})
  return out
