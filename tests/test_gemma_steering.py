"""The steering study on Gemma 3 270M (studies.gemma_steering.layers).

The study is run end to end at `runlocal` size, reused, and refused on
another config or file: on the tests' two-layer Gemma 3 files, and on the
real 270M one `slow`. The evaluation it runs is the in-project study's
(tests/test_steering_evaluation.py checks its scorers on both models).
The study at selected settings (`selected.run`) is checked in
tests/test_steering_selection.py, around the selection that file runs.
"""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from configs import gemma as gemma_config
from studies.gemma_steering import layers as gemma_study
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
