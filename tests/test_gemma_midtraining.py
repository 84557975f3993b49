"""studies.gemma_midtraining: the README's command at smoke size on a small
Gemma 3 file (tests/tiny_gemma.py), its measures against plain references
(a log-softmax over the windows, each probe scored alone, the dense
Hessian of the mid-training loss), the chain of runs (post-training
starts from the mid-trained model), its report, and its refusals."""

import dataclasses
import json
import os
import shutil

import jax
import jax.flatten_util
import numpy as np
import pytest

from studies.gemma_midtraining import config as study_config
from studies.gemma_midtraining import measure
from studies.gemma_midtraining import probes
from studies.gemma_midtraining import report
from studies.gemma_midtraining import settings as study_settings
from studies.gemma_midtraining import study
from tests import launch_runs
from tests import tiny_gemma
from train.errors import UsageError
from train.lm import data as lm_data
from train.lm import gemma_gguf
from train.lm import models
from train.lm import quantization
from train.lm import trainer as lm_trainer
from train.rl import sft

# Mid-training trains one matrix (2,048 parameters): its dense Hessian is
# the exact reference of the sharpness; post-training keeps it frozen, so
# the post-trained model shows where it started.
MATRIX = 'block_1/mlp/down'
MID_FROZEN = f'^(?!{MATRIX}$)'
POST_FROZEN = f'^(embedding|{MATRIX})$'
SETTINGS = study_settings.Settings(
    seeds=1, rhos=(0.05,), windows=4, window_len=16, lanczos_steps=60,
    trace_probes=64, sharpness_windows=2)


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('tiny') / 'g.gguf')


def _base(path):
  base = study_config.get_config('runlocal')
  for field, frozen in (('midtrain', MID_FROZEN), ('posttrain', POST_FROZEN)):
    base[field].model.gguf = str(path)
    base[field].model.shape = 'gguf'
    base[field].batch_size = base[field].eval_batch_size = 8
    base[field].optimizer.frozen = frozen
  return base


def _flags(path):
  out = []
  for field, frozen in (('midtrain', MID_FROZEN), ('posttrain', POST_FROZEN)):
    out += [f'--config.{field}.model.gguf={path}',
            f'--config.{field}.model.shape=gguf',
            f'--config.{field}.batch_size=8',
            f'--config.{field}.eval_batch_size=8',
            f'--config.{field}.optimizer.frozen={frozen}']
  return out


@pytest.fixture(scope='module')
def smoke(tiny_file, tmp_path_factory):
  """The README's command at smoke size: (workdir, stdout)."""
  root = str(tmp_path_factory.mktemp('study') / 'study')
  out = launch_runs.run_module(
      'studies.gemma_midtraining',
      '--config=studies/gemma_midtraining/config.py:runlocal',
      *_flags(tiny_file), '--seeds=1', '--rhos=0.05', '--windows=4',
      '--window_len=16', '--lanczos_steps=60', '--trace_probes=64',
      '--sharpness_windows=2', f'--workdir={root}', timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  return root, out.stdout


def _measure(root, name):
  with open(os.path.join(root, 'measures', f'{name}.json')) as f:
    return json.load(f)


def _logits_program(model, max_len):
  """`logits(params, tokens)`: the model's logits (float64 numpy) on
  (batch, len <= max_len) tokens. One jitted function: compiled once per
  tokens' shape, whatever the parameters (the file's, quantised ones),
  where a function per call compiled each probe again."""
  model = model.clone(max_len=max(model.max_len, max_len))
  fn = jax.jit(lambda p, t: model.apply({'params': p}, t)[0])
  return lambda params, tokens: np.asarray(fn(params, tokens), np.float64)


def _ce(logits, params, windows):
  logp = jax.nn.log_softmax(logits(params, windows[:, :-1]))
  return float(-np.take_along_axis(np.asarray(logp), windows[:, 1:, None],
                                   -1).mean())


def _check_text_measures(checkpoint, tiny_file):
  """The checkpoint's record against plain references: a log-softmax over
  the held-out windows (the file's model and its 4-bit grouped
  quantisation) and each probe scored alone."""
  base = _base(tiny_file)
  loaded = gemma_gguf.load(tiny_file)
  windows = lm_data.heldout_windows(loaded.tokenizer, 4, 16)
  rows = [([loaded.tokenizer.bos_id] + list(loaded.tokenizer.encode(prompt)),
           list(loaded.tokenizer.encode(answer)))
          for prompt, answer in probes.FACTS]
  width = max(len(h) + len(t) for h, t in rows)
  logits = _logits_program(models.create(base.midtrain),
                           max(width, windows.shape[1]))
  assert checkpoint['heldout_ce'] == pytest.approx(
      _ce(logits, loaded.params, windows), abs=1e-4)
  # 4 bits in groups of 32: the quantised model's CE, not the per-channel
  # one's (the setting reaches the quantisation).
  grouped = quantization.fake_quantize(loaded.params, 4, 32)
  assert checkpoint['quant_ce'] == pytest.approx(
      _ce(logits, grouped, windows), abs=1e-4)
  per_channel = _ce(logits, quantization.fake_quantize(loaded.params, 4),
                    windows)
  assert abs(checkpoint['quant_ce'] - per_channel) > 1e-3
  # Each probe scored alone (a batch of one; what follows it in the
  # window is zeros, which a causal model does not see before them).
  logps, known = [], []
  for head, tail in rows:
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(head) + len(tail)] = head + tail
    logp = np.asarray(jax.nn.log_softmax(
        logits(loaded.params, tokens)[0]))
    at = np.arange(len(head) - 1, len(head) + len(tail) - 1)
    logps.append(logp[at, tokens[0, at + 1]].mean())
    known.append(bool(np.all(logp[at].argmax(-1) == tokens[0, at + 1])))
  assert checkpoint['probes']['logprob'] == pytest.approx(np.mean(logps),
                                                          abs=1e-4)
  assert checkpoint['probes']['known'] == np.mean(known)


