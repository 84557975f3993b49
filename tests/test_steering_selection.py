"""Selection on validation data (train.steering.selection), on the tests'
two-layer Gemma 3: it never sees a test item (the corpus and the scorer's
encoder are instrumented to raise on one before selection.json exists, and
a selection planted to read the test split is caught), its choice is the
argmax of the validation scores it records (recomputed here with numpy's
interpolation), the test rows are at the chosen settings, and a bad
setting is refused naming the field before any model is loaded. The
gated method's calibrated gate (center, kappa, beta) is what
`layer_mean` and `calibrate_gate` give on the contrastive tokens' layer
outputs recomputed here, and its trigger rates and histograms on the
validation and test held-out tokens are numpy's count of delta > beta on
the captured activations. The selection runs once, inside the study at
selected settings (studies.gemma_steering.selected), whose report,
reuse and refusal are checked on it too."""

import json
import math
import os
import shutil
import types
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

from configs import gemma as gemma_config
from configs import steering as steering_config
from geom import steering
from studies.gemma_steering import selected
from train.errors import ConfigError
from train.errors import UsageError
from train.lm import corpus as text_corpus
from train.lm import data as lm_data
from train.lm import hooks as steering_hooks
from train.lm import interface
from train.lm import tokenizer as lm_tokenizer
from train.steering import evaluation
from train.steering import scoring
from train.steering import selection
from train.steering import selection_gate
from train.steering import selection_rule
from train.steering import vectors as steering_vectors

from tests import tiny_gemma


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('tiny') / 'g.gguf')


