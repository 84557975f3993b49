"""Sentences of Python's own documentation that hold a polarity word.

The real text behind the 'pydoc_polarity' two-choice task
(`corpus.mc_task`): sentences written by Python's authors, not by this
repository, that ship offline with every CPython install. Two sources,
in this order: the language reference's topics (`pydoc_data.topics`,
what the 'pydoc' text source reads) and the docstrings of the standard
library's pure-Python modules (modules, classes and functions, read with
`ast` from the installed sources; what `pydoc` shows), without the test
suites and the modules some distributions package apart (tkinter,
idlelib, lib2to3, distutils, ensurepip, turtledemo).

The rule, applied to every paragraph (blank-line separated, whitespace
collapsed):

- sentences are cut after '.', '!' or '?' before a capital letter; a
  sentence is kept when it is ASCII, 20 to 300 characters long, starts
  with a capital letter, ends with '.', and holds no code markers
  ('>>>', '::', '{', '}', '=', '\\', '|', '#');
- a lowercase whole-word occurrence of a word of `PAIRS` (after a
  space, before a space or one of ',.;:)'), with at least two words
  before it, is a candidate; one after 'a' or 'an' whose antonym would
  need the other article is not (the article is in the shared context,
  so one choice would be ungrammatical);
- each sentence gives at most one `Occurrence`: its first candidate whose
  word is negative if it has one (the scarcer kind in documentation),
  else its first candidate, so that items of different sets never share
  a sentence.

The pool therefore depends on the Python version (its documentation);
`fingerprint` names it, and results record it.
"""

import ast
import functools
import hashlib
import os
import re
import sysconfig
from typing import NamedTuple

# (positive, negative) antonyms. VADER's lexicon (vaderSentiment 3.3.2)
# rates both with opposite signs, or rates one of them and the other is
# its negation by a prefix (in-, un-, il-, im-) or its plain opposite:
# correct, valid, efficient, reliable, proper, appropriate, helpful,
# legal, safe, allowed. Left out: words whose usual sense in the docs is
# not evaluative (right, true, positive, possible, working).
PAIRS = (
    ('good', 'bad'), ('better', 'worse'), ('best', 'worst'),
    ('succeed', 'fail'), ('succeeds', 'fails'), ('succeeded', 'failed'),
    ('success', 'failure'), ('successes', 'failures'),
    ('successful', 'unsuccessful'), ('successfully', 'unsuccessfully'),
    ('useful', 'useless'), ('easy', 'difficult'), ('secure', 'insecure'),
    ('benefit', 'harm'), ('advantage', 'disadvantage'),
    ('accept', 'reject'), ('accepted', 'rejected'),
    ('supported', 'unsupported'), ('strong', 'weak'),
    ('stable', 'unstable'), ('improve', 'worsen'),
    ('desirable', 'undesirable'), ('convenient', 'inconvenient'),
    ('careful', 'careless'), ('friendly', 'unfriendly'), ('win', 'lose'),
    ('allowed', 'forbidden'), ('correct', 'incorrect'),
    ('correctly', 'incorrectly'), ('valid', 'invalid'), ('safe', 'unsafe'),
    ('safely', 'unsafely'), ('efficient', 'inefficient'),
    ('helpful', 'unhelpful'), ('reliable', 'unreliable'),
    ('proper', 'improper'), ('properly', 'improperly'),
    ('appropriate', 'inappropriate'), ('legal', 'illegal'))
# word -> (antonym, whether the word is the positive one).
ANTONYMS = {**{p: (n, True) for p, n in PAIRS},
            **{n: (p, False) for p, n in PAIRS}}

# Standard-library folders not read: test suites, and packages that some
# distributions ship apart (the pool should not depend on which are in).
_SKIPPED_DIRS = frozenset({
    'idlelib', 'tkinter', 'lib2to3', 'distutils', 'turtledemo', 'ensurepip',
    'site-packages', 'dist-packages', '__pycache__', 'pydoc_data'})
