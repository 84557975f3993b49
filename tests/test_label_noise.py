"""Symmetric label noise: exact counts, only wrong labels, uniform over the
other classes, deterministic by its own seed; wired into the trainer's
training split only; a bad rate is refused before anything runs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import digits
from train import errors
from train.vision import datasets
from train.vision import label_noise
from train.vision import trainer


@pytest.mark.parametrize('rate', [0.0, 0.2, 0.4, 0.95])
@pytest.mark.parametrize('n', [0, 1, 37, 1000])
def test_exactly_round_rate_n_labels_change_each_to_another_class(rate, n):
  rng = np.random.default_rng(n)
  labels = rng.integers(0, 10, n).astype(np.int32)
  before = labels.copy()
  noisy = label_noise.symmetric(labels, 10, rate, seed=3)
  assert noisy.dtype == labels.dtype and noisy.shape == labels.shape
  assert int(np.sum(noisy != labels)) == int(round(rate * n))
  assert noisy.min(initial=0) >= 0 and noisy.max(initial=0) < 10
  np.testing.assert_array_equal(labels, before)  # Input untouched.


def test_the_new_class_is_uniform_over_the_others():
  labels = np.zeros(60_000, np.int32)
  noisy = label_noise.symmetric(labels, 4, 0.5, seed=0)
  counts = np.bincount(noisy[noisy != 0], minlength=4)
  assert counts[0] == 0
  # 30,000 flips over 3 classes: each 10,000 +- 5 standard deviations.
  sd = np.sqrt(30_000 * (1 / 3) * (2 / 3))
  assert np.all(np.abs(counts[1:] - 10_000) < 5 * sd), counts


def test_flipped_examples_are_a_uniform_subset():
  labels = np.arange(20_000, dtype=np.int32) % 10
  noisy = label_noise.symmetric(labels, 10, 0.3, seed=1)
  flipped = noisy != labels
  # Both halves of the index range get their share (not a prefix).
  first, second = flipped[:10_000].sum(), flipped[10_000:].sum()
  assert abs(int(first) - 3000) < 250 and abs(int(second) - 3000) < 250


def test_the_same_seed_gives_the_same_labels_and_another_does_not():
  labels = np.arange(500, dtype=np.int32) % 10
  a = label_noise.symmetric(labels, 10, 0.4, seed=7)
  np.testing.assert_array_equal(a, label_noise.symmetric(labels, 10, 0.4,
                                                         seed=7))
  assert np.any(a != label_noise.symmetric(labels, 10, 0.4, seed=8))


@pytest.mark.parametrize('rate', [-0.1, 1.0, 1.5])
def test_a_rate_outside_0_1_is_refused(rate):
  with pytest.raises(ValueError, match='outside'):
    label_noise.symmetric(np.zeros(4, np.int32), 10, rate, 0)


def test_the_trainer_corrupts_the_training_split_only():
  config = digits.get_config('runlocal,label_noise=0.4')
  clean = digits.get_config('runlocal')
  data = trainer.load_data(config)
  ref = trainer.load_data(clean)
  differ = data.train.labels != ref.train.labels
  assert int(differ.sum()) == round(0.4 * len(ref.train))
  np.testing.assert_array_equal(data.train.images, ref.train.images)
  np.testing.assert_array_equal(data.validation.labels,
                                ref.validation.labels)
  np.testing.assert_array_equal(data.final()['test'].labels,
                                ref.final()['test'].labels)
  # The training seed does not change the corrupted set.
  config.seed = 5
  np.testing.assert_array_equal(trainer.load_data(config).train.labels,
                                data.train.labels)
  assert isinstance(data.train, datasets.ArraySplit)


@pytest.mark.parametrize('rate', [1.0, -0.2, 'high'])
def test_a_bad_rate_in_the_config_is_one_line_before_any_work(rate,
                                                                tmp_path):
  config = digits.get_config('runlocal')
  config.label_noise = rate
  workdir = str(tmp_path / 'run')
  with pytest.raises(errors.ConfigError) as e:
    trainer.train_and_evaluate(config, workdir)
  assert str(e.value).startswith(f'config.label_noise={rate!r}')
  assert 'in [0, 1)' in str(e.value) and '\n' not in str(e.value)
  assert not os.path.exists(workdir)


# Slow (four runs in a subprocess, 32 s). Its parts run by default:
# test_sam_study.py::test_the_study_records_each_run_and_tables_them (these
# runs' configs, records and table on a stand-in trainer) and
# test_the_trainer_corrupts_the_training_split_only (the noise).
@pytest.mark.slow
def test_the_sam_study_runs_under_label_noise_and_reports_the_detector(
    tmp_path):
  """`studies.sam_recipes` as a user runs it (a subprocess: the studies'
  flags share names), one tiny SAM, ASAM (on its own radius), LookSAM
  (g+ every 5 steps) and AE-SAM run at 40% noise. On the MLP: what is
  checked here is the study's (its methods' SAM steps, its table), not
  the CNN's, whose four runs cost most of their time in compiles."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, '-m', 'studies.sam_recipes', f'--workdir={tmp_path}',
       '--seeds=1', '--rhos=0.5', '--methods=sam,asam,looksam5,aesam',
       '--asam_rhos=3.0',
       '--config_arg=runlocal,label_noise=0.4,model=mlp'],
      cwd=root, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  table = (tmp_path / 'study.md').read_text()
  assert '| sam | 0.5 |' in table
  assert 'runs flagged' in table and 'stalled' in table
  runs = json.loads((tmp_path / 'study.json').read_text())
  sam_run = runs['sam/0.5'][0]
  assert sam_run['opt/sam_steps'] == 40 and isinstance(sam_run['stalled'],
                                                       bool)
  assert sorted(runs) == ['aesam/0.5', 'asam/3.0', 'looksam5/0.5', 'sam/0.5']
  assert runs['asam/3.0'][0]['opt/rho'] == pytest.approx(3.0)
  # LookSAM took g+ on 8 of the 40 steps; AE-SAM where its switch chose.
  assert runs['looksam5/0.5'][0]['opt/sam_steps'] == 8
  assert '| looksam5 | 0.5 |' in table and '| 8 | 1.20 |' in table
  ae = runs['aesam/0.5'][0]
  assert 0 < ae['opt/sam_steps'] < 40
  assert ae['opt/ae_sam_steps'] == ae['opt/sam_steps']
