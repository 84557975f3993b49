"""studies.gemma_forgetting: the README's command at smoke size on a small
Gemma 3 file (tests/tiny_gemma.py), its measures against plain
references, its report, and the stored study rebuilt from its measures."""

import dataclasses
import json
import os

import jax
import jax.flatten_util
import numpy as np
import pytest

from studies.gemma_forgetting import config as study_config
from studies.gemma_forgetting import measure
from studies.gemma_forgetting import report
from studies.gemma_forgetting import settings as study_settings
from studies.gemma_forgetting import study
from tests import launch_runs
from tests import tiny_gemma
from train.errors import UsageError
from train.lm import data as lm_data
from train.lm import gemma_gguf
from train.lm import models
from train.rl import sft
from train.rl import tasks

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'studies', 'gemma_forgetting', 'results')
# One matrix trained (2,048 parameters): its dense Hessian is the exact
# reference of the study's sharpness.
FROZEN = '^(?!block_1/mlp/down$)'


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('tiny') / 'g.gguf')


# 47 s (two SFT runs and their measures in a launcher process): the
# measures, their reuse and the refusals are held by the fast tests below,
# the study's functions called on the file's model (docs/slow_tests.md).
@pytest.mark.slow
def test_the_study_measures_reuses_and_refuses(tiny_file, tmp_path):
  root = str(tmp_path / 'study')
  # The README's command, on the small file at smoke size.
  out = launch_runs.run_module(
      'studies.gemma_forgetting',
      '--config=studies/gemma_forgetting/config.py:runlocal',
      f'--config.model.gguf={tiny_file}', '--config.model.shape=gguf',
      '--config.batch_size=8', '--config.eval_batch_size=8',
      f'--config.optimizer.frozen={FROZEN}', '--seeds=1', '--windows=4',
      '--window_len=16', '--sharpness_iters=40', '--sharpness_problems=4',
      f'--workdir={root}', timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  text = open(os.path.join(root, report.REPORT)).read()
  assert text in out.stdout
  base = tiny_gemma.gemma_config(tiny_file, 'sft')
  base.batch_size = base.eval_batch_size = 8
  base.optimizer.frozen = FROZEN
  settings = study_settings.Settings(seeds=1, windows=4, window_len=16,
                                     sharpness_iters=40,
                                     sharpness_problems=4)
  records = json.load(open(os.path.join(root, report.RECORDS)))
  pre, runs = records['pretrained'], records['runs']
  assert [(r['variant'], r['seed']) for r in runs] == [('adamw', 0),
                                                       ('sam_rho0.05', 0)]
  loaded = _check_heldout_ce(tiny_file, base, pre)
  # The sharpness against the top eigenvalue of the dense Hessian of the
  # same loss in the trained matrix.
  assert 'lambda_max (fine-tuning loss)' in text
  batch = measure.sharpness_batch(base, tasks.codec(loaded.tokenizer), 4)
  exp = sft.build(base, str(tmp_path / 'h'))
  params = jax.tree.map(np.asarray, loaded.params)
  flat, unflat = jax.flatten_util.ravel_pytree(
      params['block_1']['mlp']['down'])

  def sub_loss(x):
    mlp = dict(params['block_1']['mlp'], down=unflat(x))
    p = dict(params, block_1=dict(params['block_1'], mlp=mlp))
    return exp.per_example(exp.model, {'params': p, 'batch_stats': {}},
                           batch, False)[0].mean()
  hessian = jax.jit(jax.hessian(sub_loss))(flat)
  eigenvalues = np.linalg.eigvalsh(np.asarray(hessian, np.float64))
  top = eigenvalues[np.argmax(np.abs(eigenvalues))]
  assert pre['lambda_max'] == pytest.approx(top, rel=0.05)
  sam_run = sft.load_policy(os.path.join(root, 'runs', 'sam_rho0.05_seed0'))
  assert sam_run.config.optimizer.sam.enabled
  assert sam_run.config.optimizer.sam.rho == 0.05
  forgetting = runs[1]['heldout_ce'] - pre['heldout_ce']
  assert f'{forgetting:+.4f}'.lstrip('+') in text or f'{forgetting:.4f}' in text
  # Reused: nothing is measured again (the command's config is `base`).
  path = os.path.join(root, 'measures', 'sam_rho0.05_seed0.json')
  mtime = os.path.getmtime(path)
  assert study.run(settings, base, root) == text
  assert os.path.getmtime(path) == mtime
  # Other settings on the same workdir: refused, nothing overwritten.
  with pytest.raises(UsageError, match='other settings'):
    study.run(dataclasses.replace(settings, windows=6), base, root)
  for rhos in ((), (0.1, 0.1), (-1.0,)):
    with pytest.raises(UsageError, match='--rhos'):
      study.run(dataclasses.replace(settings, rhos=rhos), base, root)
  with pytest.raises(UsageError, match='optimizer.sam.enabled'):
    on = tiny_gemma.gemma_config(tiny_file, 'sft,sam')
    study.run(settings, on, str(tmp_path / 'other'))
  assert not os.path.exists(tmp_path / 'other')


# The fast tests train one norm's scale (32 parameters): its dense Hessian
# is 32 Hessian-vector products, where the slow test's matrix took 2,048
# (10 s of CPU).
FAST_TRAINED = ('block_1', 'post_mlp_norm', 'scale')


def _check_heldout_ce(tiny_file, base, pre):
  """The pretrained record's held-out CE against a plain log-softmax over
  the same windows; returns the loaded file."""
  loaded = gemma_gguf.load(tiny_file)
  windows = lm_data.heldout_windows(loaded.tokenizer, 4, 16)
  model = models.create(base).clone(max_len=17)
  logits, _ = model.apply({'params': loaded.params}, windows[:, :-1])
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64))
  want = -np.take_along_axis(logp, windows[:, 1:, None], -1).mean()
  assert abs(pre['heldout_ce'] - want) < 1e-4
  return loaded


