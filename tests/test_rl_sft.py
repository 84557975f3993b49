"""The SFT warm start through `launch.train`, and loading it as the RL policy."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import rl_sft as sft_config
from train.jobs import trainers
from tests import config_edits
from tests.conftest import SFT_POLICY_OVERRIDES
from tests import launch_runs
from tests import read_only
from train.errors import ConfigError, UsageError
from train.rl import sft
from train.rl import tasks


@pytest.fixture(scope='module')
def sft_run(sft_policy_run):
  return sft_policy_run  # launch.train on configs/rl_sft.py (conftest.py).


def test_sft_job_writes_pass_at_1_per_difficulty(sft_run):
  workdir, stdout = sft_run
  with open(os.path.join(workdir, sft.PASS_AT_1)) as f:
    scores = json.load(f)
  assert sorted(scores) == ['add_d1', 'add_d2']
  assert all(0.0 <= v <= 1.0 for v in scores.values())
  with open(os.path.join(workdir, 'final_metrics.json')) as f:
    final = json.load(f)
  assert final['step'] == 300 and 'val_add_d2_accuracy' in final
  assert 'test accuracy' in stdout


def test_the_policy_loads_with_its_config_and_scores_the_same(sft_run):
  workdir, _ = sft_run
  config, model, params, _ = sft.load_policy(workdir)
  assert config.task == 'rl_sft' and model.d_model == 32
  with open(os.path.join(workdir, sft.PASS_AT_1)) as f:
    scores = json.load(f)
  assert sft.evaluate_pass_at_1(config, model, params) == scores


def test_the_policy_loads_from_a_read_only_directory(sft_run, tmp_path):
  # Loading a policy (as launch.rl does) wrote a probe file into its
  # workdir, and a read-only one was refused as "not writable".
  with read_only.view(sft_run[0], str(tmp_path / 'ro')) as ro:
    config, _, params, _ = sft.load_policy(ro)
  want_config, _, want, _ = sft.load_policy(sft_run[0])
  assert config == want_config
  jax.tree.map(np.testing.assert_array_equal, params, want)


def test_a_finished_run_reruns_without_training_or_rescoring(sft_run,
                                                             tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(sft_run[0], workdir)  # The session's run stays untouched.
  stamp = os.stat(os.path.join(workdir, sft.PASS_AT_1)).st_mtime_ns
  proc = launch_runs.run(workdir, *SFT_POLICY_OVERRIDES,
                         config='configs/rl_sft.py:runlocal')
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert os.stat(os.path.join(workdir, sft.PASS_AT_1)).st_mtime_ns == stamp
  assert 'test accuracy' in proc.stdout


def test_load_policy_refuses_a_missing_or_foreign_workdir(tmp_path,
                                                         digits_runlocal_run):
  with pytest.raises(UsageError, match='config.sft_workdir.*train the warm'):
    sft.load_policy(str(tmp_path / 'none'))
  with pytest.raises(UsageError, match="'classification' run, not an 'rl_sft'"):
    sft.load_policy(digits_runlocal_run[0])


# In-process: launch.train prints `error: <the UsageError>` and exits 2
# (test_bad_sft_config_through_the_launcher_is_one_line_and_exit_2).
@pytest.mark.parametrize('changes,field', [
    ({'data.families': ('div',)}, 'data.family'),
    ({'data.difficulties': (1, 9)}, 'data.difficulty'),
    ({'data.difficulties': ()}, 'data.difficulties'),
    ({'data.train_examples': 0}, 'data.train_examples'),
    ({'model.max_len': 8}, 'model.max_len'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_sft_config_is_one_line_before_any_work(tmp_path, changes, field):
  config = config_edits.apply(sft_config.get_config('runlocal'), changes)
  with pytest.raises(UsageError) as e:
    trainers.train_and_evaluate(config, str(tmp_path / 'w'))
  assert field in str(e.value) and '\n' not in str(e.value), str(e.value)
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


def test_bad_sft_config_through_the_launcher_is_one_line_and_exit_2(tmp_path):
  proc = launch_runs.run(str(tmp_path / 'w'),
                         '--config.data.difficulties=(1,9)',
                         config='configs/rl_sft.py:runlocal')
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'data.difficulty' in errors[0], (
      proc.stderr[-2000:])
  assert 'Traceback' not in proc.stderr
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


def test_the_configs_parse_and_check():
  config = sft_config.get_config()
  sft.check_config(config)
  assert config.data.families == ('add',)
  mixed = sft_config.get_config('families=add+mul')
  assert mixed.data.families == ('add', 'mul')
  sft.check_config(mixed)
  with pytest.raises(ValueError, match='unknown config argument'):
    sft_config.get_config('digits=4')
  bad = sft_config.get_config()
  bad.data.families = ('add', 'pow')
  with pytest.raises(ConfigError, match="data.family.*'add', 'mul'"):
    sft.check_config(bad)
  assert tasks.MAX_DIFFICULTY >= max(config.data.difficulties)
