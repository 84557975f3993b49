"""Offline byte-level text for training and steering a small decoder LM.

Steering needs a concept with known ground truth, so most of the data is a
template corpus of reviews whose every sentence agrees with a binary
sentiment label; multiple-choice tasks (built like COPA and StoryCloze) and
contrastive pairs for direction extraction come from the same grammar, and
one more task ('pydoc_polarity') from real sentences of Python's
documentation (`train.lm.polarity_sentences`), so that a steering result
does not rest on our templates alone. Real
English (Debian fortunes, Python's own docs, or the user's .txt files) keeps
the LM from being a pure template model. Everything is plain Python/numpy,
needs no network, and is a fixed function of the seed.

Splits are disjoint by construction: a document (or, for a multiple-choice
item, its full negative text, the one that could coincide with a corpus
document) belongs to the split picked by a stable hash of its text, and
generators only keep what hashes into the requested split. Identical texts
therefore always land in the same split. A 'pydoc_polarity' item belongs
to the split of its documentation sentence.
"""

from collections.abc import Callable, Iterator, Sequence
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import random
import re
from typing import ClassVar
import unicodedata

import numpy as np

from train.errors import UsageError
from train.lm import polarity_sentences

VOCAB_SIZE = 256
PAD = 0
BOS = 1
SPLITS = ('train', 'validation', 'test')
FORTUNES_DIR = '/usr/share/games/fortunes'
ENGLISH_SOURCES = ('fortunes', 'pydoc')

# --- Grammar. Positive and negative pools are index-paired antonyms, ordered
# so that partners have similar byte lengths: a skeleton drawn once renders
# as two texts that differ only in sentiment.
NOUNS = (
    'the soup', 'the waiter', 'the hotel room', 'the movie', 'the concert',
    'the pizza', 'the coffee', 'the staff', 'the service', 'the bed',
    'the view', 'the book', 'the show', 'the museum', 'the train ride',
    'the salad', 'the music', 'the dessert', 'the guide', 'the beach',
    'the pool', 'the bakery', 'the lecture', 'the game', 'the album',
    'the play', 'the barber', 'the garden', 'the market', 'the bread',
    'the tour', 'the food')
POSITIVE_ADJECTIVES = (
    'great', 'superb', 'lovely', 'divine', 'joyful', 'perfect', 'amazing',
    'stellar', 'pleasant', 'charming', 'fabulous', 'splendid', 'terrific',
    'gorgeous', 'fantastic', 'brilliant', 'wonderful', 'excellent',
    'delightful', 'marvellous', 'enjoyable', 'refreshing', 'impressive',
    'magnificent', 'outstanding')
NEGATIVE_ADJECTIVES = (
    'awful', 'lousy', 'dismal', 'grubby', 'dreary', 'boring', 'dreadful',
    'tedious', 'shameful', 'pathetic', 'terrible', 'horrible', 'mediocre',
    'appalling', 'miserable', 'atrocious', 'abysmal', 'unpleasant',
    'depressing', 'disgusting', 'tiresome', 'frustrating', 'disastrous',
    'unbearable', 'disappointing')
POSITIVE_PHRASES = (
    'made my day', 'was worth every penny', 'put a smile on my face',
    'was better than we had hoped', 'was a real treat',
    'felt warm and welcoming', 'left us very happy',
    'was the highlight of the trip', 'could not have been better',
    'won us over', 'was a joy', 'impressed all of us', 'got everything right',
    'was a pleasant surprise', 'deserves every award', 'felt like a gift',
    'lifted our spirits', 'was simply perfect', 'was done with real care',
    'was a pleasure from start to finish')
NEGATIVE_PHRASES = (
    'ruined my day', 'was a waste of money', 'made me want to leave',
    'was worse than we had feared', 'was a real letdown',
    'felt cold and unwelcoming', 'left us very upset',
    'was the low point of the trip', 'could not have been worse',
    'put us off', 'was a chore', 'annoyed all of us', 'got everything wrong',
    'was a nasty surprise', 'deserves every complaint',
    'felt like a punishment', 'dragged our spirits down',
    'was simply awful', 'was done without any care',
    'was a pain from start to finish')
POSITIVE_CLOSINGS = (
    'i would gladly go back.', 'i will be back soon.', 'highly recommended.',
    'five stars from me.', 'we will happily return.', 'worth the trip.',
    'i told my friends to go.', 'what a great time.',
    'i would recommend it to anyone.', 'i would go back.')
