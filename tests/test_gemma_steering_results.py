"""The Gemma steering study's stored evaluations rebuild its reports byte for byte.

From the evaluations stored in studies/gemma_steering/results/ (each
layer's results.json; the gate ablation's in gate_ablation/), with the
study's default targets and bootstrap replicates: study.md (and the gate
ablation's study.json, and its evaluation's own results.md) must equal
the stored files. Report code only: no model is loaded. And the selected
settings' run (results/selected/): its kept records are what the README's
command records (a fresh workdir goes on from them), and its study.md,
study.json and gate plots rebuild from its results.json and selection.json.
"""

import json
import os
import subprocess
import sys

import pytest

from configs import gemma as gemma_config
from studies.gemma_steering import layers
from studies.gemma_steering import selected
from train.lm import gemma_gguf
from train.run import metrics
from train.steering import evaluation
from train.steering import selection
from train.steering import selection_gate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'studies', 'gemma_steering', 'results')
# The flags' defaults (`python -m studies.gemma_steering`), as stored.
TARGETS = (0.05, 0.1, 0.2, 0.33, 0.5)
SAMPLES = 2000


def _read(*path: str) -> str:
  with open(os.path.join(RESULTS, *path)) as f:
    return f.read()


def _runs(folder: str, layer_numbers) -> dict[str, dict]:
  return {f'layer{l}': json.loads(_read(folder, f'layer{l}_results.json'))
          for l in layer_numbers}


def test_the_study_rebuilds_from_its_layers():
  runs = _runs('', (6, 3, 12))
  _, text = layers.summarize(runs, 'layer6', TARGETS, SAMPLES)
  assert text == _read('study.md')


def test_the_gate_ablation_rebuilds_from_its_evaluation():
  runs = _runs('gate_ablation', (6,))
  summary, text = layers.summarize(runs, 'layer6', TARGETS, SAMPLES)
  assert text == _read('gate_ablation', 'study.md')
  assert (metrics.dumps(summary, indent=2, sort_keys=True) + '\n'
          == _read('gate_ablation', 'study.json'))
  run = runs['layer6']
  assert (evaluation.markdown_table(run['rows'], list(run['meta']['tasks']))
          == _read('gate_ablation', 'layer6_results.md'))


def test_the_stored_selection_records_are_the_selection_configs():
  # `python -m studies.gemma_steering --config=configs/gemma.py:selection`
  # refuses a record of another identity (train.steering.selection.Kept):
  # each stored one must carry that config and the registry's file.
  want = json.loads(gemma_config.get_config('selection').to_json())
  model = 'gguf-sha256:' + gemma_gguf.file_sha256(gemma_gguf.registry_file())
  # The kept records (selection_sweeps/, test_rows/); selection.json is the
  # selection's output, not a kept record.
  folder = os.path.join(RESULTS, 'selected')
  paths = [os.path.join(folder, kind, name)
           for kind in ('selection_sweeps', 'test_rows')
           if os.path.isdir(os.path.join(folder, kind))
           for name in os.listdir(os.path.join(folder, kind))]
  assert os.path.join(folder, 'selection_sweeps', 'unsteered.json') in paths
  tokenizers = set()
  for path in paths:
    with open(path) as f:
      identity = json.load(f)['identity']
    assert identity['config'] == want, path
    assert identity['model'] == model, path
    tokenizers.add(identity['tokenizer'])
  assert len(tokenizers) == 1


def test_the_selected_study_rebuilds_from_its_evaluation(tmp_path):
  # `python -m studies.gemma_steering --config=configs/gemma.py:selection`
  # at its end: study.md and study.json from the test rows (results.json),
  # the selection (selection.json) and the reference settings' block-6
  # evaluation; and each gated method's gate plot from the rows.
  results = json.loads(_read('selected', 'results.json'))
  record = json.loads(_read('selected', selection.FILENAME))
  reference = selected.reference_run(
      RESULTS, results['meta']['config']['layer'],
      results['meta']['gguf_sha256'])
  assert reference[0] is not None, reference[1]
  summary, text = selected.summarize(results, record, TARGETS, SAMPLES,
                                     reference)
  assert text == _read('selected', 'study.md')
  assert (metrics.dumps(summary, indent=2, sort_keys=True) + '\n'
          == _read('selected', 'study.json'))
  gated = [m for m in record['choice'] if m in selection_gate.GATED_METHODS]
  assert gated
  for method in gated:
    selection.plot_gate(str(tmp_path), method, record['choice'][method],
                        results['rows'])
    name = f'gate_{method}.png'
    with open(os.path.join(RESULTS, 'selected', name), 'rb') as f:
      assert (tmp_path / name).read_bytes() == f.read(), name


@pytest.mark.parametrize('config, flag, error', [
    ('configs/gemma.py', '--targets=0.2,0.1',
     'targets=(0.2, 0.1): give increasing KL values > 0'),
    # The selected settings: the selection's own checks, on its config's
    # real-text task (2 validation sets of 40 fit its pool, of 60 do not).
    # Slow: 15 s of a process building the real-text pool; the same check
    # on the same config in process: test_pydoc_polarity's
    # test_the_selected_study_refuses_more_items_than_the_pool_holds.
    pytest.param(
        'configs/gemma.py:selection', '--config.selection.items_per_set=60',
        'config.selection.items_per_set=60: 2 validation item set(s) of '
        'pydoc_polarity hold at most 59 items each',
        marks=pytest.mark.slow),
])
def test_the_readme_command_refuses_a_bad_flag_in_one_line(
    tmp_path, config, flag, error):
  # The README's commands themselves (their end-to-end runs are
  # test_gemma_steering.py's, in process): flags parsed, the study's own
  # checks reached before any model is loaded.
  result = subprocess.run(
      [sys.executable, '-m', 'studies.gemma_steering', f'--config={config}',
       f'--workdir={tmp_path / "w"}', flag], cwd=ROOT, capture_output=True,
      text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0] == f'error: {error}', result.stderr
  assert not os.path.exists(tmp_path / 'w')
