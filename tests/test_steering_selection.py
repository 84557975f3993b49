"""Selection on validation data (train.steering.selection), on the tests'
two-layer Gemma 3: it never sees a test item (the corpus and the scorer's
encoder are instrumented to raise on one before selection.json exists, and
a selection planted to read the test split is caught), its choice is the
argmax of the validation scores it records (recomputed here with numpy's
interpolation), the test rows are at the chosen settings, and a bad
setting is refused naming the field before any model is loaded."""

import json
import math
import os
from typing import Any, NamedTuple

import numpy as np
import pytest

from configs import gemma as gemma_config
from configs import steering as steering_config
from train.errors import ConfigError
from train.lm import corpus as text_corpus
from train.steering import evaluation
from train.steering import scoring
from train.steering import selection
from train.steering import selection_rule

from tests import tiny_gemma


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('tiny') / 'g.gguf')


def _config(tiny_file, **overrides):
  """The smallest selection that still chooses: both blocks, the three
  direction methods, two alphas; one steered method, one task, no
  generations (every extra one is a compile)."""
  config = gemma_config.get_config('runlocal,selection')
  config.update(dict(gguf=str(tiny_file), shape='gguf', layer=1,
                     sweep_layers=(), methods=('none', 'addition'),
                     alphas=(0.3, 1.0), mc_seeds=(7,), heldout_windows=2))
  config.tasks = dict(copa=2)
  config.generation.enabled = False
  config.selection.update(dict(layers=(0, 1), items_per_set=2,
                               targets=(0.01, 0.05)))
  config.update(overrides)
  return config


_TEMPLATE = text_corpus.POSITIVE_SENTENCES | text_corpus.NEGATIVE_SENTENCES


def _split(item: text_corpus.MCItem) -> str:
  """The split of an item of any task: a template task's choices are
  sentences of the grammar, the real-text task's are not."""
  task = 'copa' if item.choices[0] in _TEMPLATE else 'pydoc_polarity'
  return text_corpus.item_split(task, item)


class Log(NamedTuple):
  """(made during the selection, split, item) of every item the corpus
  made and the scorer encoded."""
  made: list
  encoded: list


def _instrument(monkeypatch, workdir, log: Log) -> None:
  """A test item made or encoded before selection.json exists raises."""
  selecting = lambda: not os.path.exists(os.path.join(workdir,
                                                      selection.FILENAME))
  item_sets, encode = text_corpus.mc_item_sets, scoring.encode_mc

  def check(items, where, record):
    for item in items:
      split = _split(item)
      record.append((selecting(), split, item))
      if selecting() and split != 'validation':
        raise AssertionError(f'{where}: a {split} item during the '
                             f'selection: {item}')

  def mc_item_sets(name, n, seeds, split='test'):
    if selecting() and split != 'validation':
      raise AssertionError(f'the selection asked for split={split!r}')
    sets = item_sets(name, n, seeds, split)
    check([it for s in sets for it in s], 'mc_item_sets', log.made)
    return sets

  def encode_mc(items, tokenizer=None):
    check(items, 'encode_mc', log.encoded)
    return encode(items, tokenizer)

  monkeypatch.setattr(text_corpus, 'mc_item_sets', mc_item_sets)
  monkeypatch.setattr(scoring, 'encode_mc', encode_mc)


class Run(NamedTuple):
  config: Any
  rows: list
  record: dict
  log: Log


@pytest.fixture(scope='module')
def run(tiny_file, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('select'))
  config = _config(tiny_file)
  log = Log([], [])
  with pytest.MonkeyPatch.context() as monkeypatch:
    _instrument(monkeypatch, workdir, log)
    rows = selection.evaluate(config, workdir)
  with open(os.path.join(workdir, selection.FILENAME)) as f:
    record = json.load(f)
  assert os.path.exists(os.path.join(workdir, 'results.json'))
  assert os.path.exists(os.path.join(workdir, 'steering_vector_addition.npz'))
  return Run(config, rows, record, log)


def test_the_selection_never_sees_a_test_item(run):
  during = [(s, it) for selecting, s, it in run.log.encoded if selecting]
  assert during and {s for s, _ in during} == {'validation'}
  assert {s for selecting, s, _ in run.log.made if selecting} == {
      'validation'}
  # What it scored is what it recorded, and it recorded validation items.
  recorded = [text_corpus.MCItem(c, (a, b), y)
              for sets in run.record['items'].values() for s in sets
              for c, a, b, y in s]
  assert [it for _, it in during] == recorded
  assert run.record['split'] == 'validation'
  # The test sets came after, once: the instrumentation sees them.
  after = [s for selecting, s, _ in run.log.encoded if not selecting]
  assert after and set(after) == {'test'}


def test_a_selection_that_reads_the_test_split_is_caught(
    tiny_file, tmp_path, monkeypatch):
  """The planted bug: the selection asks for the test split."""
  monkeypatch.setattr(selection, 'SELECTION_SPLIT', 'test')
  _instrument(monkeypatch, str(tmp_path), Log([], []))
  with pytest.raises(AssertionError, match="asked for split='test'"):
    selection.evaluate(_config(tiny_file), str(tmp_path))


def _matched(kl, acc, base, targets):
  """Accuracy at each target KL: numpy's interpolation through (0, base)
  and the sweep, NaN beyond its largest KL."""
  x = np.array([0.0, *kl])
  y = np.array([base, *acc])
  order = np.argsort(x, kind='stable')
  return np.array([np.interp(t, x[order], y[order]) if t <= x.max()
                   else math.nan for t in targets])