def _config(tiny_file, **overrides):
  """The smallest selection that still chooses: both blocks, the three
  direction methods, two alphas; one ungated and one gated method (the
  calibrated gate), one task, no generations (every extra one is a
  compile)."""
  config = gemma_config.get_config('runlocal,selection')
  config.update(dict(gguf=str(tiny_file), shape='gguf', layer=1,
                     sweep_layers=(),
                     methods=('none', 'addition', 'spherical_gate'),
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
  made and the scorer encoded; the scoring programs compiled when each
  layer's scorers were made."""
  made: list
  encoded: list
  programs: list


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

  scorers = selection._scorers  # pylint: disable=protected-access

  def counted_scorers(*args, **kwargs):
    log.programs.append(sum(f._cache_size() for f in (  # pylint: disable=protected-access
        scoring._prefill, scoring._tail_logprobs, scoring.window_logprobs,  # pylint: disable=protected-access
        scoring._window_kl)))  # pylint: disable=protected-access
    return scorers(*args, **kwargs)

  monkeypatch.setattr(text_corpus, 'mc_item_sets', mc_item_sets)
  monkeypatch.setattr(scoring, 'encode_mc', encode_mc)
  monkeypatch.setattr(selection, '_scorers', counted_scorers)


class Run(NamedTuple):
  config: Any
  rows: list
  record: dict
  log: Log
  workdir: str
  # The selected-settings study around it (studies.gemma_steering).
  root: str
  summary: dict
  no_reference: str


# The selected-settings report's KL targets.
TARGETS = [0.01, 0.05]


@pytest.fixture(scope='module')
def run(tiny_file, tmp_path_factory):
  """The selection as `python -m studies.gemma_steering
  --config=configs/gemma.py:selection` runs it (`selected.run`, in
  process): selection.evaluate in <root>/selected (`workdir`, the one
  instrumented), then the study's report, with no reference evaluation.
  One selection serves this module's checks of both."""
  root = str(tmp_path_factory.mktemp('select') / 'study')
  workdir = os.path.join(root, selected.NAME)
  no_reference = os.path.join(os.path.dirname(root), 'no_reference')
  config = _config(tiny_file)
  log = Log([], [], [])
  with pytest.MonkeyPatch.context() as monkeypatch:
    _instrument(monkeypatch, workdir, log)
    summary = selected.run(config, root, TARGETS, 200,
                           reference=no_reference)
  with open(os.path.join(workdir, selection.FILENAME)) as f:
    record = json.load(f)
  with open(os.path.join(workdir, 'results.json')) as f:
    rows = json.load(f)['rows']
  assert os.path.exists(os.path.join(workdir, 'steering_vector_addition.npz'))
  return Run(config, rows, record, log, workdir, root, summary, no_reference)


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


def test_each_layers_programs_are_released_before_the_next_layers(run):
  """A layer's scoring programs serve no other layer: none is still
  compiled when the next layer's scorers are made (the selection's two
  blocks, then the test rows'); kept, each layer of Gemma 3 270M added
  0.6-1 GB to the process."""
  assert len(run.log.programs) >= 3, run.log.programs
  assert run.log.programs[1:] == [0] * (len(run.log.programs) - 1), (
      run.log.programs)


def test_a_selection_that_reads_the_test_split_is_caught(
    tiny_file, tmp_path, monkeypatch):
  """The planted bug: the selection asks for the test split."""
  monkeypatch.setattr(selection, 'SELECTION_SPLIT', 'test')
  _instrument(monkeypatch, str(tmp_path), Log([], [], []))
  with pytest.raises(AssertionError, match="asked for split='test'"):
    selection.evaluate(_config(tiny_file), str(tmp_path))


class _Stop(Exception):
  """The planted interruption."""


def _stopping_after(monkeypatch, name: str, n: int, calls: list) -> None:
  """selection.<name> raises _Stop at its call n + 1 (n < 0: never); every
  call's arguments are appended to `calls`."""
  real = getattr(selection, name)

  def wrapped(*args, **kwargs):
    if len(calls) == n:
      raise _Stop(name)
    calls.append(args)
    return real(*args, **kwargs)
  monkeypatch.setattr(selection, name, wrapped)


# Slow (three selections on the two-layer file, 31 s): covered by
# test_kept_records_resume_the_selection_and_its_test_rows below, which
# runs select() and evaluate_selected() themselves, stopped and resumed,
# with the model's work stubbed out.
@pytest.mark.slow
def test_an_interrupted_selection_resumes_from_its_records(
    run, tiny_file, tmp_path):
  """Each validation sweep and each test row is kept as it is made: a
  run stopped in its validation sweeps, and again in its test rows, goes
  on from its records, runs each sweep and row once in all, builds no
  scorers for a layer whose sweeps are all kept, and writes the
  uninterrupted run's selection.json and results byte for byte. A record
  of another config is refused, naming --workdir, and kept."""
  workdir, config = str(tmp_path / 'w'), _config(tiny_file)
  sweeps, rows, scorers = [], [], []
  with pytest.MonkeyPatch.context() as mp:
    # Block 0's six sweeps (2 methods x 3 direction methods), then one.
    _stopping_after(mp, '_sweep', 7, sweeps)
    _stopping_after(mp, '_scorers', -1, scorers)
    with pytest.raises(_Stop):
      selection.evaluate(config, workdir)
  assert len(sweeps) == 7
  assert not os.path.exists(os.path.join(workdir, selection.FILENAME))
  block0, block1 = [c[1] for c in scorers]
  with pytest.MonkeyPatch.context() as mp:
    _stopping_after(mp, '_sweep', -1, sweeps)
    _stopping_after(mp, '_scorers', -1, scorers)
    _stopping_after(mp, '_test_row', 1, rows)
    with pytest.raises(_Stop):
      selection.evaluate(config, workdir)
  # The remaining five sweeps, on block 1's scorers alone; then the test
  # set's scorers at the first chosen block.
  assert len(sweeps) == 12 and len(rows) == 1
  assert [c[1] for c in scorers[2:]] == [
      block1, {0: block0, 1: block1}[run.rows[0]['layer']]]
  with pytest.MonkeyPatch.context() as mp:
    _stopping_after(mp, '_sweep', -1, sweeps)
    _stopping_after(mp, '_test_row', -1, rows)
    selection.evaluate(config, workdir)
  assert len(sweeps) == 12 and len(rows) == len(run.rows)
  for name in (selection.FILENAME, 'results.json', 'results.md'):
    with open(os.path.join(run.workdir, name), 'rb') as f:
      assert open(os.path.join(workdir, name), 'rb').read() == f.read(), name
  config.alphas = (0.3, 0.9)
  record = os.path.join(workdir, selection.SWEEPS, 'unsteered.json')
  before = open(record, 'rb').read()
  with pytest.raises(UsageError, match="--workdir=.*unsteered.json was "
                     'measured with other settings'):
    selection.evaluate(config, workdir)
  assert open(record, 'rb').read() == before


def _stub_the_models_work(monkeypatch, built: list) -> None:
  """Stubs for what select() and evaluate_selected() hand to the model
  (activations, directions, scorers, test batches, sweeps, test rows),
  each a deterministic function of its candidate; `built` records the layer of
  every scorers' build. The bookkeeping around them is the real one."""
  rng = np.random.default_rng(0)
  acts = {f'block_{l}': types.SimpleNamespace(
      positive=rng.normal(size=(4, 8)), negative=rng.normal(size=(4, 8)),
      coefficient=2.0) for l in (0, 1)}
  monkeypatch.setattr(evaluation, 'contrastive_activations',
                      lambda model, params, path, *args: acts[path])
  monkeypatch.setattr(evaluation, 'mc_batches', lambda *args: {})
  methods = ('mean_diff', 'pca', 'pca_center', 'logistic')
  monkeypatch.setattr(steering, 'extract_direction', lambda pos, neg, m: (
      np.roll(pos.mean(0) - neg.mean(0), methods.index(m))))
  # (Releasing the compiled programs is test_each_layers_programs_...'s.)
  monkeypatch.setattr(selection, 'release_layer_programs', lambda: None)
  monkeypatch.setattr(steering_hooks, 'layer_paths',
                      lambda params: list(acts))
  monkeypatch.setattr(selection, '_scorers', lambda lm, path, *args: (
      built.append(path), ({}, {}, None))[1])
  monkeypatch.setattr(selection, '_accuracy',
                      lambda scorers, steer, score: {'copa': 0.5})

  def sweep(config, mc, held, method, setting, candidate):
    size = float(np.abs(setting.direction).sum()) * (1 + candidate['layer'])
    kl = [size * a / 10 for a in config.alphas]
    out = dict(candidate, kl=kl, trigger_rate=[0.5] * len(kl),
               accuracy={'copa': [0.5 + k / 4 for k in kl]})
    if method in selection_gate.GATED_METHODS:
      out.update(gate=setting.gate.record, gate_trigger_rate=0.5,
                 delta_hist=[1, 2])
    return out

  monkeypatch.setattr(selection, '_sweep', sweep)
  monkeypatch.setattr(selection, '_test_row',
                      lambda config, subject, setting, key, *args: dict(
                          key, kl=key['alpha'] / 3))


def test_kept_records_resume_the_selection_and_its_test_rows(tiny_file,
                                                             tmp_path):
  """select() and evaluate_selected() keep each sweep and test row as it is
  made: stopped in the sweeps, and again in the rows, the same calls go on
  from the records, run each sweep and row once in all, build no scorers
  for a layer whose sweeps are all kept, and give the uninterrupted
  run's record and rows; a record of another config is refused, naming
  --workdir, and kept."""
  config = _config(tiny_file)
  config.selection.gate = 'reference'
  lm = types.SimpleNamespace(model=types.SimpleNamespace(max_len=64),
                             params=None, tokenizer=None)
  subject = types.SimpleNamespace(lm=lm, heldout={})
  data = selection.ValidationData({'copa': []}, {}, {})
  paths = {0: 'block_0', 1: 'block_1'}
  built, sweeps, rows = [], [], []

  def run(kept, sweep_stop=-1, row_stop=-1):
    with pytest.MonkeyPatch.context() as mp:
      _stub_the_models_work(mp, built)
      _stopping_after(mp, '_sweep', sweep_stop, sweeps)
      _stopping_after(mp, '_test_row', row_stop, rows)
      record, settings = selection.select(config, lm, data, paths, kept)
      return record, selection.evaluate_selected(config, subject, record,
                                                 settings, paths, kept)[0]

  want = run(selection.Kept(None))
  assert (len(sweeps), built[:2]) == (12, ['block_0', 'block_1'])
  layers = {f"block_{r['layer']}" for r in want[1]}
  assert len(rows) == len(want[1]) > 2
  kept = selection.Kept(str(tmp_path), dict(config=config.to_json()))
  del built[:], sweeps[:], rows[:]
  with pytest.raises(_Stop):
    run(kept, sweep_stop=7)
  with pytest.raises(_Stop):
    run(kept, row_stop=1)
  # The remaining five sweeps on block 1's scorers alone; then the test
  # rows' scorers.
  assert len(sweeps) == 12 and built[:3] == ['block_0', 'block_1',
                                             'block_1']
  del built[:]
  got = run(kept)
  # Only the rows' scorers, once per layer.
  assert len(built) == len(set(built)) and set(built) <= layers
  assert len(sweeps) == 12 and len(rows) == len(want[1])
  # As JSON (the kept records are read back from it), in any key order.
  assert json.loads(json.dumps(got)) == json.loads(json.dumps(want))
  config.alphas = (0.3, 0.9)
  record = os.path.join(tmp_path, selection.SWEEPS, 'unsteered.json')
  before = open(record, 'rb').read()
  with pytest.raises(UsageError, match="--workdir=.*unsteered.json was "
                     'measured with other settings'):
    run(selection.Kept(str(tmp_path), dict(config=config.to_json())))
  assert open(record, 'rb').read() == before


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
      if not c['kl']:  # No calibrated gate: never chosen.
        assert 'error' in c['gate'] and method == 'spherical_gate'
        keys.append((-1, -math.inf))
        continue
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
    ('selection.gate', 'vmf', "unknown gate of the gated methods; valid "
     "choices: 'reference', 'calibrated'"),
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
    assert config.selection.gate == 'calibrated'
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


class Recomputed(NamedTuple):
  """The contrastive tokens' layer outputs, recomputed: per layer, each
  side's (tokens, dim) float64 rows (every token after BOS) and each
  text's mean of them (the 'mean' position's rows)."""
  subject: Any
  tokens: dict[int, tuple[np.ndarray, np.ndarray]]
  pooled: dict[int, tuple[np.ndarray, np.ndarray]]


def _capture(subject, layer: int, tokens, valid) -> np.ndarray:
  """Block `layer`'s unsteered output (float64), by one plain jitted apply
  (op by op it cost seconds of one-op compiles)."""
  path = steering_hooks.resolve_layer(subject.lm.params, layer)
  apply = jax.jit(lambda p, t, v: interface.apply(
      subject.lm.model, p, t, v, capture=(path,))[2].hidden[path])
  return np.asarray(apply(subject.lm.params, tokens, valid), np.float64)


@pytest.fixture(scope='module')
def recomputed(run):
  """Both sides in one batch (the selection runs a batch per side)."""
  config = run.config
  subject = evaluation.load_subject(config)
  pairs = text_corpus.contrastive_pairs(config.direction.pairs,
                                        config.direction.seed)
  seqs = [lm_tokenizer.encode_document(subject.lm.tokenizer, p[i])
          for i in (0, 1) for p in pairs]
  tokens = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  valid = np.zeros(tokens.shape, bool)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)], valid[i, :len(s)] = s, True
  out, pooled = {}, {}
  for layer in config.selection.layers:
    hidden = _capture(subject, layer, tokens, valid)
    texts = [hidden[i, 1:len(s)] for i, s in enumerate(seqs)]
    n = len(pairs)
    out[layer] = (np.concatenate(texts[:n]), np.concatenate(texts[n:]))
    pooled[layer] = (np.stack([t.mean(0) for t in texts[:n]]),
                     np.stack([t.mean(0) for t in texts[n:]]))
  return Recomputed(subject, out, pooled)