NEGATIVE_CLOSINGS = (
    'i would never go back.', 'i will not be back.', 'not recommended.',
    'one star from me.', 'we will never return.', 'not worth the trip.',
    'i told my friends to avoid it.', 'what a waste of time.',
    'i would not recommend it to anyone.', 'never again.')
OPENING_TEMPLATES = ('{noun} was {adj}.', 'i thought {noun} was {adj}.',
                     'honestly, {noun} was {adj}.',
                     'all in all, {noun} was {adj}.', 'we found {noun} {adj}.')
DETAIL_TEMPLATES = ('{noun} {phrase}.', 'on top of that, {noun} {phrase}.',
                    'even {noun} {phrase}.', 'and {noun} {phrase} as well.')
_PREMISE_PLACES = (
    ('had lunch', 'harbour cafe'), ('had dinner', 'corner bistro'),
    ('spent a night', 'old hotel'), ('saw a film', 'town cinema'),
    ('spent the afternoon', 'city museum'), ('stopped for coffee', 'station'),
    ('went to a concert', 'grand theatre'), ('had breakfast', 'river inn'),
    ('went shopping', 'night market'), ('took a tour', 'castle'))
PREMISES = tuple(f'i {act} at the {place}.' for act, place in _PREMISE_PLACES)
_NEUTRAL_SLOTS = (
    ('i went there on a {}.', ('monday', 'tuesday', 'wednesday', 'thursday',
                               'friday', 'saturday', 'sunday')),
    ('i was there with my {}.', ('sister', 'brother', 'mother', 'father',
                                 'friend', 'wife', 'husband', 'colleague')),
    ('it was my {} visit.', ('first', 'second', 'third', 'fourth')),
    ('we took the {} to get there.', ('bus', 'train', 'tram', 'ferry')),
    ('i had read about it in the {}.', ('paper', 'guidebook', 'magazine')))
NEUTRAL_SENTENCES = PREMISES + tuple(
    t.format(v) for t, values in _NEUTRAL_SLOTS for v in values)


def _expand(adjectives, phrases, closings) -> frozenset[str]:
  return frozenset(itertools.chain(
      (t.format(noun=n, adj=a) for t in OPENING_TEMPLATES for n in NOUNS
       for a in adjectives),
      (t.format(noun=n, phrase=p) for t in DETAIL_TEMPLATES for n in NOUNS
       for p in phrases), closings))


# Every sentence the grammar can emit, by polarity (for checks and probes).
POSITIVE_SENTENCES = _expand(POSITIVE_ADJECTIVES, POSITIVE_PHRASES,
                             POSITIVE_CLOSINGS)
NEGATIVE_SENTENCES = _expand(NEGATIVE_ADJECTIVES, NEGATIVE_PHRASES,
                             NEGATIVE_CLOSINGS)

# A skeleton sentence: ('neutral', text) or (kind, template, noun, k) where
# kind is 'opening' | 'detail' | 'closing' and k indexes the paired pools.
_Spec = tuple


def _render(spec: _Spec, label: int) -> str:
  kind = spec[0]
  if kind == 'neutral':
    return spec[1]
  _, template, noun, k = spec
  if kind == 'opening':
    pool = POSITIVE_ADJECTIVES if label else NEGATIVE_ADJECTIVES
    return template.format(noun=noun, adj=pool[k])
  if kind == 'detail':
    pool = POSITIVE_PHRASES if label else NEGATIVE_PHRASES
    return template.format(noun=noun, phrase=pool[k])
  return (POSITIVE_CLOSINGS if label else NEGATIVE_CLOSINGS)[k]


def _opening(rng: random.Random) -> _Spec:
  return ('opening', rng.choice(OPENING_TEMPLATES), rng.choice(NOUNS),
          rng.randrange(len(POSITIVE_ADJECTIVES)))


def _detail(rng: random.Random, templates=DETAIL_TEMPLATES, pairs=None
            ) -> _Spec:
  return ('detail', rng.choice(templates), rng.choice(NOUNS),
          rng.choice(pairs or range(len(POSITIVE_PHRASES))))


def _closing(rng: random.Random) -> _Spec:
  return ('closing', '', '', rng.randrange(len(POSITIVE_CLOSINGS)))