def _check_spectrum(record, hessian):
  """A sharpness record against its dense Hessian: the ends of the
  spectrum (the largest positive one included) within 2% of its scale,
  Hutchinson's trace within 4 of its standard errors."""
  eigenvalues = np.linalg.eigvalsh(hessian)
  scale = np.abs(eigenvalues).max()
  assert record['lambda_max'] == pytest.approx(eigenvalues[-1],
                                               abs=0.02 * scale)
  assert record['lambda_min'] == pytest.approx(eigenvalues[0],
                                               abs=0.02 * scale)
  assert abs(record['trace'] - np.trace(hessian)) <= 4 * record['trace_stderr']
  assert record['trace_stderr'] < 0.5 * abs(np.trace(hessian)) + 1e-6


# The five tests on `smoke` are slow (the README's command: 51 s, then
# 13 s for the fresh workdir): the fast tests after them call the same
# measure functions on the file's model, without the runs
# (docs/slow_tests.md).
@pytest.mark.slow
def test_the_text_measures_against_plain_references(smoke, tiny_file):
  root, stdout = smoke
  assert open(os.path.join(root, report.REPORT)).read() in stdout
  _check_text_measures(_measure(root, 'mid_checkpoint'), tiny_file)


@pytest.mark.slow
def test_the_sharpness_against_the_dense_hessian(smoke, tiny_file, tmp_path):
  root, _ = smoke
  base = _base(tiny_file)
  config = study_settings.mid_config(base, 'adamw', 0)
  mid = _measure(root, 'sharpness_adamw_seed0')
  trained = lm_trainer.load_trained(study_settings.mid_dir(root, 'adamw', 0))
  exp = lm_trainer.build(config, str(tmp_path / 'h'), check_data=False)
  batch = {'tokens': np.asarray(lm_data.load_windows(
      config.data, 'train', 12345, tokenizer=trained.tokenizer).tokens[:2])}
  params = jax.tree.map(np.asarray, trained.params)
  block, layer, name = MATRIX.split('/')
  flat, unflat = jax.flatten_util.ravel_pytree(params[block][layer][name])

  def sub_loss(x):
    inner = dict(params[block][layer], **{name: unflat(x)})
    p = dict(params, **{block: dict(params[block], **{layer: inner})})
    return exp.per_example(exp.model, {'params': p, 'batch_stats': {}},
                           batch, False)[0].mean()
  hessian = np.asarray(jax.jit(jax.hessian(sub_loss))(flat), np.float64)
  _check_spectrum(mid, hessian)


