"""studies.steering end to end in its small mode: LMs trained through
launch.train, one evaluation per LM over several item sets and per gate
threshold, finished work reused, another config refused, one-line flag
errors (subprocesses: launchers' flags share names)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests import launch_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ('--lm_config_arg=runlocal', '--steering_config_arg=runlocal',
         '--lm_seeds=0', '--item_seeds=7,8', '--gate_betas=-0.5',
         '--bootstrap_samples=200', '--targets=0.02,0.1')


def _study(workdir, *flags, timeout=600):
  return subprocess.run(
      [sys.executable, '-m', 'studies.steering', f'--workdir={workdir}',
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_study_evaluates_aggregates_and_reuses_finished_work(
    tmp_path, lm_runlocal_run):
  # The study's LM (configs/lm.py:runlocal, seed 0) is the session's: the
  # study still runs launch.train on it, which finds the run finished.
  # Training itself is test_lm_jobs' and test_trainer's.
  shutil.copytree(lm_runlocal_run[0], tmp_path / 'lm_seed0')
  result = _study(tmp_path, *SMALL)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((tmp_path / 'lm_seed0' / 'final_metrics.json'
                     ).read_text()) == lm_runlocal_run[1]
  assert (tmp_path / 'lm_seed0' / 'metrics.jsonl').read_bytes() == open(
      os.path.join(lm_runlocal_run[0], 'metrics.jsonl'), 'rb').read()
  for name in ('study.md', 'study.json', 'pareto_bands.png',
               'lm_seed0/final_metrics.json', 'eval_lm0/results.json',
               'eval_lm0_beta-0.5/results.json'):
    assert os.path.getsize(tmp_path / name) > 0, name
  summary = json.loads((tmp_path / 'study.json').read_text())
  assert summary['lms'] == 1 and summary['item_sets'] == [7, 8]
  assert summary['targets'] == [0.02, 0.1]
  # The evaluation ran on the study's item sets, and the extra threshold's
  # only the gated rotation.
  ev = json.loads((tmp_path / 'eval_lm0' / 'results.json').read_text())
  beta = json.loads((tmp_path / 'eval_lm0_beta-0.5' / 'results.json'
                     ).read_text())
  assert ev['meta']['mc_seeds'] == [7, 8] and ev['meta']['beta'] == 0.0
  assert {r['method'] for r in beta['rows']} == {'none', 'spherical_gate'}
  assert beta['meta']['beta'] == -0.5
  assert [g['beta'] for g in summary['gate']] == [-0.5, 0.0]
  # The unsteered accuracy is the mean of both item sets' correctness.
  none = [r for r in ev['rows'] if r['method'] == 'none'][0]
  flat = [c for s in none['cloze_correct_mean'] for c in s]
  assert summary['unsteered']['cloze']['mean'] == pytest.approx(
      sum(flat) / len(flat))
  assert set(summary['ablation']['cloze']) == {'gate', 'rotation',
                                                'interaction'}
  table = (tmp_path / 'study.md').read_text()
  assert '**cloze: accuracy at matched KL**' in table
  assert '| spherical_gate - addition |' in table
  # A rerun trains and evaluates nothing, and finished evaluations need
  # no LM: without its checkpoints the study reuses them untouched and
  # rebuilds its report. (A rerun with the LM in place finds its run
  # finished, as the first run did.)
  stamp = os.path.getmtime(tmp_path / 'eval_lm0' / 'results.json')
  os.rename(tmp_path / 'lm_seed0', tmp_path / 'lm_moved')
  os.remove(tmp_path / 'study.md')
  bare = _study(tmp_path, *SMALL)
  assert bare.returncode == 0, bare.stderr[-3000:]
  assert os.path.getmtime(tmp_path / 'eval_lm0' / 'results.json') == stamp
  assert 'reusing the finished evaluation' in bare.stderr
  assert not os.path.exists(tmp_path / 'lm_seed0')
  assert (tmp_path / 'study.md').read_text() == table
  # Another evaluation config in the same workdir is refused in one line.
  other = _study(tmp_path, *SMALL[:-1], '--item_seeds=7,9',
                 '--targets=0.02,0.1')
  assert other.returncode == 2, other.stderr[-3000:]
  lines = [l for l in other.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and 'eval_lm0/ holds an evaluation with another ' \
      'config (mc_seeds)' in lines[0], other.stderr[-2000:]


_BAD_FLAGS = [
    (['--lm_seeds=0,x'], "error: --lm_seeds='x': not a number"),
    (['--item_seeds=7,7'], "error: --item_seeds='7,7': has a repeated value"),
    (['--targets=0.2,0.1'], "error: --targets='0.2,0.1': give increasing"),
    (['--gate_betas=1.0'], "error: --gate_betas='1.0': a gate threshold is "
     'in [-1, 1)'),
    (['--lm_config_arg=tokenizer=wordpiece'],
     "error: --lm_config_arg='tokenizer=wordpiece': tokenizer='wordpiece'; "
     'valid: byte, sentencepiece'),
]


@pytest.fixture(scope='module')
def bad_flag_runs(tmp_path_factory):
  """{flags: (the study's result with them, its workdir)}: each run its
  own process, forked from one that imported the study once
  (launch_runs.run_module_each; a process's imports cost more CPU than the
  check)."""
  flag_lists = [flags for flags, _ in _BAD_FLAGS]
  return dict(zip(map(tuple, flag_lists), launch_runs.run_study_each(
      tmp_path_factory, 'studies.steering', flag_lists)))


@pytest.mark.parametrize('flags, start', _BAD_FLAGS)
def test_a_bad_flag_is_one_line_before_any_run(bad_flag_runs, flags, start):
  result, workdir = bad_flag_runs[tuple(flags)]
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(start), result.stderr
  assert not os.path.exists(workdir)