_CODE = re.compile(r'>>>|::|[{}=\\|#]')
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=[A-Z])')
_WORD = re.compile(r'(?<= )(' + '|'.join(sorted(ANTONYMS, key=len,
                                                reverse=True))
                   + r')(?=[ ,.;:)])')
_VOWELS = 'aeiou'


class Occurrence(NamedTuple):
  """One polarity word in one documentation sentence.

  Attributes:
    sentence: the sentence, as the documentation has it.
    start: the index of `word` in it (after a space).
    word: the polarity word found.
    antonym: its partner in `PAIRS`.
    positive: whether `word` is the positive one of the pair.
  """
  sentence: str
  start: int
  word: str
  antonym: str
  positive: bool

  @property
  def context(self) -> str:
    """The sentence up to the word, without the space before it."""
    return self.sentence[:self.start - 1]

  def original(self) -> str:
    """The rest of the sentence as written, from the word on."""
    return self.sentence[self.start:]

  def swapped(self) -> str:
    """The rest of the sentence with the word replaced by its antonym."""
    return self.antonym + self.sentence[self.start + len(self.word):]


def _topic_paragraphs() -> list[str]:
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  return [p for key in sorted(topics.topics)
          for p in re.split(r'\n\s*\n', topics.topics[key])]


def _stdlib_files(root: str) -> list[str]:
  out = []
  for dirpath, dirnames, files in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS
                         and not d.startswith(('test', 'config-')))
    out += [os.path.join(dirpath, f) for f in sorted(files)
            if f.endswith('.py') and not f.startswith('test')]
  return out


def _docstring_paragraphs() -> list[str]:
  """Every docstring paragraph of the standard library's Python sources."""
  root = sysconfig.get_paths()['stdlib']
  files = _stdlib_files(root)
  if not files:
    raise FileNotFoundError(
        f'no Python sources under {root}: the pydoc_polarity task reads '
        'the standard library\'s docstrings')
  out = []
  for path in files:
    with open(path, 'rb') as f:
      try:
        tree = ast.parse(f.read(), path)
      except (SyntaxError, ValueError):  # A file for another Python.
        continue
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                           ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc:
          out += re.split(r'\n\s*\n', doc)
  return out


def _sentences(paragraph: str) -> list[str]:
  text = ' '.join(paragraph.split())
  return [s for s in _SENTENCE_END.split(text)
          if 20 <= len(s) <= 300 and s[0].isupper() and s.endswith('.')
          and s.isascii() and not _CODE.search(s)]


def _in_sentence(sentence: str) -> list[Occurrence]:
  out = []
  for match in _WORD.finditer(sentence):
    word = match.group(1)
    antonym, positive = ANTONYMS[word]
    before = sentence[:match.start()].split()
    if len(before) < 2:
      continue
    if before[-1] in ('a', 'an') and (
        (word[0] in _VOWELS) != (antonym[0] in _VOWELS)):
      continue
    out.append(Occurrence(sentence, match.start(), word, antonym, positive))
  return out


@functools.lru_cache(maxsize=1)
def occurrences() -> tuple[Occurrence, ...]:
  """The occurrences of the documentation's sentences, one per sentence
  at most, in a fixed order (sources, then topics by name and files by
  path, then position); a sentence found twice counts where it first
  appears."""
  sentences = dict.fromkeys(
      s for p in _topic_paragraphs() + _docstring_paragraphs()
      for s in _sentences(p))
  out = []
  for sentence in sentences:
    found = _in_sentence(sentence)
    if found:
      out.append(next((o for o in found if not o.positive), found[0]))
  return tuple(out)


def fingerprint() -> str:
  """A short hash of the pool (its sentences and positions): equal
  fingerprints, equal tasks."""
  h = hashlib.sha256()
  for o in occurrences():
    h.update(f'{o.start}\t{o.sentence}\n'.encode())
  return h.hexdigest()[:16]
