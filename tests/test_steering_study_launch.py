"""studies.steering end to end in its small mode (slow): LMs trained
through launch.train, one evaluation per LM over several item sets and per
gate threshold, finished work reused, another config refused; and the
steering evaluation job's outputs, read from the study's evaluation. In
the default suite: the study's evaluations (per gate threshold) reused
from their stored results and another config refused (lm_runs, on the
stored evaluations of studies/steering/results/), and its one-line flag
errors (subprocesses: launchers' flags share names)."""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from configs import steering as steering_config
from studies.steering import lm_runs
from tests import launch_runs
from train.errors import UsageError
from train.lm import trainer as lm_trainer
from train.steering import evaluation as steering_eval
from train.steering import vectors as steering_vectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ('--lm_config_arg=runlocal', '--steering_config_arg=runlocal',
         '--lm_seeds=0', '--item_seeds=7,8', '--gate_betas=-0.5',
         '--bootstrap_samples=200', '--targets=0.02,0.1')


def _study(workdir, *flags, timeout=600):
  return subprocess.run(
      [sys.executable, '-m', 'studies.steering', f'--workdir={workdir}',
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope='module')
def study(tmp_path_factory, lm_runlocal_run):
  """(workdir, result) of the study run once for this file's two tests:
  the study's own, and the evaluation's (its eval_lm0/, an evaluation of
  configs/steering.py:runlocal over two item sets, read instead of running
  another in-process: the evaluations' compiles are most of their cost).

  The study's LM (configs/lm.py:runlocal, seed 0) is the session's: the
  study still runs launch.train on it, which finds the run finished.
  Training itself is test_lm_jobs' and test_trainer's.
  """
  root = tmp_path_factory.mktemp('study')
  shutil.copytree(lm_runlocal_run[0], root / 'lm_seed0')
  return root, _study(root, *SMALL)


# Slow (the study's subprocesses: an evaluation over two item sets, one per
# gate threshold, the bootstrap report, two reruns; 55 s). Covered in the
# default suite by test_finished_evaluations_are_reused_and_another_config_
# refused below (lm_runs' reuse and refusal), test_steering_results.py (the
# study's report rebuilt from finished evaluations with no LM) and
# test_steering_evaluation.py::test_one_evaluation_runs_both_models
# (an evaluation of the runlocal LM).
@pytest.mark.slow
def test_study_evaluates_aggregates_and_reuses_finished_work(
    study, lm_runlocal_run):
  tmp_path, result = study
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


def _study_rows(study):
  """The study's main evaluation (eval_lm0/) and its rows by (method,
  alpha), after checking that the study ran."""
  root, result = study
  assert result.returncode == 0, result.stderr[-3000:]
  ev = json.loads((root / 'eval_lm0' / 'results.json').read_text())
  return ev, {(r['method'], r['alpha']): r for r in ev['rows']}


# Slow (it reads the slow study's evaluation). Covered by
# test_steering_evaluation.py::test_one_evaluation_runs_both_models (rows,
# table and vector file of an evaluation) and test_steering_lm.py's vector
# file tests.
@pytest.mark.slow
def test_the_evaluation_writes_table_plot_and_vector(study, lm_runlocal_run,
                                                    tmp_path):
  """train.steering.evaluation.evaluate's rows, table, plot and vector, on
  the study's evaluation of the runlocal LM (its grid at alpha 1.0; it was
  test_lm_jobs.py's own evaluation)."""
  ev, by_key = _study_rows(study)
  rows = ev['rows']
  config = steering_config.get_config('runlocal')
  # The rows follow the config's grid: the unsteered row, then each method
  # at each alpha.
  assert [(r['method'], r['alpha']) for r in rows] == [('none', 0.0)] + [
      (m, a) for m in config.methods[1:] for a in config.alphas]
  assert ev['meta']['mc_seeds'] == [7, 8] and config.alphas[-1] == 1.0
  none, renorm, gated, added = (by_key[m, a] for m, a in (
      ('none', 0.0), ('addition_renorm', 1.0), ('spherical_gate', 1.0),
      ('addition_gate', 1.0)))
  # The same gate on addition and on the rotation fires on the same tokens.
  assert 0 < added['trigger_rate'] == gated['trigger_rate'] < 1
  assert none['kl'] == 0.0 and none['trigger_rate'] == 0.0
  assert gated['kl'] > 0 and renorm['kl'] > 0
  # Both keep the norm at the steered layer (addition_renorm by rescaling).
  assert gated['attribute_norm_ratio_at'] == pytest.approx(1.0, abs=1e-5)
  assert renorm['attribute_norm_ratio_at'] == pytest.approx(1.0, abs=1e-5)
  for r in rows:
    for key in ('copa_acc_sum', 'copa_acc_mean', 'cloze_acc_sum',
                'cloze_acc_mean', 'distinct_2', 'repetition_3'):
      assert 0.0 <= r[key] <= 1.0
    # Per-item correctness, for intervals over items: one 0/1 list per
    # item set (seeds 7 and 8, the first the single-set run's), averaging
    # to the accuracy.
    for task in ('copa', 'cloze'):
      for score in ('sum', 'mean'):
        sets = r[f'{task}_correct_{score}']
        assert len(sets) == 2 and all(len(s) == 8 for s in sets)
        assert set(sets[0]) | set(sets[1]) <= {0, 1}
        assert np.mean(sets) == r[f'{task}_acc_{score}']
    assert r['gen_ce'] > 0
  out = study[0] / 'eval_lm0'
  for name in ('results.md', 'results.json', 'pareto.png',
               'steering_vector.npz'):
    assert os.path.getsize(out / name) > 0
  table = (out / 'results.md').read_text()
  assert table.count('\n') == 2 + len(rows)
  # The saved vector loads into this model, and reusing it gives the same
  # rows (an evaluation of its own, in this process).
  params = lm_trainer.load_trained(lm_runlocal_run[0]).params
  vec = steering_vectors.load(str(out / 'steering_vector.npz'), params)
  assert vec.layer_path == 'block_1' and vec.hidden_size == 32
  config.update(dict(lm_workdir=lm_runlocal_run[0], alphas=(1.0,),
                     vector_file=str(out / 'steering_vector.npz'),
                     methods=('spherical_gate',)))
  again = steering_eval.evaluate(config, str(tmp_path))
  assert again[0]['kl'] == pytest.approx(gated['kl'], rel=1e-5)
  # The first item set is the one a single-seed run draws.
  assert again[0]['cloze_correct_mean'] == gated['cloze_correct_mean'][:1]


def test_finished_evaluations_are_reused_and_another_config_refused(
    tmp_path, monkeypatch):
  """lm_runs on the byte study's stored evaluations (results/): an
  evaluation whose config is the study's is reused, the main one and a
  gate threshold's (the gated rotation alone at its beta), without
  evaluating; another config's is refused naming what differs."""
  root = 'workdirs/steering_study'  # As the stored configs name it.
  with tarfile.open(os.path.join(ROOT, 'studies', 'steering', 'results',
                                 'byte_evaluations.tar.xz')) as tar:
    tar.extractall(tmp_path / root, filter='data')
  monkeypatch.chdir(tmp_path)

  def evaluate(*args):
    raise AssertionError('evaluated a finished evaluation')
  monkeypatch.setattr(steering_eval, 'evaluate', evaluate)
  for beta, name in ((None, 'eval_lm1'), (-0.5, 'eval_lm1_beta-0.5')):
    config = lm_runs.eval_config(root, '', 1, [7, 8, 9], beta)
    stored = json.loads((tmp_path / root / name / 'results.json'
                         ).read_text())
    assert lm_runs.evaluate(root, config, name) == stored
    assert stored['meta']['mc_seeds'] == [7, 8, 9]
    assert stored['meta']['beta'] == (0.0 if beta is None else beta)
    assert {r['method'] for r in stored['rows']} == (
        set(config.methods) if beta is None else {'none', 'spherical_gate'})
  assert lm_runs.finished(root, config, 'eval_lm7') is None
  other = lm_runs.eval_config(root, '', 1, [7, 9])
  with pytest.raises(UsageError, match=r'eval_lm1/ holds an evaluation '
                     r'with another config \(mc_seeds\)'):
    lm_runs.evaluate(root, other, 'eval_lm1')


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