def _skeleton(rng: random.Random) -> list[_Spec]:
  """[premise]? opening, 1-2 details, [neutral]?, closing: 3 to 6 sentences."""
  body = [_opening(rng)] + [_detail(rng) for _ in range(rng.randint(1, 2))]
  if rng.random() < 0.3:
    body.insert(rng.randint(1, len(body)),
                ('neutral', rng.choice(NEUTRAL_SENTENCES)))
  if rng.random() < 0.5:
    body.insert(0, ('neutral', rng.choice(PREMISES)))
  return body + [_closing(rng)]


def _join(sentences: Sequence[str]) -> str:
  return ' '.join(sentences)


# --- Splits.
def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise UsageError('split', split, 'unknown split', SPLITS)


def split_of(text: str, fractions: tuple[float, float] = (0.8, 0.1)) -> str:
  """The split a text belongs to, from a stable hash (same on every machine).

  `fractions` are the train and validation shares; test gets the rest.
  """
  digest = hashlib.blake2b(text.encode('utf-8'), digest_size=8).digest()
  u = int.from_bytes(digest, 'big') / 2.0**64
  if u < fractions[0]:
    return 'train'
  return 'validation' if u < fractions[0] + fractions[1] else 'test'


def _balanced_labels(n: int, rng: random.Random) -> list[int]:
  labels = [i % 2 for i in range(n)]
  rng.shuffle(labels)
  return labels


def attribute_documents(n: int, seed: int, split: str = 'train'
                        ) -> tuple[list[str], np.ndarray]:
  """`n` sentiment reviews of `split` and their int32 labels (1 = positive)."""
  _check_split(split)
  if n < 0:
    raise UsageError('n', n, 'must be >= 0')
  rng = random.Random(seed)
  texts = []
  labels = _balanced_labels(n, rng)
  for label in labels:
    text = _join([_render(s, label) for s in _skeleton(rng)])
    while split_of(text) != split:
      text = _join([_render(s, label) for s in _skeleton(rng)])
    texts.append(text)
  return texts, np.asarray(labels, np.int32)


def contrastive_pairs(n: int, seed: int) -> list[tuple[str, str]]:
  """(positive, negative) train documents: one skeleton, opposite sentiment."""
  rng = random.Random(seed)
  pairs = []
  while len(pairs) < n:
    skeleton = _skeleton(rng)
    pos, neg = (_join([_render(s, y) for s in skeleton]) for y in (1, 0))
    if split_of(pos) == split_of(neg) == 'train':
      pairs.append((pos, neg))
  return pairs


# --- Multiple choice.
@dataclasses.dataclass(frozen=True)
class MCItem:
  """A two-way choice; `label` indexes the choice carrying positive sentiment.

  The scored text of choice i is `prefix() + choices[i]`, with prefix =
  context + SEPARATOR (one space, as between sentences of a document). Score
  BOS + encode(prefix()) as given and the bytes of encode(choices[i]).
  """
  context: str
  choices: tuple[str, str]
  label: int
  SEPARATOR: ClassVar[str] = ' '

  def prefix(self) -> str:
    return self.context + self.SEPARATOR

  def texts(self) -> tuple[str, str]:
    return (self.prefix() + self.choices[0], self.prefix() + self.choices[1])


# COPA alternatives stand alone (no 'and ... as well') and have partners of
# similar length: all adjectives, and phrases within 3 bytes.
_COPA_PHRASES = [
    k for k, (p, q) in enumerate(zip(POSITIVE_PHRASES, NEGATIVE_PHRASES,
                                     strict=True)) if abs(len(p) - len(q)) <= 3]
MC_TASKS = ('copa', 'cloze', 'pydoc_polarity')
# The real-text task's split shares (`split_of`'s fractions): no train
# share, as nothing trains on it; 40% validation, 60% test.
POLARITY_FRACTIONS = (0.0, 0.4)
# (original word positive, label) of a polarity item, cycled: any even
# count of items is balanced in both.
_POLARITY_CELLS = ((True, 0), (False, 1), (True, 1), (False, 0))