@pytest.mark.slow
def test_post_training_starts_from_each_mid_trained_model(smoke, tiny_file):
  root, _ = smoke
  leaf = lambda tree: np.asarray(tree['block_1']['mlp']['down']['kernel']
                                 if isinstance(tree['block_1']['mlp']['down'],
                                               dict)
                                 else tree['block_1']['mlp']['down'])
  file = leaf(gemma_gguf.load(tiny_file).params)
  for variant in ('adamw', 'sam_rho0.05'):
    mid = leaf(lm_trainer.load_trained(
        study_settings.mid_dir(root, variant, 0)).params)
    post = sft.load_policy(study_settings.post_dir(root, variant, 0))
    assert not np.array_equal(mid, file)
    np.testing.assert_array_equal(leaf(post.params), mid)
    assert post.config.init_from == study_settings.mid_dir(root, variant, 0)
  checkpoint = sft.load_policy(study_settings.post_dir(root, 'checkpoint', 0))
  np.testing.assert_array_equal(leaf(checkpoint.params), file)
  sam = lm_trainer.load_trained(study_settings.mid_dir(root, 'sam_rho0.05', 0))
  assert sam.config.optimizer.sam.enabled
  assert sam.config.optimizer.sam.rho == 0.05
  records = json.load(open(os.path.join(root, report.RECORDS)))
  assert set(records['post']) == {'checkpoint', 'adamw', 'sam_rho0.05'}
  post = records['post']['adamw']['0']
  mid = records['mid']['adamw']['0']
  assert set(post['pass_at_1']) == {'add_d1', 'add_d2'}
  assert post['heldout_ce'] != mid['heldout_ce']


@pytest.mark.slow
def test_a_rerun_reuses_and_other_settings_are_refused(smoke, tiny_file,
                                                       tmp_path):
  root, stdout = smoke
  base = _base(tiny_file)
  path = os.path.join(root, 'measures', 'post_sam_rho0.05_seed0.json')
  mtime = os.path.getmtime(path)
  assert study.run(SETTINGS, base, root) in stdout
  assert os.path.getmtime(path) == mtime
  with pytest.raises(UsageError, match='other settings'):
    study.run(dataclasses.replace(SETTINGS, group_size=8), base, root)
  assert os.path.getmtime(path) == mtime


@pytest.mark.slow
def test_a_fresh_workdir_resumes_from_the_records_alone(smoke, tiny_file,
                                                        tmp_path):
  # A workdir that kept `measures/` and lost `runs/`: every record is
  # reused (the post-training one too, though its run and the mid-trained
  # run it started from are gone); the missing sharpness needs the
  # mid-trained run again, and only that run.
  root, _ = smoke
  fresh = str(tmp_path / 'study')
  shutil.copytree(os.path.join(root, 'measures'),
                  os.path.join(fresh, 'measures'))
  redo = ('sharpness_sam_rho0.05_seed0',)
  for name in redo:
    os.remove(os.path.join(fresh, 'measures', f'{name}.json'))
  kept = {name: os.path.getmtime(os.path.join(fresh, 'measures', name))
          for name in os.listdir(os.path.join(fresh, 'measures'))}
  # (Its report is not compared: the tiny models' sharpness values are
  # within float32 rounding of each other, so a rank can flip.)
  text = study.run(SETTINGS, _base(tiny_file), fresh)
  assert text == open(os.path.join(fresh, report.REPORT)).read()
  assert os.listdir(os.path.join(fresh, 'runs')) == ['mid_sam_rho0.05_seed0']
  for name, mtime in kept.items():
    assert os.path.getmtime(os.path.join(fresh, 'measures', name)) == mtime
  for name in redo:
    # The retrained run is the first one (to float32 rounding: the first
    # ran in another process, compiled alone).
    again, first = _measure(fresh, name), _measure(root, name)
    assert again['identity'] == first['identity']
    assert jax.tree.structure(again) == jax.tree.structure(first)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(first)):
      assert a == (pytest.approx(b, rel=1e-5, abs=1e-6)
                   if isinstance(b, float) else b)


