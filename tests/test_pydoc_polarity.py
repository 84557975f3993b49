"""The real-text task 'pydoc_polarity': its items are sentences of Python's
own documentation (found in the raw sources, not through the task's
reader), its two choices differ in the antonym word alone, each set is
balanced, the splits share no sentence, and too many items is an error
naming n."""

import functools
import os
import sysconfig

import pytest

from train.errors import UsageError
from train.lm import corpus as tc
from train.lm import polarity_sentences as ps

TASK = 'pydoc_polarity'


@functools.lru_cache(maxsize=1)
def _documentation() -> str:
  """The topics and every standard-library source file, whitespace
  collapsed, read without the task's reader: a docstring's sentence is a
  substring of its file."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  parts = list(topics.topics.values())
  for dirpath, dirnames, files in os.walk(sysconfig.get_paths()['stdlib']):
    dirnames[:] = [d for d in dirnames if d not in ('site-packages',
                                                    '__pycache__')]
    for f in files:
      if f.endswith('.py'):
        with open(os.path.join(dirpath, f), 'rb') as fh:
          parts.append(fh.read().decode('utf-8', 'replace'))
  return ' '.join(' '.join(parts).split())


@functools.lru_cache(maxsize=1)
def _pool() -> frozenset[str]:
  # Built once: per item, the set of every sentence was rebuilt hundreds
  # of times.
  return frozenset(o.sentence for o in ps.occurrences())


def _original(item: tc.MCItem) -> int:
  """Which choice completes the item into a sentence of the task's pool
  (the first test checks the pool's sentences against the raw sources)."""
  pool = _pool()
  found = [i for i, text in enumerate(item.texts()) if text in pool]
  assert len(found) == 1, item
  return found[0]


@pytest.fixture(scope='module')
def sets():
  return {'validation': tc.mc_item_sets(TASK, 40, (5,), 'validation'),
          'test': tc.mc_item_sets(TASK, 40, (7, 8, 9), 'test')}


def test_items_are_documentation_sentences_cut_at_an_antonym(sets):
  # Real text: the sentence is in Python's sources as they ship (the
  # searches take a second: one set per split).
  for items in (sets['validation'][0], sets['test'][0]):
    for item in items:
      assert item.texts()[_original(item)] in _documentation(), item
  pairs = {frozenset(p): p[0] for p in ps.PAIRS}
  for split, item_sets in sets.items():
    for items in item_sets:
      originals = [_original(it) for it in items]
      # As many originals positive as negative, and as many positive
      # choices first as second.
      assert sum(o == it.label for o, it in zip(originals, items)) == 20
      assert sum(it.label for it in items) == 20
      for item in items:
        words = [c.split(' ') for c in item.choices]
        words = [[w[0].rstrip(',.;:)')] + w[1:] for w in words]
        assert words[0][1:] == words[1][1:], item
        assert pairs[frozenset((words[0][0], words[1][0]))] == words[
            item.label][0], item
        assert len(item.context.split()) >= 2
        assert tc.item_split(TASK, item) == split


def test_sets_are_deterministic_disjoint_and_the_splits_share_no_sentence(
    sets):
  assert tc.mc_item_sets(TASK, 40, (7, 8, 9), 'test') == sets['test']
  assert tc.mc_task(TASK, 40, 5, 'validation') == sets['validation'][0]
  texts = [{it.texts()[_original(it)] for it in items}
           for items in sets['test']]
  assert sum(map(len, texts)) == len(set.union(*texts)) == 120
  pools = {s: {o.sentence for o in ps.occurrences()
               if tc.split_of(o.sentence, tc.POLARITY_FRACTIONS) == s}
           for s in tc.SPLITS}
  assert not pools['validation'] & pools['test'] and not pools['train']
  assert not set.union(*texts) & pools['validation']


def test_pool_sizes_and_too_many_items_name_n():
  # The study's sizes fit: 3 disjoint test sets of 40, 2 validation sets.
  assert tc.mc_capacity(TASK, 'test', sets=3) >= 40
  assert tc.mc_capacity(TASK, 'validation', sets=2) >= 40
  assert tc.mc_capacity('copa', 'test') is None
  limit = tc.mc_capacity(TASK, 'validation')
  assert len(tc.mc_task(TASK, limit, 0, 'validation')) == limit
  with pytest.raises(UsageError, match=rf'n={limit + 1}: .*validation split '
                     rf'holds \d+ items .* n <= {limit}'):
    tc.mc_task(TASK, limit + 1, 0, 'validation')
  with pytest.raises(UsageError, match=r'n=1: .*train split holds 0 items'):
    tc.mc_task(TASK, 1, 0, 'train')
  assert len(ps.fingerprint()) == 16


def test_the_selected_study_refuses_more_items_than_the_pool_holds():
  """The selected settings' study (configs/gemma.py:selection) checks its
  sets against this pool before anything is loaded: 2 validation sets of
  40 fit, of 60 do not, named in one line. Here, where the pool is built
  already (test_gemma_steering_results runs the README command's refusal
  itself, slow: 15 s of a process building the pool again)."""
  from configs import gemma as gemma_config  # pylint: disable=g-import-not-at-top
  from studies.gemma_steering import selected  # pylint: disable=g-import-not-at-top
  from train.errors import ConfigError  # pylint: disable=g-import-not-at-top
  config = gemma_config.get_config('selection')
  assert config.selection.items_per_set == 40
  selected.check(config, (0.1, 0.2), 100)
  config.selection.items_per_set = 60
  with pytest.raises(ConfigError) as e:
    selected.check(config, (0.1, 0.2), 100)
  assert str(e.value) == (
      'config.selection.items_per_set=60: 2 validation item set(s) of '
      'pydoc_polarity hold at most 59 items each')