def mc_task(name: str, n: int, seed: int, split: str = 'test'
            ) -> list[MCItem]:
  """`n` items of task `name` (`MC_TASKS`), positive slot balanced.

  copa: neutral premise; one positive and one negative one-sentence
  alternative from the same skeleton. cloze: three negative sentences, then
  a positive and a negative closing from a paired template, so context
  pulls an unsteered model toward the negative ending. pydoc_polarity:
  real sentences (`mc_item_sets`).
  """
  if name not in MC_TASKS:
    raise UsageError('name', name, 'unknown multiple-choice task', MC_TASKS)
  _check_split(split)
  if name == 'pydoc_polarity':
    return _polarity_sets(n, (seed,), split)[0]
  rng = random.Random(seed)
  items = []
  for label in _balanced_labels(n, rng):
    while True:
      if name == 'copa':
        context = rng.choice(PREMISES)
        ending = (_opening(rng) if rng.random() < 0.5 else
                  _detail(rng, DETAIL_TEMPLATES[:3], _COPA_PHRASES))
      else:
        context = _join([_render(s, 0) for s in (
            _opening(rng), _detail(rng), _detail(rng))])
        ending = _closing(rng)
      pos, neg = _render(ending, 1), _render(ending, 0)
      choices = (pos, neg) if label == 0 else (neg, pos)
      item = MCItem(context, choices, label)
      if split_of(item.texts()[1 - label]) == split:
        items.append(item)
        break
  return items


def mc_item_sets(name: str, n: int, seeds: Sequence[int],
                 split: str = 'test') -> list[list[MCItem]]:
  """One item set of `n` items per seed: what an evaluation scores.

  Template tasks: `mc_task(name, n, seed, split)` per seed. pydoc_polarity
  (real text, `train.lm.polarity_sentences`): the sets are disjoint, drawn
  together without replacement from the split's pool, so the set of a
  seed depends on the seeds before it. Each item is one documentation
  sentence cut at a polarity word: context = the sentence up to the word,
  choices = the rest of the sentence with the word as written and with
  its antonym, label = the choice with the positive word. Each set holds
  as many items whose original word is positive as negative (an
  unsteered model that prefers the text as written is right on half),
  and as many with the positive choice first as second (both exact for
  an even n). Splits are by `split_of(sentence, POLARITY_FRACTIONS)`, so
  validation and test never share a sentence.

  Raises:
    UsageError: naming `n`, when the sets need more items of either
      polarity than the split's pool holds (`mc_capacity`).
  """
  if name not in MC_TASKS:
    raise UsageError('name', name, 'unknown multiple-choice task', MC_TASKS)
  _check_split(split)
  if name == 'pydoc_polarity':
    return _polarity_sets(n, tuple(seeds), split)
  return [mc_task(name, n, seed, split) for seed in seeds]


@functools.lru_cache(maxsize=4)
def _polarity_pool(split: str) -> tuple[
    tuple[polarity_sentences.Occurrence, ...],
    tuple[polarity_sentences.Occurrence, ...]]:
  """The split's occurrences whose word is positive, and negative."""
  pool = [o for o in polarity_sentences.occurrences()
          if split_of(o.sentence, POLARITY_FRACTIONS) == split]
  return (tuple(o for o in pool if o.positive),
          tuple(o for o in pool if not o.positive))


