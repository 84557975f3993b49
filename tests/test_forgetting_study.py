"""The forgetting study's machinery: `config.init_from` in the LM trainer, and
`python -m studies.lm_forgetting` end to end at runlocal size and its one-line
errors (run as a user would, in a subprocess: the launchers' absl flags
share names)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import lm as lm_config
from tests import launch_runs
from train import errors
from train.lm import trainer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def pretrained(lm_runlocal_run):
  return lm_runlocal_run[0]


def _continued(init_from, **changes):
  config = lm_config.get_config('runlocal')
  config.init_from = init_from
  config.update(changes)
  return config


def test_init_from_starts_at_the_other_runs_parameters(pretrained):
  params = trainer.load_trained(pretrained).params
  config = _continued(pretrained, seed=7)
  exp = trainer.build(config, '/tmp/unused')
  state = exp.init_state({'params': params})
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A fresh optimizer state (AdamW's moments at zero), placed as configured.
  assert int(state.step) == 0
  for leaf in jax.tree.leaves(state.opt_state):
    if leaf.ndim:
      assert not np.any(np.asarray(leaf))
  for leaf, want in zip(jax.tree.leaves(state),
                        jax.tree.leaves(exp.state_shardings)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


# Slow (three LM runs): test_init_from_starts_at_the_other_runs_parameters
# checks the state a run starts from, and the study's end-to-end test
# trains from init_from.
@pytest.mark.slow
def test_a_run_from_init_from_begins_where_the_other_ended(pretrained,
                                                           tmp_path):
  with open(os.path.join(pretrained, 'final_metrics.json')) as f:
    pre_val = json.load(f)['val_loss']
  fresh = trainer.train_and_evaluate(
      lm_config.get_config('runlocal'), str(tmp_path / 'fresh'))
  cont = trainer.train_and_evaluate(
      _continued(pretrained, num_steps=30), str(tmp_path / 'cont'))
  # 30 more steps from the trained model, against 30 from scratch.
  assert cont['val_loss'] < fresh['val_loss'] - 0.1
  assert cont['val_loss'] < pre_val + 0.05
  with open(tmp_path / 'cont' / 'metrics.jsonl') as f:
    first = [r for r in map(json.loads, f) if 'train_loss' in r][0]
  with open(tmp_path / 'fresh' / 'metrics.jsonl') as f:
    first_fresh = [r for r in map(json.loads, f) if 'train_loss' in r][0]
  assert first['train_loss'] < first_fresh['train_loss'] - 0.5


def test_init_from_without_checkpoints_is_one_line(tmp_path):
  missing = str(tmp_path / 'nothing')
  with pytest.raises(errors.UsageError) as e:
    trainer.train_and_evaluate(_continued(missing), str(tmp_path / 'run'))
  assert str(e.value).startswith(f'config.init_from={missing!r}: holds no '
                                 'checkpoints')
  assert not os.path.exists(tmp_path / 'run')


def test_init_from_a_model_of_another_shape_is_one_line(pretrained,
                                                        tmp_path):
  config = _continued(pretrained)
  config.model.mlp_dim = 48
  with pytest.raises(errors.ConfigError) as e:
    trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  text = str(e.value)
  assert text.startswith(f'config.init_from={pretrained!r}: holds a model '
                         'of another shape')
  assert 'mlp' in text and '\n' not in text


_STUDY_FLAGS = ('--config_arg=runlocal,forgetting', '--seeds=1',
                '--mid_steps=10', '--post_steps=10', '--hessian_windows=8',
                '--power_iters=5', '--trace_samples=4')


def _study(workdir, *extra, timeout=600):
  return subprocess.run(
      [sys.executable, '-m', 'studies.lm_forgetting',
       f'--workdir={workdir}', *_STUDY_FLAGS, *extra],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def test_study_end_to_end_and_its_measures(tmp_path):
  workdir = tmp_path / 'study'
  result = _study(workdir, '--variants=baseline,sam_mid')
  assert result.returncode == 0, result.stderr[-3000:]
  records = json.loads((workdir / 'forgetting.json').read_text())
  assert [r['variant'] for r in records] == ['baseline', 'sam_mid']
  base, mid = records
  # The held-out CE computed by the study equals the trainer's own
  # evaluation of the post-trained model on its validation windows.
  for r in records:
    np.testing.assert_allclose(r['target_ce_after'],
                               r['post_trainer_val_loss'], rtol=1e-5)
    np.testing.assert_allclose(r['forgetting_post'],
                               r['post_ce'] - r['pretrain_ce'], rtol=1e-9)
    assert r['lambda_max'] > 0 and r['trace'] != 0
  # SAM ran exactly the last mid_steps steps, the baseline none.
  assert mid['sam_steps'] == 10 and base['sam_steps'] == 0
  table = (workdir / 'forgetting.md').read_text()
  assert '| baseline |' in table and '| sam_mid |' in table
  assert (workdir / 'forgetting.png').read_bytes()[:4] == b'\x89PNG'
  # A rerun trains and measures nothing again.
  stamp = os.path.getmtime(workdir / 'measures' / 'baseline_seed0.json')
  again = _study(workdir, '--variants=baseline,sam_mid')
  assert again.returncode == 0
  assert os.path.getmtime(workdir / 'measures' / 'baseline_seed0.json') == (
      stamp)


_BAD_SETTINGS = [
    ('--post_source=klingon',
     "error: --post_source='klingon': unknown post-training source"),
    ('--post_source=pydoc',
     "error: --post_source='pydoc': is the pretraining data"),
    ('--mid_steps=30', 'error: --mid_steps=30: the SAM window must lie '
     'inside the pretraining run: need 0 < mid_steps < num_steps=30'),
    ('--variants=sam', "error: --variants='sam': must include baseline"),
    ('--variants=baseline,tiny_lr',
     "error: --variants='tiny_lr': unknown variant; valid choices: "
     "'baseline', 'sam'"),
    ('--anneal_fraction=0', 'error: --anneal_fraction=0.0: must be in (0, 1]'),
]


@pytest.fixture(scope='module')
def bad_settings_runs(tmp_path_factory):
  """{flag: (the study's result with it, its workdir)}: each run its own
  process, forked from one that imported the study once
  (launch_runs.run_module_each; a process's imports cost more CPU than the
  check)."""
  flags = [flag for flag, _ in _BAD_SETTINGS]
  return dict(zip(flags, launch_runs.run_study_each(
      tmp_path_factory, 'studies.lm_forgetting', [[flag] for flag in flags],
      common=_STUDY_FLAGS)))


@pytest.mark.parametrize('flag, expected', _BAD_SETTINGS)
def test_bad_study_settings_are_one_line_before_any_work(flag, expected,
                                                          bad_settings_runs):
  result, workdir = bad_settings_runs[flag]
  assert result.returncode == 2
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
  assert not os.path.exists(workdir / 'measures')
