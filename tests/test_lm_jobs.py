"""The LM training job and the steering evaluation job, end to end in their small modes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import lm as lm_config
from configs import steering as steering_config
from tests import config_edits
from tests import launch_runs
from tests.conftest import REPO_ROOT
from train.run import workdir_lock
from train.errors import ConfigError
from train.lm import trainer as lm_trainer
from train.steering import evaluation as steering_eval
from train.steering import vectors as steering_vectors


@pytest.fixture(scope='module')
def lm_workdir(lm_runlocal_run):
  return lm_runlocal_run


def test_lm_trains_and_reports_per_source_heldout_loss(lm_workdir):
  workdir, final = lm_workdir
  records = [json.loads(l) for l in open(os.path.join(workdir,
                                                      'metrics.jsonl'))]
  losses = [r['train_loss'] for r in records if 'train_loss' in r]
  assert losses[-1] < losses[0] - 0.5  # It learns (5.5 -> about 3.8 nats).
  # Uniform over 256 bytes is 5.55 nats; held-out losses must beat it.
  for key in ('val_loss', 'val_attribute_loss', 'val_pydoc_loss',
              'test_loss'):
    assert final[key] < np.log(256) - 0.5, (key, final[key])
  # A finished run is not trained again.
  again = lm_trainer.train_and_evaluate(lm_config.get_config('runlocal'),
                                        workdir)
  assert again == json.load(open(os.path.join(workdir, 'final_metrics.json')))


def _eval_config(lm_dir, **overrides):
  config = steering_config.get_config('runlocal')
  config.lm_workdir = lm_dir
  config.methods = ('none', 'addition_renorm', 'spherical_gate')
  config.alphas = (1.0,)
  return config_edits.apply(config, overrides)


def test_steering_evaluation_writes_table_plot_and_vector(lm_workdir,
                                                          tmp_path):
  rows = steering_eval.evaluate(
      _eval_config(lm_workdir[0], mc_seeds=(7, 8),
                   methods=('none', 'addition_renorm', 'spherical_gate',
                            'addition_gate')), str(tmp_path))
  assert [(r['method'], r['alpha']) for r in rows] == [
      ('none', 0.0), ('addition_renorm', 1.0), ('spherical_gate', 1.0),
      ('addition_gate', 1.0)]
  none, renorm, gated, added = rows
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
  for name in ('results.md', 'results.json', 'pareto.png',
               'steering_vector.npz'):
    assert os.path.getsize(tmp_path / name) > 0
  table = open(tmp_path / 'results.md').read()
  assert table.count('\n') == 2 + len(rows)
  # The saved vector loads into this model, and reusing it gives the same rows.
  params = lm_trainer.load_trained(lm_workdir[0]).params
  vec = steering_vectors.load(str(tmp_path / 'steering_vector.npz'), params)
  assert vec.layer_path == 'block_1' and vec.hidden_size == 32
  again = steering_eval.evaluate(
      _eval_config(lm_workdir[0], vector_file=str(
          tmp_path / 'steering_vector.npz'), methods=('spherical_gate',)),
      str(tmp_path / 'reuse'))
  assert again[0]['kl'] == pytest.approx(gated['kl'], rel=1e-5)
  # The first item set is the one a single-seed run draws.
  assert again[0]['cloze_correct_mean'] == gated['cloze_correct_mean'][:1]


@pytest.mark.parametrize('changes,message', [
    ({'optimizer.sam.enabled': True, 'optimizer.sam.rho': -0.1},
     'config.optimizer.sam.rho=-0.1: must be finite and >= 0'),
    ({'optimizer.sam.enabled': True, 'optimizer.sam.warmup_steps': -1},
     'config.optimizer.sam.warmup_steps=-1: '),
])
def test_a_bad_sam_setting_of_the_lm_is_one_line_before_compute(
    changes, message, tmp_path):
  config = config_edits.apply(lm_config.get_config('runlocal'), changes)
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError) as e:
    lm_trainer.train_and_evaluate(config, str(workdir))
  assert str(e.value).startswith(message) and '\n' not in str(e.value)
  assert not workdir.exists()


@pytest.mark.parametrize('overrides,message', [
    (dict(methods=('none', 'iti')),
     "config.methods=.*unknown method 'iti'; valid choices: 'none', "
     "'addition', 'addition_renorm', 'addition_gate', 'spherical', "
     "'spherical_gate'"),
    (dict(mc_seeds=(7, 7)), r'config.mc_seeds=\(7, 7\): must be distinct'),
    (dict(mc_seeds=()), r'config.mc_seeds=\(\): must be distinct'),
    (dict(alphas=(0.5, 1.5)), r'config.alphas=.*alpha=1.5 is outside \[0, 1\]'),
    (dict(beta=1.0), r'config.beta=1.0: must be in \[-1, 1\)'),
    (dict(layer=7), r'config.layer=7: out of range; the model has 2 layers'),
    # These two were tracebacks after the vector file was written.
    ({'tasks.copa': 0},
     r'config.tasks.copa=0: must be an integer in \[1, 10000\]'),
    ({'generation.steps': 10**9},
     r'config.generation.steps=1000000000: prompts of \d+ tokens and this '
     r"many steps exceed the LM's max_len=\d+$"),
    ({'generation.prompts': 10**9},
     r'config.generation.prompts=1000000000: must be at most 10000'),
])
def test_bad_evaluation_config_fails_before_compute(lm_workdir, tmp_path,
                                                    overrides, message):
  with pytest.raises(ConfigError, match=message):
    steering_eval.evaluate(_eval_config(lm_workdir[0], **overrides),
                           str(tmp_path))
  assert os.listdir(tmp_path) == [workdir_lock.LOCK_FILE] or (
      not os.listdir(tmp_path)), os.listdir(tmp_path)


def test_a_held_workdir_is_refused_and_left_as_it_was(lm_workdir, tmp_path):
  # Two evaluations of one workdir both ran; the last writer won.
  holder = launch_runs.hold_workdir(str(tmp_path))
  try:
    with pytest.raises(workdir_lock.WorkdirBusy, match=f'pid {holder.pid}'):
      steering_eval.evaluate(_eval_config(lm_workdir[0]), str(tmp_path))
  finally:
    holder.kill()
    holder.wait()
  assert os.listdir(tmp_path) == [workdir_lock.LOCK_FILE]


def test_launcher_reports_a_missing_lm_in_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.steer_eval',
       '--config=configs/steering.py:runlocal',
       f'--config.lm_workdir={tmp_path}/none', f'--workdir={tmp_path}/out'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and 'holds no checkpoints' in lines[0], proc.stderr
  assert 'Traceback' not in proc.stderr