def _small(tiny_file, frozen=f'^(?!{"/".join(FAST_TRAINED)}$)'):
  """The slow test's study config and settings, `frozen` everything but
  FAST_TRAINED by default: (base, settings)."""
  base = tiny_gemma.gemma_config(tiny_file, 'sft')
  base.batch_size = base.eval_batch_size = 8
  base.optimizer.frozen = frozen
  return base, study_settings.Settings(seeds=1, windows=4, window_len=16,
                                       sharpness_iters=40,
                                       sharpness_problems=4)


def _dense_top_eigenvalue(base, params, codec, count, workdir):
  """The eigenvalue of largest magnitude of the dense Hessian of the
  fine-tuning loss in the one trained leaf (FAST_TRAINED)."""
  batch = measure.sharpness_batch(base, codec, count)
  exp = sft.build(base, workdir)
  params = jax.tree.map(np.asarray, params)

  def replaced(tree, path, x):
    if not path:
      return x
    return dict(tree, **{path[0]: replaced(tree[path[0]], path[1:], x)})

  def sub_loss(x):
    p = replaced(params, FAST_TRAINED, x)
    return exp.per_example(exp.model, {'params': p, 'batch_stats': {}},
                           batch, False)[0].mean()
  flat = params
  for key in FAST_TRAINED:
    flat = flat[key]
  hessian = jax.jit(jax.hessian(sub_loss))(flat)
  eigenvalues = np.linalg.eigvalsh(np.asarray(hessian, np.float64))
  return eigenvalues[np.argmax(np.abs(eigenvalues))]


def test_the_pretrained_measures_against_plain_references(tiny_file,
                                                          tmp_path):
  """The study's measures of the file's model, by the functions study.run
  calls (no fine-tuning run: the slow test above runs the README's
  command): the held-out CE against a plain log-softmax over the same
  windows, lambda_max against the dense Hessian's top eigenvalue; a
  second call reuses the record, other settings are refused."""
  base, settings = _small(tiny_file)
  root = str(tmp_path / 'study')
  pre = measure.measure_pretrained(settings, base, root)
  loaded = _check_heldout_ce(tiny_file, base, pre)
  assert set(pre['pass_at_1']) == {'add_d1', 'add_d2'}
  sharp = measure.measure_sharpness(settings, base, root, None, 0)
  top = _dense_top_eigenvalue(base, loaded.params,
                              tasks.codec(loaded.tokenizer), 4,
                              str(tmp_path / 'h'))
  assert sharp['lambda_max'] == pytest.approx(top, rel=0.05)
  path = os.path.join(root, 'measures', 'pretrained.json')
  mtime = os.path.getmtime(path)
  assert measure.measure_pretrained(settings, base, root) == pre
  assert os.path.getmtime(path) == mtime
  with pytest.raises(UsageError, match='other settings'):
    measure.measure_pretrained(dataclasses.replace(settings, windows=6),
                               base, root)
  assert os.path.getmtime(path) == mtime