def _grid(alphas, kl, targets):
  ranked = sorted(zip(kl, alphas))
  reached = [t for t in targets if t <= ranked[-1][0]]
  if not reached:
    return sorted(alphas)
  lo = max([i for i, (k, _) in enumerate(ranked) if k < reached[0]],
           default=min(i for i, (k, _) in enumerate(ranked)
                       if k >= reached[0]))
  hi = min(i for i, (k, _) in enumerate(ranked) if k >= reached[-1])
  return sorted(a for _, a in ranked[lo:hi + 2])


def test_the_choice_is_the_argmax_of_the_recorded_validation_scores(run):
  rec = run.record
  targets = rec['targets']
  for method, cands in rec['candidates'].items():
    assert len(cands) == 2 * 3  # Blocks x direction methods.
    keys = []
    for c in cands:
      per_task = np.array([_matched(c['kl'], acc, rec['unsteered'][t],
                                    targets)
                           for t, acc in c['accuracy'].items()])
      ok = np.all(np.isfinite(per_task), 0)
      keys.append((int(ok.sum()),
                   float(per_task[:, ok].mean()) if ok.any() else -math.inf))
    k = keys.index(max(keys))
    choice = rec['choice'][method]
    assert choice['candidate'] == k
    assert (choice['layer'], choice['direction_method']) == (
        cands[k]['layer'], cands[k]['direction_method'])
    assert choice['score'] == pytest.approx(keys[k][1], abs=1e-9)
    assert choice['alphas'] == _grid(rec['alphas'], cands[k]['kl'], targets)
    # The test rows are at the chosen setting.
    rows = [r for r in run.rows if r['method'] == method]
    assert [r['alpha'] for r in rows] == choice['alphas']
    assert {(r['layer'], r['direction_method']) for r in rows} == {
        (choice['layer'], choice['direction_method'])}
  assert [r['method'] for r in run.rows][0] == 'none'


@pytest.mark.parametrize('field, value, needle', [
    ('selection.layers', (0, 5), "block 5 is out of range; valid choices: "
     "0, 1"),
    ('selection.layers', (), 'at least one'),
    ('selection.direction_methods', ('mean_diff', 'lda'),
     "unknown direction method 'lda'; valid choices: 'mean_diff', 'pca', "
     "'pca_center', 'logistic'"),
    ('selection.direction_methods', (), 'at least one'),
    ('selection.mc_seeds', (), 'one validation item set per seed'),
    ('selection.items_per_set', 0, 'must be an integer in'),
    ('selection.targets', (0.2, 0.1), 'increasing KL values'),
    ('selection.score', 'max', "valid choices: 'mean', 'sum'"),
    ('vector_file', 'v.npz', 'extracts its own directions'),
    ('methods', ('none',), 'needs a steered method'),
])
def test_a_bad_setting_is_refused_before_the_model_loads(
    tiny_file, tmp_path, monkeypatch, field, value, needle):
  def load(config):
    raise AssertionError('the model was loaded')
  monkeypatch.setattr(evaluation, 'load_subject', load)
  config = _config(tiny_file)
  parent, _, name = field.rpartition('.')
  (config[parent] if parent else config)[name] = value
  with pytest.raises(ConfigError, match=f'config.{field}=') as e:
    selection.evaluate(config, str(tmp_path / 'w'))
  assert needle in str(e.value)
  assert not os.path.exists(tmp_path / 'w')


def test_the_configs_selection_block_and_its_sizes():
  for module, layers in ((steering_config, (1, 2, 3)),
                         (gemma_config, (3, 6, 9, 12))):
    assert 'selection' not in module.get_config()  # Off by default.
    config = module.get_config('selection')
    assert tuple(config.selection.layers) == layers
    assert tuple(config.selection.direction_methods) == (
        'mean_diff', 'pca_center', 'logistic')
    assert len(module.get_config('runlocal,selection').selection.layers) == 2
  with pytest.raises(ValueError, match='selection is for the steering'):
    gemma_config.get_config('finetune,selection')
  with pytest.raises(ConfigError, match='config.selection='):
    evaluation.evaluate(gemma_config.get_config('selection'), '/nonexistent')


def test_the_rule_on_constructed_sweeps():
  """`selection_rule` against the helpers above on sweeps built to test
  its edges: reaching more targets beats a higher score, the first of
  equals wins, the grid brackets the targets with one alpha of margin."""
  targets = [0.1, 0.3]
  alphas = [0.1, 0.2, 0.4, 0.6, 0.8]
  kl = [0.02, 0.05, 0.15, 0.35, 0.9]
  far = dict(kl=kl, accuracy={'a': [0.5, 0.55, 0.6, 0.7, 0.9]})
  near = dict(kl=[0.01, 0.02, 0.05, 0.12, 0.2],   # Reaches 0.1 only.
              accuracy={'a': [0.9, 0.95, 1.0, 1.0, 1.0]})
  unsteered = {'a': 0.5}
  scores = [selection_rule.candidate_score(c, unsteered, targets)
            for c in (near, far, far)]
  assert [s.reached for s in scores] == [1, 2, 2]
  assert selection_rule.best(scores) == 1
  want = _matched(far['kl'], far['accuracy']['a'], 0.5, targets).mean()
  assert scores[1].score == pytest.approx(want)
  for ks, ts in ((kl, targets), ([0.2, 0.25, 0.5, 0.7, 0.9], targets),
                 ([0.001, 0.002, 0.004, 0.006, 0.05], targets),
                 ([0.5, 0.02, 0.15, 0.35, 0.9], [0.3])):
    assert selection_rule.alpha_grid(alphas, ks, ts) == _grid(alphas, ks, ts)
  assert selection_rule.alpha_grid(alphas, kl, targets) == [0.2, 0.4, 0.6,
                                                            0.8]