def test_the_checkpoints_text_measures_are_reused_and_refused(tiny_file,
                                                            tmp_path):
  """The measures of `test_the_text_measures_against_plain_references`
  (slow), by the study's own function on the file's model: its record
  against the plain references; a second call reuses it, other settings
  are refused."""
  base, root = _base(tiny_file), str(tmp_path / 'study')
  checkpoint = measure.measure_mid(SETTINGS, base, root,
                                   study_settings.CHECKPOINT, 0)
  _check_text_measures(checkpoint, tiny_file)
  assert set(checkpoint['pass_at_1']) == {'add_d1', 'add_d2'}
  path = os.path.join(root, 'measures', 'mid_checkpoint.json')
  mtime = os.path.getmtime(path)
  assert measure.measure_mid(SETTINGS, base, root, study_settings.CHECKPOINT,
                             0) == checkpoint
  with pytest.raises(UsageError, match='other settings'):
    measure.measure_mid(dataclasses.replace(SETTINGS, group_size=8), base,
                        root, study_settings.CHECKPOINT, 0)
  assert os.path.getmtime(path) == mtime


# The fast sharpness test trains one 512-parameter matrix (its dense
# Hessian: 512 Hessian-vector products, a quarter of MATRIX's).
FAST_MATRIX = ('block_1', 'attention', 'key')


def test_the_checkpoints_sharpness_against_the_dense_hessian(tiny_file,
                                                              tmp_path):
  """measure.sharpness (Lanczos' ends of the spectrum, Hutchinson's trace)
  at the file's model against the dense Hessian of the mid-training loss
  in the trained matrix (what the slow test checks at the trained one)."""
  base = _base(tiny_file)
  base.midtrain.optimizer.frozen = f'^(?!{"/".join(FAST_MATRIX)}$)'
  config = study_settings.mid_config(base, 'adamw', 0)
  loaded = gemma_gguf.load(tiny_file)
  params = jax.tree.map(np.asarray, loaded.params)
  got = measure.sharpness(SETTINGS, config, params, loaded.tokenizer,
                          str(tmp_path / 's'))
  exp = lm_trainer.build(config, str(tmp_path / 'h'), check_data=False)
  batch = {'tokens': np.asarray(lm_data.load_windows(
      config.data, 'train', 12345, tokenizer=loaded.tokenizer).tokens[:2])}
  a, b, c = FAST_MATRIX

  def sub_loss(x):
    p = dict(params, **{a: dict(params[a], **{b: dict(params[a][b],
                                                          **{c: x})})})
    return exp.per_example(exp.model, {'params': p, 'batch_stats': {}},
                           batch, False)[0].mean()
  hessian = np.asarray(jax.jit(jax.hessian(sub_loss))(params[a][b][c]),
                       np.float64).reshape(params[a][b][c].size, -1)
  _check_spectrum(got, hessian)


def test_each_run_starts_where_the_study_says(tiny_file):
  """The chain of runs, as configs: post-training starts from its
  mid-trained run (the checkpoint's from the file), the SAM variant's
  mid-training has SAM at its radius. (That init_from starts SFT from
  the run's weights: test_gemma_training's
  test_sft_post_trains_an_lm_run_and_pins_it_by_content.)"""
  base, root = _base(tiny_file), '/w'
  for variant in ('adamw', 'sam_rho0.05'):
    post = study_settings.post_config(base, root, variant, 0)
    assert post.init_from == study_settings.mid_dir(root, variant, 0)
    assert post.optimizer.frozen == POST_FROZEN
  assert study_settings.post_config(base, root, study_settings.CHECKPOINT,
                                    0).init_from is None
  assert not study_settings.mid_config(base, 'adamw', 0).optimizer.sam.enabled
  sam = study_settings.mid_config(base, 'sam_rho0.05', 0)
  assert sam.optimizer.sam.enabled and sam.optimizer.sam.rho == 0.05
  assert base.midtrain.optimizer.sam.enabled is False  # Not changed.