def test_bad_settings_or_a_sam_base_are_refused_before_anything(tiny_file,
                                                                 tmp_path):
  base, settings = _small(tiny_file)
  root = tmp_path / 'study'
  for rhos in ((), (0.1, 0.1), (-1.0,)):
    with pytest.raises(UsageError, match='--rhos'):
      study.run(dataclasses.replace(settings, rhos=rhos), base, str(root))
  with pytest.raises(UsageError, match='optimizer.sam.enabled'):
    study.run(settings, tiny_gemma.gemma_config(tiny_file, 'sft,sam'),
              str(root))
  assert not root.exists()


def test_the_report_pairs_seeds():
  pre = {'heldout_ce': 3.0, 'pass_at_1': {'add_d1': 0.5}}
  run = lambda v, s, ce: dict(variant=v, seed=s, heldout_ce=ce,
                              answer_ce=0.1, pass_at_1={'add_d1': 1.0})
  text = report.summarize(pre, [
      run('adamw', 0, 3.2), run('adamw', 1, 3.4), run('adamw', 2, 2.9),
      run('sam_rho0.1', 0, 3.1), run('sam_rho0.1', 1, 3.1),
      run('sam_rho0.1', 2, 3.0)])
  # Forgetting 0.2 / 0.4 / -0.1 against 0.1 / 0.1 / 0.0: reductions 50%
  # and 75% where AdamW forgot; seed 2 (AdamW improved) has none.
  assert '| 0 | 0.2000 | 0.1000 | -0.1000 | 50% |' in text
  assert '| 2 | -0.1000 | 0.0000 | +0.1000 | - |' in text
  assert 'sam_rho0.1 against adamw, paired by seed' in text
  assert 'sam_rho0.1: 62 ± 18% over the 2 of 3 seeds' in text
  assert '| adamw (3 seeds) | 3.1667 ± 0.2517 | 0.1667 ± 0.2517 |' in text


# The README's run: --rhos=0.05,0.01, 3 seeds, sharpness measured.
STORED = study_settings.Settings(seeds=3, rhos=(0.05, 0.01), windows=32,
                                 window_len=128, sharpness_iters=20,
                                 sharpness_problems=32)


def test_the_stored_report_rebuilds_from_its_measures(tmp_path):
  pretrained, runs = report.records(os.path.join(RESULTS, 'measures'),
                                    STORED.variants, STORED.seeds, True)
  report.write(str(tmp_path), pretrained, runs)
  for name in (report.REPORT, report.RECORDS):
    with open(os.path.join(RESULTS, name), 'rb') as f:
      assert (tmp_path / name).read_bytes() == f.read(), name


# SAM fields added after the stored runs, at values that leave SAM as it
# was (every step, no switch): absent from the stored configs.
_LATER_DEFAULTS = {'every': 1, 'alpha': 0.7,
                   'ae': {'enabled': False, 'margin_start': 0.0,
                          'margin_end': 0.0, 'decay': 0.9}}


def _without_later_defaults(config, stored):
  # init_from (post-training another run) came later too, unset here.
  if 'init_from' not in stored and config.get('init_from', 0) is None:
    del config['init_from']
  sam, stored_sam = config['optimizer']['sam'], stored['optimizer']['sam']
  for key, default in _LATER_DEFAULTS.items():
    if key not in stored_sam and sam.get(key) == default:
      del sam[key]
  return config


def test_the_study_config_is_the_stored_runs_config():
  """The README's command (studies/gemma_forgetting/config.py) gives each
  stored run the config it was measured with."""
  base = study_config.get_config()
  study_settings.check_config(base)
  measures = os.path.join(RESULTS, 'measures')
  for variant in STORED.variants:
    for seed in range(STORED.seeds):
      with open(os.path.join(measures, f'{variant}_seed{seed}.json')) as f:
        identity = json.load(f)['identity']
      assert identity['config'] == _without_later_defaults(json.loads(
          study_settings.run_config(base, variant, seed).to_json()),
          identity['config']), (variant, seed)
      assert (identity['windows'], identity['window_len']) == (
          STORED.windows, STORED.window_len)
  with open(os.path.join(measures, 'pretrained.json')) as f:
    assert json.load(f)['identity']['data'] == json.loads(
        base.data.to_json())
  with open(os.path.join(measures, 'sharpness_pretrained.json')) as f:
    assert json.load(f)['identity']['iters'] == STORED.sharpness_iters
