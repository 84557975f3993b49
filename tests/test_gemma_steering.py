"""The steering study on Gemma 3 270M (studies.gemma_steering.layers).

The study is run end to end at `runlocal` size, reused, and refused on
another config or file: on the tests' two-layer Gemma 3 files, and on the
real 270M one `slow`. The evaluation it runs is the in-project study's
(tests/test_steering_evaluation.py checks its scorers on both models).
"""

import json
import os
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from configs import gemma as gemma_config
from studies.gemma_steering import layers as gemma_study
from studies.gemma_steering import selected
from train.errors import ConfigError
from train.errors import UsageError
from train.lm import gemma_gguf
from train.steering import generations

from tests import tiny_gemma

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def gemma_file(tmp_path_factory):
  return gemma_gguf.registry_file(str(tmp_path_factory.mktemp('gemma')))


def test_until_eos_and_the_lexicon_judge():
  rows = np.array([[5, 6, 1, 7, 1], [5, 6, 7, 8, 9], [1, 4, 4, 4, 4]])
  np.testing.assert_array_equal(generations.until_eos(rows, 1), [
      [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
  pos, neg, neutral = generations.vader_scores(
      ['What a wonderful, lovely day.', 'I hate this awful place.',
       'The train leaves at nine.'])
  assert pos > 0.5 and neg < -0.5 and neutral == 0.0


def _config(gemma_file, **overrides) -> ml_collections.ConfigDict:
  config = gemma_config.get_config('runlocal')
  config.gguf = gemma_file
  # One steered method (addition moves block 6; the gate leaves it alone,
  # see RESULTS.md) and no sweep: the sweep's plan is tested without a run,
  # and every extra method or layer is a compile.
  config.methods = ('none', 'addition')
  config.alphas = (0.3,)
  config.sweep_layers = ()
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('tiny') / 'g.gguf')


@pytest.fixture(params=['tiny', pytest.param('270m', marks=pytest.mark.slow)])
def study_model(request):
  """(file, config overrides): the tests' two-layer Gemma 3 file (its own
  shape, steered at block 1), or the registry's 270M (block 6, slow: the
  mechanics are the same, the agreement tests above use the real file)."""
  if request.param == 'tiny':
    return request.getfixturevalue('tiny_file'), dict(shape='gguf', layer=1)
  return request.getfixturevalue('gemma_file'), {}


@pytest.mark.parametrize('field, value, needle', [
    ('layer', 18, 'blocks 0..17'),
    ('window_len', 4, 'window_len'),
    ('gguf', '/nonexistent.gguf', 'no such file'),
    ('alphas', (0.5, 2.0), 'outside [0, 1]'),
    ('methods', ('none', 'rotate'), "unknown method 'rotate'"),
    ('shape', 'gguf', "own shape needs --config.gguf"),
    ('shape', '2b', "not a Gemma 3 shape"),
])
def test_bad_config_is_refused_before_loading(tmp_path, field, value, needle):
  config = gemma_config.get_config('runlocal')
  config[field] = value
  with pytest.raises(ConfigError, match=None) as e:
    gemma_study.run(config, str(tmp_path / 'w'), [0.1])
  assert needle in str(e.value) and field.split('.')[0] in str(e.value)
  assert not os.path.exists(tmp_path / 'w' / 'layer6')


def test_a_files_own_shape_bounds_the_layer(tiny_file, tmp_path):
  # The two-layer file has blocks 0..1: block 6 is refused before loading.
  config = _config(tiny_file, shape='gguf')
  with pytest.raises(ConfigError, match=r'blocks 0\.\.1'):
    gemma_study.run(config, str(tmp_path / 'w'), [0.1])
  assert not os.path.exists(tmp_path / 'w' / 'layer6')


def test_sweep_plan():
  config = gemma_config.get_config()
  steps = gemma_study.plan(config)
  assert [n for n, _ in steps] == ['layer6', 'layer3', 'layer12']
  for _, c in steps[1:]:
    assert tuple(c.methods) == tuple(config.sweep_methods)
    assert not c.generation.enabled
    assert dict(c.tasks) == {t: config.sweep_items for t in config.tasks}
  assert steps[0][1] is config


def test_study_end_to_end_reuse_and_refusal(study_model, tmp_path):
  gemma_file, overrides = study_model
  workdir = str(tmp_path / 'study')
  config = _config(gemma_file, **overrides)
  layer = f'layer{config.layer}'
  # The first run is studies/gemma_steering/README.md's command, with
  # `_config`'s settings as flags; the reruns below call the study itself.
  flags = [f'--config.gguf={gemma_file}',
           "--config.methods=('none','addition')", '--config.alphas=(0.3,)',
           '--config.sweep_layers=()',
           *(f'--config.{k}={v}' for k, v in overrides.items())]
  result = subprocess.run(
      [sys.executable, '-m', 'studies.gemma_steering',
       '--config=configs/gemma.py:runlocal', *flags, f'--workdir={workdir}',
       '--targets=0.05,0.2', '--bootstrap_samples=200'],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(workdir, 'study.json')) as f:
    stored = f.read()
  summary = json.loads(stored)
  with open(os.path.join(workdir, layer, 'results.json')) as f:
    results = json.load(f)
  rows = results['rows']
  assert [(r['method'], r['alpha']) for r in rows] == [
      ('none', 0.0), ('addition', 0.3)]
  assert results['meta']['gguf_sha256'] == gemma_gguf.file_sha256(gemma_file)
  none, add = rows[0], rows[1]
  assert none['kl'] == pytest.approx(0.0, abs=1e-6)
  assert add['kl'] > 0.01
  assert [len(s) for s in add['cloze_correct_mean']] == [4, 4]
  for r in rows:
    assert 0.0 <= r['positive_share'] <= 1.0 and np.isfinite(r['gen_ce'])
  assert set(summary['accuracy']) == {'copa', 'cloze'}
  assert summary['targets'] == [0.05, 0.2]
  text = open(os.path.join(workdir, 'study.md')).read()
  assert 'accuracy at matched KL' in text and 'addition' in text
  assert os.path.exists(os.path.join(workdir, 'pareto_bands.png'))

  # A rerun reuses the evaluation: it does not load the model again.
  mtime = os.path.getmtime(os.path.join(workdir, layer, 'results.json'))
  again = gemma_study.run(config, workdir, [0.05, 0.2], num_samples=200)
  assert again['accuracy'].keys() == summary['accuracy'].keys()
  with open(os.path.join(workdir, 'study.json')) as f:
    assert f.read() == stored
  assert os.path.getmtime(os.path.join(workdir, layer,
                                       'results.json')) == mtime

  # The sweep's settings are not the main evaluation's: still reused.
  gemma_study.run(_config(gemma_file, sweep_items=3, **overrides), workdir,
                  [0.05], num_samples=100)
  assert os.path.getmtime(os.path.join(workdir, layer,
                                       'results.json')) == mtime
  with pytest.raises(UsageError, match='another config.*kappa'):
    gemma_study.run(_config(gemma_file, kappa=5.0, **overrides), workdir,
                    [0.05])
  # The report of a sweep, on the finished evaluation as its one layer.
  layers = gemma_study.layer_sweep({layer: results}, [0.05, 0.2], 200)
  assert [(e['layer'], e['method']) for e in layers] == [
      (config.layer, 'addition')]
  assert layers[0]['kl_max'] == pytest.approx(add['kl'])
  assert 'Layer sweep' in gemma_study.layer_markdown(layers, [0.05, 0.2])
  results['meta']['gguf_sha256'] = '0' * 64
  with open(os.path.join(workdir, layer, 'results.json'), 'w') as f:
    json.dump(results, f)
  with pytest.raises(UsageError, match='another model file'):
    gemma_study.run(config, workdir, [0.05])


def _matched(kl, correct, base, targets):
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


def _selected_config(tiny_file):
  """configs/gemma.py:runlocal,selection on the two-layer file: block 1
  (choosing among blocks is test_steering_selection.py's), two direction
  methods, one ungated and one gated method, one task and no generations
  (each block, task and generation is a compile). The task is copa: the
  real-text task's pool takes seconds to read, and its sizes in the
  config are checked by the README command's refusal
  (tests/test_gemma_steering_results.py)."""
  config = gemma_config.get_config('runlocal,selection')
  assert dict(gemma_config.get_config('selection').tasks) == dict(
      copa=40, cloze=40, pydoc_polarity=40)
  config.update(dict(gguf=str(tiny_file), shape='gguf', layer=1,
                     sweep_layers=(),
                     methods=('none', 'addition', 'spherical_gate'),
                     alphas=(0.3, 1.0), heldout_windows=2))
  config.tasks = dict(copa=2)
  config.generation.enabled = False
  config.selection.update(dict(layers=(1,), items_per_set=2,
                               direction_methods=('mean_diff', 'pca_center'),
                               targets=(0.01, 0.05)))
  return config


def test_selected_settings_end_to_end_reuse_and_report(tiny_file, tmp_path):
  """`python -m studies.gemma_steering --config=configs/gemma.py:selection`
  (`selected.run`, in process) on the two-layer file: the report's
  settings, gate and trigger rates are selection.json's and the rows',
  its matched-KL means numpy's interpolation of the rows; a rerun reuses
  the evaluation; the reference rows, shown from an evaluation of the same
  file, are that evaluation's."""
  config = _selected_config(tiny_file)
  workdir, targets = str(tmp_path / 'study'), [0.01, 0.05]
  no_ref = str(tmp_path / 'no_reference')
  summary = selected.run(config, workdir, targets, 200, reference=no_ref)
  out = os.path.join(workdir, selected.NAME)
  with open(os.path.join(out, 'results.json')) as f:
    results = json.load(f)
  with open(os.path.join(out, 'selection.json')) as f:
    record = json.load(f)
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
  for task in config.tasks:
    key = f'{task}_correct_mean'
    for method, cells in summary['accuracy'][task].items():
      sweep = [r for r in rows if r['method'] == method]
      want = _matched([r['kl'] for r in sweep], [r[key] for r in sweep],
                      base[key], targets)
      got = np.array([c['mean'] for c in cells])
      np.testing.assert_allclose(got, want, atol=1e-9, equal_nan=True)
      for c in cells:
        assert np.isnan(c['mean']) or c['low'] <= c['mean'] <= c['high']
  text = open(os.path.join(workdir, 'study.md')).read()
  assert '**Selected settings**' in text and 'copa: accuracy at matched' in text
  assert f'| spherical_gate | {gated["layer"]} |' in text
  assert '**Reference settings**: not shown (no stored evaluation' in text
  for name in ('pareto_bands.png', f'{selected.NAME}/gate_spherical_gate.png'):
    assert os.path.exists(os.path.join(workdir, name))

  # A rerun reuses the evaluation; another selection is refused.
  mtime = os.path.getmtime(os.path.join(out, 'results.json'))
  assert selected.run(config, workdir, targets, 200,
                      reference=no_ref) == summary
  assert os.path.getmtime(os.path.join(out, 'results.json')) == mtime
  config.selection.items_per_set = 1
  with pytest.raises(UsageError, match='another config.*selection'):
    selected.run(config, workdir, targets, 200, reference=no_ref)

  # The reference rows: here an evaluation of the same file at block 1.
  os.mkdir(no_ref)
  shutil.copy(os.path.join(out, 'results.json'),
              os.path.join(no_ref, 'layer1_results.json'))
  ref = selected.reference_run(no_ref, 1, '0' * 64)
  assert ref[0] is None and 'another model file' in ref[1]
  ref = selected.reference_run(no_ref, 1, results['meta']['gguf_sha256'])
  again, text = selected.summarize(results, record, targets, 200, ref)
  for task, by_method in again['reference']['accuracy'].items():
    assert by_method == summary['accuracy'][task]
  assert '| addition, reference |' in text
