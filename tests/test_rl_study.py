"""studies.rl_staleness and studies.gas: the READMEs' commands at runlocal
size (slow), their tables rebuilt from the stored results; the runs the
study configures and its tables from known results (in-process); and bad
flags and a held workdir refused in one line before anything is trained
(subprocesses: the studies' absl flags share names)."""

import json
import os
import shutil

import numpy as np
import pytest

from studies.rl_staleness import report
from studies.rl_staleness import runs
from tests import launch_runs

_SMALL = ('--runlocal', '--seeds=1', '--num_versions=2')


def _study(module, workdir, *flags, timeout=120):
  return launch_runs.run_module(module, f'--workdir={workdir}', *flags,
                                timeout=timeout)


def _stored(workdir):
  with open(os.path.join(workdir, 'study.json')) as f:
    raw = json.load(f)
  with open(os.path.join(workdir, 'study.md')) as f:
    return raw, f.read()


def _files(root):
  """{path: modification time} of every file below `root` but the lock
  (which reading a finished run takes)."""
  return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, files in os.walk(root) for f in files if f != '.lock'}


# Slow (`make test-all`): a warm start and 5 RL runs through both rooms'
# launchers. The default suite's cover is the test below (every run the
# study configures, in order, and its tables and plot from known results)
# and test_bad_flags_are_one_line_before_any_work (the launchers' checks).
@pytest.mark.slow
def test_the_readme_commands_run_at_runlocal_size(tmp_path):
  # The GAS room's command, then the staleness room's stress command in a
  # workdir of its own with the warm start copied in (the README's runs
  # linked it; a workdir now refuses a link that leaves it).
  workdir = str(tmp_path / 'study')
  result = _study('studies.gas', workdir, '--bounds=1',
                  '--corrections=decoupled', '--gas=full', '--gas_bound=2',
                  *_SMALL, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  raw, text = _stored(workdir)
  assert sorted(raw) == ['GAS full, s_base=2|0', 'async s=1, decoupled|0',
                         'sync|0']
  study = runs.Study(workdir, seeds=1, bounds=(1,),
                     corrections=('decoupled',), gas=('full',), gas_bound=2,
                     num_versions=2, runlocal=True)
  # The stored results are the study's record: the tables rebuild from them.
  assert report.table(study, raw) + '\n' == text
  assert '| GAS full, s_base=2 |' in text and 'alpha' in text
  assert os.path.getsize(os.path.join(workdir, 'study.png')) > 1000

  stress = tmp_path / 'stress'
  stress.mkdir()
  shutil.copytree(os.path.join(workdir, 'sft_0'), stress / 'sft_0')
  before = _files(stress / 'sft_0')
  overrides = ('optimizer.learning_rate=1e-4', 'runtime.deterministic=True')
  result = _study('studies.rl_staleness', stress, '--bounds=2',
                  '--corrections=none', '--set=' + ','.join(overrides),
                  *_SMALL, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  raw, text = _stored(stress)
  assert sorted(raw) == ['async s=2, none|0', 'sync|0']
  study = runs.Study(str(stress), seeds=1, bounds=(2,),
                     corrections=('none',), num_versions=2,
                     overrides=overrides, runlocal=True)
  assert report.table(study, raw) + '\n' == text
  assert 'alpha' not in text
  # The copied warm start was read, not trained again.
  assert _files(stress / 'sft_0') == before
  config, _ = runs.rl_config(study, 0, 2, 'none')
  assert config.optimizer.learning_rate == 1e-4
  assert config.runtime.deterministic is True


# Each of these started training a warm start (or, --seeds=0, exited 0 with
# empty tables).
@pytest.mark.parametrize('module, flag, expected', [
    ('studies.rl_staleness', '--bounds=1,-1',
     "error: --bounds='-1': must be an integer >= 1"),
    ('studies.rl_staleness', '--corrections=tis,foo',
     "error: --corrections='foo': unknown; valid choices: 'none', 'tis', "
     "'decoupled'"),
    ('studies.rl_staleness', '--seeds=0',
     'error: --seeds=0: must be an integer >= 1'),
    # Through the runs' own config check, as the study builds them.
    ('studies.rl_staleness', '--set=optimizer.learning_rate=1e999',
     'error: config.optimizer.learning_rate=inf: must be finite and > 0'),
    ('studies.gas', '--gas=full,foo',
     "error: --gas='foo': unknown GAS variant; valid choices: 'full'"),
    ('studies.gas', '--gas_bound=0',
     'error: --gas_bound=0: must be an integer >= 1'),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, module, flag,
                                                expected):
  result = _study(module, tmp_path / 'study', flag)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
  assert not os.path.exists(tmp_path / 'study')


def test_a_held_workdir_is_one_line_and_exit_75(tmp_path):
  # It was a WorkdirBusy traceback, exit 1.
  workdir = tmp_path / 'study'
  workdir.mkdir()
  result = launch_runs.run_while_held(
      str(workdir), lambda: _study('studies.rl_staleness', workdir,
                                   '--seeds=1'))
  assert result.returncode == 75, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and 'in use by another run' in lines[0], (
      result.stderr)
  assert sorted(os.listdir(workdir)) == ['.lock']


def _known_results(index: int, seed: int, gas: bool) -> dict:
  """Results of run `index` (in `runs.runs` order) of `seed`, as
  train.rl's tally writes them (the fields the report reads): numbers
  chosen to differ across runs and seeds."""
  pass_at_1 = {'1': 0.3 + 0.1 * index + 0.05 * seed, '2': 0.1 * seed}
  out = {
      'pass_at_1': pass_at_1,
      'mean_pass_at_1': sum(pass_at_1.values()) / 2,
      'initial_pass_at_1': {'1': 0.2 + 0.1 * seed, '2': 0.05},
      'samples_per_second': 10.0 * (index + 1) + seed,
      'wall_seconds': 100.0 + 10 * index + seed,
      'versions': 5, 'samples': 80,
      'difficulty_mix': {'1': 3, '2': 2},
      'staleness_by_difficulty': {'1': {'0': 2, '1': 1}, '2': {'2': 2}},
      'dropped': {'1': seed, '2': 0},
      'curve': [{'version': v, 'wall': 10.0 * v + seed,
                 'eval/pass_at_1': 0.1 * v, 'eval/pass_at_1_d1': 0.15 * v,
                 'eval/pass_at_1_d2': 0.05 * v} for v in range(6)]}
  if gas:
    out['gas'] = {'deferred/d1': 1, 'deferred/d2': 2, 'alpha': 0.5 + 0.2 * seed,
                  'budget/d1': 2, 'budget/d2': 1 + seed}
  return out


def _cells(text: str, label: str) -> list[list[str]]:
  """The cells of every markdown row whose first cell is `label`."""
  return [[c.strip() for c in line.strip('|').split('|')[1:]]
          for line in text.splitlines()
          if line.startswith('|') and line.strip('|').split('|')[0].strip()
          == label]


def _mean_std(values) -> str:
  return f'{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f}'


def test_the_study_runs_its_configs_in_order_and_tabulates_them(
    tmp_path, monkeypatch):
  """`runs.measure` of a study with GAS, 2 seeds, 2 bounds x 2 corrections
  and a --set override, its training calls recorded instead of run (the
  runs' own tests train them), then `report.table` and `report.plot` of
  known results, checked against numpy: the default suite's cover of the
  README commands' test (slow)."""
  study = runs.Study(str(tmp_path), seeds=2, bounds=(1, 4),
                     corrections=('none', 'tis'), gas=('full',), gas_bound=2,
                     num_versions=5, overrides=('optimizer.learning_rate=1e-4',),
                     runlocal=True)
  warm, trained = [], []
  monkeypatch.setattr(runs.sft, 'train_and_evaluate', lambda config, w: (
      warm.append((config.seed, config.num_steps, w)) or {}))
  labels = [label for label, *_ in runs.runs(study)]

  def train(config, workdir):
    trained.append((config, workdir))
    index = (len(trained) - 1) % len(labels)
    return _known_results(index, config.seed, config.scheduler == 'gas')

  monkeypatch.setattr(runs.run, 'train_and_evaluate', train)
  raw = runs.measure(study)
  assert labels == ['sync', 'async s=1, none', 'async s=1, tis',
                    'async s=4, none', 'async s=4, tis', 'GAS full, s_base=2']
  assert sorted(raw) == sorted(f'{l}|{s}' for l in labels for s in (0, 1))
  runlocal_steps = runs.rl_sft.get_config('runlocal').num_steps
  assert warm == [(s, runlocal_steps, str(tmp_path / f'sft_{s}'))
                  for s in (0, 1)]
  expected = [(0, 'decoupled', 'fixed'), (1, 'none', 'fixed'),
              (1, 'tis', 'fixed'), (4, 'none', 'fixed'), (4, 'tis', 'fixed'),
              (2, 'decoupled', 'gas')]
  assert len(trained) == 2 * len(labels)
  for i, (config, workdir) in enumerate(trained):
    seed = i // len(labels)
    assert (config.runtime.max_staleness, config.grpo.correction,
            config.scheduler) == expected[i % len(labels)], i
    assert config.seed == seed and config.num_versions == 5
    assert config.sft_workdir == str(tmp_path / f'sft_{seed}')
    assert config.optimizer.learning_rate == 1e-4
    assert config.prompts_per_batch == runs.rl.get_config(
        'runlocal').prompts_per_batch  # Runlocal size.
    assert os.path.dirname(workdir) == str(tmp_path)
  assert len({w for _, w in trained}) == len(trained)

  text = report.table(study, raw)
  (warm_row,) = _cells(text, 'warm start')
  assert warm_row[:3] == [_mean_std([20, 30]), _mean_std([5, 5]), '15.0']
  for index, label in enumerate(labels):
    row = _cells(text, label)[0]
    seeds = [_known_results(index, s, False) for s in (0, 1)]
    assert row == [
        _mean_std([100 * r['pass_at_1']['1'] for r in seeds]),
        _mean_std([100 * r['pass_at_1']['2'] for r in seeds]),
        _mean_std([100 * r['mean_pass_at_1'] for r in seeds]),
        _mean_std([r['samples_per_second'] for r in seeds]),
        _mean_std([(10.0 * (index + 1) + s) / (10.0 + s) for s in (0, 1)]),
        _mean_std([r['wall_seconds'] for r in seeds])], label
    # The schedule table: mix, mean staleness per difficulty, dropped,
    # then GAS's deferred, alpha and budgets (means over seeds).
    gas = ['3', _mean_std([0.5, 0.7]), '2.0/1.5'] if 'GAS' in label else [
        '-', '-', '-']
    assert _cells(text, label)[1] == ['60', '40', '0.33', '2.00', '0.5',
                                      *gas], label
  report.plot(study, raw, str(tmp_path / 'study.png'))
  assert os.path.getsize(tmp_path / 'study.png') > 1000