def _cos(x: np.ndarray, direction, center: np.ndarray) -> np.ndarray:
  d = np.asarray(direction, np.float64)
  rel = x - center
  return rel @ d / np.linalg.norm(rel, axis=-1) / np.linalg.norm(d)


def _gate_of(recomputed: Recomputed, layer: int, method: str):
  """(center, direction, calibration or the error) by numpy and geom."""
  pos, neg = recomputed.tokens[layer]
  center = np.concatenate([pos, neg]).mean(0)
  direction = np.asarray(steering.extract_direction(
      *recomputed.pooled[layer], method))
  try:
    cal = steering.calibrate_gate(_cos(pos, direction, center),
                                  _cos(neg, direction, center))
  except ValueError as e:
    cal = e
  return center, direction, cal


def test_the_calibrated_gate_is_the_contrastive_sets(run, recomputed):
  """Every candidate's center norm, kappa and beta in selection.json are
  `calibrate_gate` on the recomputed centred cosines; the chosen one's
  center in full is in its vector file."""
  assert run.record['gate'] == 'calibrated'
  cands = run.record['candidates']['spherical_gate']
  assert 'gate' not in run.record['candidates']['addition'][0]
  for c in cands:
    center, _, cal = _gate_of(recomputed, c['layer'], c['direction_method'])
    gate = c['gate']
    pos, neg = recomputed.tokens[c['layer']]
    assert gate['kind'] == 'calibrated'
    assert gate['tokens'] == [len(pos), len(neg)]
    if isinstance(cal, ValueError):
      assert 'error' in gate and not c['kl']
      continue
    assert gate['center_norm'] == pytest.approx(np.linalg.norm(center),
                                                rel=1e-5)
    assert gate['threshold'] == pytest.approx(cal.threshold, abs=1e-5)
    assert gate['kappa'] == pytest.approx(cal.kappa, rel=1e-4)
    assert gate['beta'] == pytest.approx(cal.beta, abs=1e-4)
    assert gate['capped'] == cal.capped
  choice = run.record['choice']['spherical_gate']
  assert choice['gate'] == cands[choice['candidate']]['gate']
  vec = steering_vectors.load(
      os.path.join(run.workdir, 'steering_vector_spherical_gate.npz'))
  center, direction, _ = _gate_of(recomputed, choice['layer'],
                                  choice['direction_method'])
  np.testing.assert_allclose(vec.info['gate']['center'], center,
                             atol=1e-5 * np.linalg.norm(center))
  np.testing.assert_allclose(vec.direction, direction, atol=1e-5)
  assert vec.info['gate']['beta'] == choice['gate']['beta']


