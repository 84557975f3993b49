"""The LM training job end to end in its small mode, and the steering
evaluation job's refusals (its outputs are checked on the steering study's
evaluation: test_steering_study_launch.py)."""

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
