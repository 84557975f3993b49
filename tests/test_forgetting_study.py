"""The forgetting study's machinery: `config.init_from` in the LM trainer,
the study's run configs, its reuse of stored measures and its report, and
`python -m studies.lm_forgetting` end to end at runlocal size (slow) and its
one-line errors (run as a user would, in a subprocess: the launchers' absl
flags share names)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import lm as lm_config
from studies.lm_forgetting import measure
from studies.lm_forgetting import report
from studies.lm_forgetting import runs
from studies.lm_forgetting.settings import Settings
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
# checks the state a run starts from, and
# test_each_variants_runs_are_configured_as_the_study_says that the
# study's post-training starts from init_from.
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


# Slow (four LM runs and the sharpness programs' compiles, 70 s): its
# parts are covered in the default suite by the tests below it (the run
# configs, the reuse of stored measures, the report),
# test_init_from_starts_at_the_other_runs_parameters (the post-training's
# start), test_lm_heldout.py (the held-out CE) and test_sam.py's window
# test (SAM on the window's steps only).
@pytest.mark.slow
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


def test_each_variants_runs_are_configured_as_the_study_says(tmp_path):
  """runs.py: sam_mid is the baseline with SAM on its last mid_steps steps
  (same seed, steps and data), sam on every step; the post-training moves
  to the post source from the pretrained workdir."""
  settings = Settings(config_arg='runlocal,forgetting', mid_steps=10,
                      rho=0.07, post_steps=20, post_lr=2e-3)
  base = runs.pretrain_config(settings, 'baseline', 1)
  settings.check(base)
  mid = runs.pretrain_config(settings, 'sam_mid', 1)
  full = runs.pretrain_config(settings, 'sam', 1)
  assert not base.optimizer.sam.enabled and base.seed == 1
  assert mid.optimizer.sam.enabled and full.optimizer.sam.enabled
  assert mid.optimizer.sam.rho == full.optimizer.sam.rho == 0.07
  assert mid.optimizer.sam.window_start == base.num_steps - 10 > 0
  assert full.optimizer.sam.window_start == base.optimizer.sam.window_start
  mid.optimizer.sam = base.optimizer.sam
  assert mid.to_json() == base.to_json()
  post = runs.post_config(settings, 1, str(tmp_path / 'pre'))
  assert tuple(map(tuple, post.data.mix)) == (('attribute', 1.0),)
  assert (post.num_steps, post.optimizer.learning_rate, post.seed) == (
      20, 2e-3, 1)
  assert post.init_from == str(tmp_path / 'pre')
  assert post.eval_every == post.checkpoint_every == 20


def _record(variant, seed, pre, post, quant):
  return dict(variant=variant, seed=seed, pretrain_ce=pre, post_ce=post,
              quant_ce=quant, forgetting_post=post - pre,
              forgetting_quant=quant - pre, target_ce_before=3.0,
              target_ce_after=2.0, post_trainer_val_loss=2.0, sam_steps=0,
              flagged_steps=0, lambda_max=1.5, trace=4.0, trace_stderr=0.1)


def test_stored_measures_are_reused_and_reported(tmp_path, monkeypatch):
  """measure.measure returns a (variant, seed)'s stored measures without
  training; the table's reductions are 1 - F_variant / F_baseline per
  seed, mean +- std in percent (numpy here); the figure is a PNG."""
  records = [_record('baseline', 0, 1.0, 1.5, 1.2),
             _record('baseline', 1, 1.1, 1.5, 1.4),
             _record('sam_mid', 0, 1.0, 1.3, 1.1),
             _record('sam_mid', 1, 1.1, 1.4, 1.3)]
  os.makedirs(tmp_path / 'measures')
  for r in records:
    with open(tmp_path / 'measures' / f"{r['variant']}_seed{r['seed']}.json",
              'w') as f:
      json.dump(r, f)

  def train(*args):
    raise AssertionError('trained a finished (variant, seed)')
  monkeypatch.setattr(trainer, 'train_and_evaluate', train)
  settings = Settings(workdir=str(tmp_path), seeds=2,
                      variants=('baseline', 'sam_mid'))
  assert [measure.measure(settings, v, s) for v in settings.variants
          for s in range(2)] == records
  table = report.summarize(records)
  rows = {l.split(' | ')[0].strip('| '): l.split(' | ')
          for l in table.splitlines() if l.startswith('| ')}
  for col, key in ((4, 'forgetting_post'), (7, 'forgetting_quant')):
    want = 100 * (1 - np.array([records[2 + s][key] / records[s][key]
                                for s in range(2)]))
    assert rows['sam_mid'][col] == (
        f'{want.mean():.0f} +- {want.std(ddof=1):.0f}%')
    assert rows['baseline'][col] == '-'
  assert rows['baseline'][3].startswith(
      f"{np.mean([r['forgetting_post'] for r in records[:2]]):.3f} +- ")
  report.plot(records, str(tmp_path / 'f.png'))
  assert (tmp_path / 'f.png').read_bytes()[:4] == b'\x89PNG'


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