def _count(recomputed: Recomputed, choice, windows: np.ndarray):
  """numpy's delta on the windows' tokens at the chosen layer, with the
  recorded gate: (tokens with delta > beta, as a range for deltas within
  1e-4 of beta; the histogram and how many deltas lie within 1e-4 of an
  edge)."""
  center, direction, _ = _gate_of(recomputed, choice['layer'],
                                  choice['direction_method'])
  tokens = windows[:, :-1]
  hidden = _capture(recomputed.subject, choice['layer'], tokens,
                    np.ones(tokens.shape, bool)).reshape(-1, len(center))
  gate = choice['gate']
  delta = -np.tanh(gate['kappa'] * _cos(hidden, direction, center))
  near = lambda v: np.abs(delta - v) < 1e-4
  fired = (int(np.sum((delta > gate['beta']) & ~near(gate['beta']))),
           int(np.sum((delta > gate['beta']) | near(gate['beta']))))
  hist = np.histogram(delta, steering.DELTA_EDGES)[0]
  edges = sum(int(np.sum(near(e))) for e in steering.DELTA_EDGES[1:-1])
  return len(delta), fired, hist, edges


def test_the_trigger_rates_and_histograms_are_numpys(run, recomputed):
  """The gate's trigger rate and delta histogram on the validation
  held-out tokens (selection.json) and on the test ones (the rows: the
  same gate, calibrated on the contrastive set), against numpy's count
  of delta > beta on the captured activations; and gate_<method>.png."""
  choice = run.record['choice']['spherical_gate']
  lm, config = recomputed.subject.lm, run.config
  rows = [r for r in run.rows if r['method'] == 'spherical_gate']
  assert rows and all(r['alpha'] > 0 for r in rows)
  counts = {split: _count(recomputed, choice, lm_data.heldout_windows(
      lm.tokenizer, config.heldout_windows, config.window_len, split))
            for split in ('validation', 'test')}
  for split, rate, hist in (
      ('validation', choice['gate_trigger_rate'], choice['delta_hist']),
      *(('test', r['trigger_rate'], r['delta_hist']) for r in rows)):
    tokens, (lo, hi), want, near = counts[split]
    assert sum(hist) == tokens, split
    assert lo <= round(rate * tokens) <= hi and hi - lo <= 1, (split, rate)
    assert np.abs(np.array(hist) - want).sum() <= 2 * near, (split, hist)
  with open(os.path.join(run.workdir, 'gate_spherical_gate.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  assert not os.path.exists(os.path.join(run.workdir, 'gate_addition.png'))


def test_the_reference_gate_is_the_configs_uncentred(tiny_file):
  """'reference': the gated methods get the config's kappa and beta and
  no center; the ungated ones never take a calibrated gate's."""
  config = _config(tiny_file)
  direction = np.array([1.0, 0.0, 0.0], np.float32)
  ref = selection.Setting(direction, 2.0, selection_gate.reference(config))
  op = selection._operator(config, 'spherical_gate', ref, 0.5)
  assert (op.center, op.kappa, op.beta, op.gate) == (None, 20.0, 0.0, True)
  center = np.array([0.0, 1.0, 0.0], np.float32)
  cal = selection.Setting(direction, 2.0, selection_gate.Gate(
      3.0, 0.25, center, dict(kind='calibrated')))
  op = selection._operator(config, 'addition_gate', cal, 0.5)
  assert (op.kappa, op.beta, op.gate) == (3.0, 0.25, True)
  np.testing.assert_array_equal(op.center, center)
  for method in ('addition', 'spherical', 'addition_renorm'):
    op = selection._operator(config, method, cal, 0.5)
    assert (op.center, op.kappa, op.beta) == (None, 20.0, 0.0)


def _matched_cells(kl, correct, base, targets):
  """(T,) mean over items and sets of the per-item correctness at each
  target KL: numpy's interpolation through (0, base) and the sweep (the
  rows' (A, S, N) `correct`, the unsteered (S, N) `base`), NaN beyond it."""
  x = np.array([0.0, *kl])
  order = np.argsort(x, kind='stable')
  y = np.concatenate([np.asarray(base)[None], np.asarray(correct)])[order]
  out = []
  for t in targets:
    if t > x.max():
      out.append(np.nan)
      continue
    items = [[np.interp(t, x[order], y[:, s, i]) for i in range(y.shape[2])]
             for s in range(y.shape[1])]
    out.append(np.mean([np.mean(s) for s in items]))
  return np.array(out)


def _check_selected_report(run, summary, results, record):
  """The report's settings, gate and trigger rates are selection.json's
  and the rows', its matched-KL means numpy's interpolation of the rows."""
  rows = results['rows']
  for method, entry in summary['selection'].items():
    at = record['choice'][method]
    assert (entry['layer'], entry['direction_method'], entry['alphas']) == (
        at['layer'], at['direction_method'], at['alphas'])
  gated = summary['selection']['spherical_gate']
  assert gated['gate']['kind'] == 'calibrated'
  assert gated['gate']['beta'] == record['choice']['spherical_gate'][
      'gate']['beta']
  test_rate = np.mean([r['trigger_rate'] for r in rows
                       if r['method'] == 'spherical_gate'])
  assert gated['trigger_rate']['test'] == pytest.approx(test_rate)
  assert gated['trigger_rate']['test_in_band'] == bool(
      0.05 <= test_rate <= 0.95)
  assert 'gate' not in summary['selection']['addition']
  base = next(r for r in rows if r['method'] == 'none')
  for task in run.config.tasks:
    key = f'{task}_correct_mean'
    for method, cells in summary['accuracy'][task].items():
      sweep = [r for r in rows if r['method'] == method]
      want = _matched_cells([r['kl'] for r in sweep],
                            [r[key] for r in sweep], base[key], TARGETS)
      got = np.array([c['mean'] for c in cells])
      np.testing.assert_allclose(got, want, atol=1e-9, equal_nan=True)
      for c in cells:
        assert np.isnan(c['mean']) or c['low'] <= c['mean'] <= c['high']
  text = open(os.path.join(run.root, 'study.md')).read()
  assert '**Selected settings**' in text and 'copa: accuracy at matched' in text
  assert f'| spherical_gate | {gated["layer"]} |' in text
  assert '**Reference settings**: not shown (no stored evaluation' in text
  for name in ('pareto_bands.png', f'{selected.NAME}/gate_spherical_gate.png'):
    assert os.path.exists(os.path.join(run.root, name))


def test_selected_settings_end_to_end_reuse_and_report(run, tiny_file,
                                                        tmp_path):
  """`python -m studies.gemma_steering --config=configs/gemma.py:selection`
  (`selected.run`, in process: the `run` fixture) on the two-layer file:
  the report is selection.json's and the rows' (`_check_selected_report`);
  a rerun reuses the evaluation and another selection is refused; the
  reference rows, shown from an evaluation of the same file, are that
  evaluation's. Last in the module: its refused rerun is on the shared
  workdir. The task is copa: the real-text task's pool takes seconds to
  read, and its sizes in the config are checked by the README command's
  refusal (tests/test_gemma_steering_results.py)."""
  assert dict(gemma_config.get_config('selection').tasks) == dict(
      copa=40, cloze=40, pydoc_polarity=40)
  summary, out = run.summary, run.workdir
  with open(os.path.join(out, 'results.json')) as f:
    results = json.load(f)
  with open(os.path.join(out, selection.FILENAME)) as f:
    record = json.load(f)
  _check_selected_report(run, summary, results, record)

  # A rerun reuses the evaluation; another selection is refused.
  config = _config(tiny_file)
  mtime = os.path.getmtime(os.path.join(out, 'results.json'))
  assert selected.run(config, run.root, TARGETS, 200,
                      reference=run.no_reference) == summary
  assert os.path.getmtime(os.path.join(out, 'results.json')) == mtime
  config.selection.items_per_set = 1
  with pytest.raises(UsageError, match='another config.*selection'):
    selected.run(config, run.root, TARGETS, 200, reference=run.no_reference)

  # The reference rows: here an evaluation of the same file at block 1.
  ref_dir = str(tmp_path / 'reference')
  os.mkdir(ref_dir)
  shutil.copy(os.path.join(out, 'results.json'),
              os.path.join(ref_dir, 'layer1_results.json'))
  ref = selected.reference_run(ref_dir, 1, '0' * 64)
  assert ref[0] is None and 'another model file' in ref[1]
  ref = selected.reference_run(ref_dir, 1, results['meta']['gguf_sha256'])
  again, text = selected.summarize(results, record, TARGETS, 200, ref)
  for task, by_method in again['reference']['accuracy'].items():
    assert by_method == summary['accuracy'][task]
  assert '| addition, reference |' in text