def test_a_run_is_trained_again_only_for_a_missing_record_it_feeds(
    tiny_file, tmp_path, monkeypatch):
  """ensure_midtrained, what a fresh workdir resumes with (the slow test
  test_a_fresh_workdir_resumes_from_the_records_alone): with the post and
  sharpness records there, the run is not trained again; with one of
  them missing and no checkpoint, it is, into its own directory."""
  trained = []
  monkeypatch.setattr(measure.lm_trainer, 'train_and_evaluate',
                      lambda config, workdir: trained.append(
                          (config.optimizer.sam.enabled, workdir)))
  base, root = _base(tiny_file), str(tmp_path / 'study')
  os.makedirs(os.path.join(root, 'measures'))
  for name in ('post_sam_rho0.05_seed0', 'sharpness_sam_rho0.05_seed0'):
    open(os.path.join(root, 'measures', f'{name}.json'), 'w').close()
  measure.ensure_midtrained(SETTINGS, base, root, 'sam_rho0.05', 0)
  assert not trained
  os.remove(os.path.join(root, 'measures',
                         'sharpness_sam_rho0.05_seed0.json'))
  measure.ensure_midtrained(SETTINGS, base, root, 'sam_rho0.05', 0)
  assert trained == [(True, study_settings.mid_dir(root, 'sam_rho0.05', 0))]


STORED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'studies', 'gemma_midtraining', 'results', 'measures')


def _stored_identity(name, base, root):
  """What study.run would record as `name`'s identity with config.py and
  the flags' defaults (workdir `root`)."""
  kind, _, model = name.partition('_')
  settings = study_settings.Settings()
  if model == study_settings.CHECKPOINT:
    variant, seed = study_settings.REFERENCE, 0
  else:
    variant, seed = model.rsplit('_seed', 1)
    seed = int(seed)
  config = (study_settings.post_config(base, root, variant, seed)
            if kind == 'post' else
            study_settings.mid_config(base, variant, seed))
  return measure._identity(  # pylint: disable=protected-access
      settings, config, root,
      measure._SHARPNESS if kind == 'sharpness' else measure._TEXT)  # pylint: disable=protected-access


def test_the_stored_records_are_config_pys_on_the_registry_file():
  # results/measures/ is what a fresh workdir resumes from (README): each
  # record's identity must be what the README's command would record, or
  # the command refuses it.
  base = study_config.get_config()
  names = sorted(n[:-len('.json')] for n in os.listdir(STORED))
  assert 'mid_checkpoint' in names
  for name in names:
    with open(os.path.join(STORED, f'{name}.json')) as f:
      record = json.load(f)
    assert record['identity'] == _stored_identity(name, base, '/w'), name
    assert 'heldout_ce' in record or 'lambda_max' in record, name


def test_the_stored_report_rebuilds_from_its_measures(tmp_path):
  # results/midtraining.md and .json are what the README and RESULTS.md
  # quote: they must be the report of the stored measures, byte for byte.
  mids, posts = report.records(STORED, study_settings.Settings())
  report.write(str(tmp_path), mids, posts)
  for name in (report.REPORT, report.RECORDS):
    with open(os.path.join(os.path.dirname(STORED), name), 'rb') as f:
      assert (tmp_path / name).read_bytes() == f.read(), name


def _bad(base, field, value):
  node = base
  *parents, leaf = field.split('.')
  for p in parents:
    node = node[p]
  node[leaf] = value
  return base


@pytest.mark.parametrize('field, value, match', [
    ('midtrain.optimizer.sam.enabled', True, 'midtrain.optimizer.sam'),
    ('posttrain.optimizer.sam.enabled', True, 'posttrain.optimizer.sam'),
    ('posttrain.model.gguf', '/elsewhere.gguf', 'posttrain.model.gguf'),
    ('posttrain.init_from', '/some/run', 'posttrain.init_from'),
    ('midtrain.task', 'rl_sft', 'midtrain.task'),
])
def test_a_bad_config_is_refused_before_anything(tiny_file, tmp_path, field,
                                                 value, match):
  root = tmp_path / 'study'
  with pytest.raises(UsageError, match=match):
    study.run(SETTINGS, _bad(_base(tiny_file), field, value), str(root))
  assert not root.exists()


@pytest.mark.parametrize('change, flag', [
    (dict(rhos=()), '--rhos'), (dict(rhos=(0.1, 0.1)), '--rhos'),
    (dict(bits=9), '--bits'), (dict(group_size=-1), '--group_size'),
    (dict(trace_probes=-1), '--trace_probes'),
    (dict(lanczos_steps=-1), '--lanczos_steps'),
    (dict(sharpness_windows=0), '--sharpness_windows')])