def mc_capacity(name: str, split: str, sets: int = 1) -> int | None:
  """The largest n for which `sets` item sets of task `name` fit in
  `split` (None: the template tasks are unbounded)."""
  _check_split(split)
  if name != 'pydoc_polarity':
    return None
  positive, negative = (len(p) // max(sets, 1) for p in _polarity_pool(split))
  # A set of n takes ceil(n / 2) positive originals and floor(n / 2)
  # negative ones (`_POLARITY_CELLS`).
  return min(2 * positive, 2 * negative + 1)


def _polarity_sets(n: int, seeds: tuple[int, ...], split: str
                   ) -> list[list[MCItem]]:
  positive, negative = _polarity_pool(split)
  capacity = mc_capacity('pydoc_polarity', split, len(seeds))
  if not 0 <= n <= capacity:
    raise UsageError(
        'n', n, f'pydoc_polarity\'s {split} split holds '
        f'{len(positive) + len(negative)} items ({len(positive)} whose word '
        f'is positive, {len(negative)} negative): {len(seeds)} disjoint '
        f'set(s) of n items fit for n <= {capacity}')
  order = random.Random(f'pydoc_polarity/{split}/{seeds}')
  pools = {True: order.sample(positive, len(positive)),
           False: order.sample(negative, len(negative))}
  sets = []
  for seed in seeds:
    cells = [_POLARITY_CELLS[i % 4] for i in range(n)]
    random.Random(seed).shuffle(cells)
    items = []
    for original_positive, label in cells:
      o = pools[original_positive].pop()
      pos, neg = ((o.original(), o.swapped()) if original_positive
                  else (o.swapped(), o.original()))
      items.append(MCItem(o.context, (pos, neg) if label == 0 else (neg, pos),
                          label))
    sets.append(items)
  return sets


def item_split(name: str, item: MCItem) -> str:
  """The split an item of task `name` belongs to: of its negative text
  (template tasks), of its documentation sentence (pydoc_polarity)."""
  if name != 'pydoc_polarity':
    return split_of(item.texts()[1 - item.label])
  known = _polarity_sentences()
  for text in item.texts():
    if text in known:
      return split_of(text, POLARITY_FRACTIONS)
  raise ValueError(f'{item!r}: neither text is a pydoc_polarity sentence')


@functools.lru_cache(maxsize=1)
def _polarity_sentences() -> frozenset[str]:
  return frozenset(o.sentence for o in polarity_sentences.occurrences())


# --- Bytes.
def encode(text: str) -> np.ndarray:
  """int32 byte ids; non-ASCII becomes '?', and so do the PAD/BOS bytes."""
  ids = np.frombuffer(text.encode('ascii', 'replace'), np.uint8).astype(
      np.int32)
  ids[ids <= BOS] = ord('?')
  return ids


def encode_document(text: str) -> np.ndarray:
  """BOS, then the text's bytes: how every document starts in training."""
  return np.concatenate([[BOS], encode(text)]).astype(np.int32)


def decode(ids) -> str:
  """Text of byte ids, skipping PAD and BOS (bytes >= 128 decode as U+FFFD)."""
  data = bytes(int(i) for i in np.asarray(ids).ravel() if i not in (PAD, BOS))
  return data.decode('ascii', 'replace')


# --- Real English.
_TYPOGRAPHY = str.maketrans({'\u2018': "'", '\u2019': "'", '\u201c': '"',
                             '\u201d': '"', '\u2013': '-', '\u2014': '--',
                             '\u2026': '...', '\t': ' ', '\r': ''})


def _clean(text: str) -> str:
  """ASCII, no control chars but newline, single spaces, no blank lines."""
  text = re.sub('.\x08', '', text).translate(_TYPOGRAPHY)  # Overstrike.
  text = ''.join(c for c in unicodedata.normalize('NFKD', text)
                 if not unicodedata.combining(c))
  text = text.encode('ascii', 'replace').decode('ascii')
  text = re.sub('[\x00-\x09\x0b-\x1f\x7f]', '', text)
  lines = (re.sub(' +', ' ', line).strip() for line in text.split('\n'))
  return '\n'.join(line for line in lines if line)


def _paragraphs(text: str) -> list[str]:
  return [p for p in (_clean(b) for b in re.split(r'\n\s*\n', text)) if p]


def _read(path: str) -> str:
  with open(path, 'rb') as f:
    return f.read().decode('utf-8', 'replace')


@functools.lru_cache(maxsize=8)
def _all_documents(source: str) -> tuple[str, ...]:
  """Every document of `source`, deduplicated, in a fixed order."""
  if source == 'fortunes':
    if not os.path.isdir(FORTUNES_DIR):
      raise FileNotFoundError(
          f'{FORTUNES_DIR} not found: apt-get install fortunes '
          "(or use source='pydoc')")
    docs = []
    for name in sorted(os.listdir(FORTUNES_DIR)):
      path = os.path.join(FORTUNES_DIR, name)
      if name.endswith(('.dat', '.u8')) or not os.path.isfile(path):
        continue  # Index files, UTF-8 links and the 'off/' directory.
      docs += [_clean(e) for e in re.split(r'(?m)^%\s*$', _read(path))]
  elif source == 'pydoc':
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    docs = [p for key in sorted(topics.topics)
            for p in _paragraphs(topics.topics[key])]
  elif os.path.isfile(source) or os.path.isdir(source):
    files = [source] if os.path.isfile(source) else sorted(
        os.path.join(root, f) for root, _, names in os.walk(source)
        for f in names if f.endswith('.txt'))
    docs = [p for f in files for p in _paragraphs(_read(f))]
  else:
    raise UsageError('source', source, 'unknown text source (or no such '
                     'file or directory)', ENGLISH_SOURCES + ('<path>',))
  docs = tuple(dict.fromkeys(d for d in docs if d))
  if not docs:
    raise UsageError('source', source, 'holds no text')
  return docs


def english_documents(source: str, split: str) -> list[str]:
  """Documents of `source` in `split` (90/5/5 by hash of each document)."""
  _check_split(split)
  return [d for d in _all_documents(source)
          if split_of(d, (0.9, 0.05)) == split]


def english_text(source: str) -> str:
  """All of `source` (every split), documents separated by blank lines."""
  return '\n\n'.join(_all_documents(source))


# --- Packing.
def pack_windows(documents: Sequence[str], seq_len: int, seed: int,
                 encode_doc: Callable[[str], np.ndarray] | None = None,
                 dtype: type = np.uint8) -> np.ndarray:
  """(N, seq_len + 1) windows of BOS-led documents in a seeded order.

  `encode_doc` turns a document into its ids with BOS first (default:
  `encode_document`, bytes); `dtype` must hold every id.
  """
  if seq_len < 1:
    raise UsageError('seq_len', seq_len, 'must be >= 1')
  encode_doc = encode_doc or encode_document
  order = np.random.default_rng(seed).permutation(len(documents))
  parts = [encode_doc(documents[i]) for i in order]
  stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
  n = len(stream) // (seq_len + 1)
  if n == 0:
    raise UsageError('documents', f'<{len(stream)} tokens>',
                     f'fewer than seq_len + 1 = {seq_len + 1} tokens')
  if stream.size and stream.max() > np.iinfo(dtype).max:
    raise ValueError(f'token id {stream.max()} does not fit {dtype}')
  return stream[:n * (seq_len + 1)].reshape(n, seq_len + 1).astype(dtype)


def _english_stream(source: str, split: str, rng: random.Random
                    ) -> Iterator[str]:
  docs = english_documents(source, split)
  if not docs:
    raise UsageError('source', source, f'has no documents in split {split!r}')
  while True:  # Cycles through a fresh shuffle when the source runs out.
    yield from rng.sample(docs, len(docs))


def _attribute_stream(split: str, rng: random.Random) -> Iterator[str]:
  while True:
    yield from attribute_documents(256, rng.randrange(2**31), split)[0]


def mixture_documents(mix: Sequence[tuple[str, float]], total_bytes: int,
                      split: str, seed: int) -> list[tuple[str, str]]:
  """(source, document) pairs; each source fills weight / sum of `total_bytes`.

  Sizes count the BOS byte; the last document of each source is cut so its
  share is exact. Sources: 'attribute', 'fortunes', 'pydoc' or a path.
  """
  _check_split(split)
  if total_bytes < 1:
    raise UsageError('total_bytes', total_bytes, 'must be >= 1')
  if not mix:
    raise UsageError('mix', mix, 'is empty')
  for i, (source, weight) in enumerate(mix):
    if not math.isfinite(weight) or weight < 0:
      raise UsageError(f'mix[{i}].weight', weight, f'of {source!r} must be '
                       'finite and >= 0')
  total_weight = sum(w for _, w in mix)
  if total_weight <= 0:
    raise UsageError('mix', mix, 'all weights are zero')
  out = []
  for i, (source, weight) in enumerate(mix):
    rng = random.Random(f'{seed}/{i}/{source}')
    stream = (_attribute_stream(split, rng) if source == 'attribute'
              else _english_stream(source, split, rng))
    budget = round(total_bytes * weight / total_weight)
    while budget > 1:
      doc = next(stream)[:budget - 1]
      out.append((source, doc))
      budget -= len(doc) + 1
  return out


def build_lm_windows(mix: Sequence[tuple[str, float]], total_bytes: int,
                     seq_len: int, split: str, seed: int,
                     encode_doc: Callable[[str], np.ndarray] | None = None,
                     dtype: type = np.uint8) -> np.ndarray:
  """LM windows (N, seq_len + 1) packed from `mixture_documents` (bytes of
  text; tokens as `encode_doc` makes them, see `pack_windows`)."""
  docs = mixture_documents(mix, total_bytes, split, seed)
  return pack_windows([d for _, d in docs], seq_len, seed, encode_doc, dtype)


# --- Statistics of generations (words are whitespace-separated tokens).
def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
  words = text.split()
  return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
  """Unique word n-grams / all word n-grams over `texts` (0.0 if none)."""
  if n < 1:
    raise UsageError('n', n, 'must be >= 1')
  grams = [g for t in texts for g in _ngrams(t, n)]
  return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(texts: Sequence[str], n: int = 3) -> float:
  """Mean over texts of the share of n-grams repeating an earlier one in it."""
  if n < 1:
    raise UsageError('n', n, 'must be >= 1')
  rates = []
  for text in texts:
    grams = _ngrams(text, n)
    if grams:
      rates.append(1 - len(set(grams)) / len(grams))
  return float(np.mean(rates)) if rates else 0.0