def test_bad_settings_name_their_flag(tiny_file, tmp_path, change, flag):
  root = tmp_path / 'study'
  with pytest.raises(UsageError, match=flag):
    study.run(dataclasses.replace(SETTINGS, **change), _base(tiny_file),
              str(root))
  assert not root.exists()


def _mid(variant, seed, ce, quant, lam, probe=-2.0):
  return dict(variant=variant, seed=seed, heldout_ce=ce, quant_ce=quant,
              probes=dict(logprob=probe, known=0.5),
              quant_probes=dict(logprob=probe - 0.1, known=0.4),
              lambda_max=lam, trace=10 * lam, final_train_loss=1.0)


def _post(variant, seed, ce):
  return dict(variant=variant, seed=seed, heldout_ce=ce,
              probes=dict(logprob=-2.5, known=0.25), answer_ce=0.2,
              pass_at_1={'add_d1': 1.0})


def test_the_report_pairs_seeds_against_adamw_and_the_checkpoint():
  checkpoint = dict(_mid('checkpoint', None, 3.0, 3.5, 30.0),
                    pass_at_1={'add_d1': 0.25})
  del checkpoint['final_train_loss']  # Not trained.
  mids = {'checkpoint': {0: checkpoint, 1: checkpoint},
          'adamw': {0: _mid('adamw', 0, 2.9, 3.3, 20.0),
                    1: _mid('adamw', 1, 2.8, 3.2, 25.0)},
          'sam_rho0.1': {0: _mid('sam_rho0.1', 0, 2.9, 3.1, 10.0),
                         1: _mid('sam_rho0.1', 1, 2.8, 3.2, 12.0)}}
  posts = {'checkpoint': {0: _post('checkpoint', 0, 3.6),
                          1: _post('checkpoint', 1, 3.5)},
           'adamw': {0: _post('adamw', 0, 3.3), 1: _post('adamw', 1, 3.2)},
           'sam_rho0.1': {0: _post('sam_rho0.1', 0, 3.1),
                          1: _post('sam_rho0.1', 1, 3.3)}}
  # Post: adamw forgets 0.4 / 0.4, SAM 0.2 / 0.5: reductions 50% and
  # -25%; 4-bit: adamw 0.4 / 0.4, SAM 0.2 / 0.4: 50% and 0%.
  assert report.reductions(mids, posts, 'sam_rho0.1', 'adamw', 'post') == (
      pytest.approx([0.5, -0.25]))
  assert report.reductions(mids, posts, 'sam_rho0.1', 'adamw', 'quant') == (
      pytest.approx([0.5, 0.0]))
  # Against the checkpoint (forgot 0.6 / 0.5 and 0.5 / 0.5).
  assert report.reductions(mids, posts, 'adamw', 'checkpoint', 'post') == (
      pytest.approx([1 / 3, 0.2]))
  text = report.summarize(mids, posts)
  assert ('- sam_rho0.1, post-training: reduction against adamw 1'
          ) in text  # 12.5 ± 53%, rounded either way.
  # t interval: 12.5 ± 12.706 * 53.03 / sqrt(2) and 25 ± 12.706 * 35.36
  # / sqrt(2) (t_{0.975} with 1 degree of freedom: 12.706).
  assert ('± 53% (per seed: +50%, -25%; seeds where adamw forgot: 2; 95% '
          't-interval [-464%, 489%]); paper 31%.') in text
  assert ('- sam_rho0.1, 4-bit quantisation: reduction against adamw '
          '25 ± 35% (per seed: +50%, +0%; seeds where adamw forgot: 2; 95% '
          't-interval [-293%, 343%]); paper 40%.') in text
  assert '| adamw | 0.4000 ± 0.0000 | - | 27 ± 9% |' in text
  assert ('| checkpoint | 3.0000 | -2.000 | 50.0 | 3.00e+01 | - | 3.00e+02 | '
          '- | - |' in text)
  assert '| checkpoint, before post-training | - | 25.0 |' in text
  assert 'Spearman' in text and 'over 6 models' in text
  # A reference that did not forget gives no reduction, not a division.
  posts['adamw'][1] = _post('adamw', 1, 2.7)
  assert len(report.reductions(mids, posts, 'sam_rho0.1', 'adamw',
                               'post')) == 1
