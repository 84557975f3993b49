"""Gemma on the shared loop: fine-tuning (AdamW, SAM, frozen embedding),
SFT on the tasks and GRPO with it as the policy, on a small Gemma 3 GGUF
file (tests/tiny_gemma.py) that runs the whole path in seconds; the real
270M file's run is `slow` (test_a_real_gemma_fine_tunes_and_serves_grpo)."""

import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import pytest

from configs import gemma as gemma_config
from configs import rl_sft
from tests import launch_runs
from tests import tiny_gemma
from train.training import optim
from train.errors import ConfigError
from train.errors import UsageError
from train.lm import gemma_gguf
from train.lm import models
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.rl import sft
from train.rl import tasks


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  return tiny_gemma.model_file(tmp_path_factory.mktemp('tiny') / 'g.gguf')


def _sft_config(path, **optimizer):
  config = tiny_gemma.gemma_config(path, 'sft')
  config.batch_size = config.eval_batch_size = 8  # 8 simulated devices.
  config.optimizer.update(optimizer)
  return config


@pytest.fixture(scope='module')
def sft_run(tiny_file, tmp_path_factory):
  """A finished SFT run on the small file, its first block and embedding
  frozen."""
  workdir = str(tmp_path_factory.mktemp('sft'))
  config = _sft_config(tiny_file, frozen='^(embedding|block_0/)')
  final = sft.train_and_evaluate(config, workdir)
  return workdir, config, final


def _leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_sft_starts_from_the_file_and_trains_only_what_is_not_frozen(
    sft_run, tiny_file):
  workdir, config, final = sft_run
  pretrained = _leaves(gemma_gguf.load(tiny_file).params)
  policy = sft.load_policy(workdir)
  trained = _leaves(policy.params)
  assert set(trained) == set(pretrained)
  for path, value in trained.items():
    frozen = "['embedding']" in path or "['block_0']" in path
    # Frozen: the file's values, bit for bit (so it started from them).
    assert np.array_equal(value, pretrained[path]) == frozen, path
  # The tokens are the file's tokenizer's, kept in the workdir and pinned.
  tokenizer = gemma_gguf.read_tokenizer(tiny_file)
  assert policy.codec is tasks.codec(tokenizer)
  with open(os.path.join(workdir, lm_tokenizer.FILENAME), 'rb') as f:
    assert f.read() == tokenizer.model_proto
  assert set(json.load(open(os.path.join(workdir, sft.PASS_AT_1)))) == {
      'add_d1', 'add_d2'}
  assert np.isfinite(final['val_loss'])


def test_frozen_parameters_hold_no_optimizer_state(tiny_file, tmp_path):
  frozen = sft.build(_sft_config(tiny_file, frozen='^embedding$'),
                     str(tmp_path))
  full = sft.build(_sft_config(tiny_file), str(tmp_path))
  size = lambda state: sum(x.size for x in jax.tree.leaves(state.opt_state))
  embedding = tiny_gemma.SHAPE.vocab_size * tiny_gemma.SHAPE.d_model
  # AdamW keeps two moments per trained parameter.
  assert size(full.abstract_state) - size(frozen.abstract_state) == (
      2 * embedding)


def test_the_loss_sees_frozen_parameters_as_constants(tiny_file, tmp_path):
  """Their gradient is zero, so SAM (which perturbs along the gradient of
  the same loss) and the optimizer leave them alone; the others get
  theirs."""
  config = _sft_config(tiny_file, frozen='^(embedding|final_norm)')
  exp = sft.build(config, str(tmp_path))
  params = gemma_gguf.load(tiny_file).params
  tokens = np.tile(np.arange(3, 3 + sft.sequence_length(config.data) + 1),
                   (2, 1)).astype(np.uint32)
  batch = {'tokens': tokens,
           'loss_mask': np.ones((2, tokens.shape[1] - 1), np.uint8)}
  # Under jit: one compile, where op-by-op took 10 s.
  grads = jax.jit(jax.grad(lambda p: exp.per_example(
      exp.model, {'params': p, 'batch_stats': {}}, batch, True)[0].mean()))(
          params)
  for path, g in _leaves(grads).items():
    frozen = "['embedding']" in path or "['final_norm']" in path
    assert (np.abs(g).max() == 0) == frozen, path


@pytest.mark.parametrize('pattern, message', [
    ('^nothing$', 'matches no parameter'),
    ('.', 'matches every parameter'),
    ('(', 'not a regular expression'),
])
def test_a_bad_frozen_pattern_is_one_line(tiny_file, tmp_path, pattern,
                                          message):
  with pytest.raises(ConfigError, match=f'optimizer.frozen.*{message}'):
    sft.build(_sft_config(tiny_file, frozen=pattern), str(tmp_path))


@pytest.fixture(scope='module')
def sam_run(tiny_file, tmp_path_factory):
  """(workdir, config) of a finished SAM fine-tune (LM) run of a copy of
  the small file (its own, so a test may replace it), its embedding
  frozen: its own test's, the pinned file's refusal's, and the other LM
  run that replaces a source below."""
  root = tmp_path_factory.mktemp('sam')
  path = str(root / 'model.gguf')
  shutil.copy(tiny_file, path)
  config = tiny_gemma.gemma_config(path, 'finetune')
  config.batch_size = config.eval_batch_size = 8
  config.optimizer.frozen = '^embedding$'
  config.optimizer.sam.enabled = True
  workdir = str(root / 'ft')
  lm_trainer.train_and_evaluate(config, workdir)
  return workdir, config


def test_sam_with_a_frozen_embedding_leaves_it_in_place(tiny_file, sam_run):
  """SAM perturbs along the gradient: a frozen parameter gets none, so
  neither its perturbation nor its update moves it, while SAM runs (its
  diagnostics are logged) and the others train."""
  workdir, _ = sam_run
  trained = lm_trainer.load_trained(workdir).params
  pretrained = gemma_gguf.load(tiny_file).params
  assert np.array_equal(trained['embedding'], pretrained['embedding'])
  assert not np.array_equal(trained['block_1']['mlp']['up'],
                            pretrained['block_1']['mlp']['up'])
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    logged = [json.loads(line) for line in f]
  assert any(k.startswith('opt/') for r in logged for k in r), logged[0]


def test_a_finished_fine_tune_refuses_another_file_at_its_path(sam_run,
                                                              tmp_path):
  """A fine-tune pins its GGUF file by content: another model written at
  the same path is refused in one line naming both fingerprints, before
  the finished run is reported as this one's (in process, on a copy of
  the SAM run; the launcher's own run of it is the slow test below)."""
  workdir, config = sam_run
  copy = str(tmp_path / 'ft')
  shutil.copytree(workdir, copy)
  path = config.model.gguf
  with open(path, 'rb') as f:
    original = f.read()
  tiny_gemma.model_file(path, seed=1)
  try:
    with pytest.raises(UsageError) as refused:
      lm_trainer.train_and_evaluate(config, copy)
  finally:
    with open(path, 'wb') as f:  # The module's other tests read this run.
      f.write(original)
  line = str(refused.value)
  assert '\n' not in line, line
  assert line.startswith("model.gguf='gguf-sha256:"), line
  assert ': differs from gguf-sha256:' in line
  # Nothing in the workdir was rewritten.
  final = lambda d: open(os.path.join(d, 'final_metrics.json')).read()
  assert final(copy) == final(workdir)


# The launcher's fine-tune (a subprocess, 11 s): its refusal of another
# file is the test above's, in process; the launcher reading a Gemma
# config is test_gemma_gguf's (docs/slow_tests.md).
@pytest.mark.slow
def test_launch_train_fine_tunes_pins_the_file_and_refuses_another(
    tiny_file, tmp_path):
  path = str(tmp_path / 'model.gguf')
  shutil.copy(tiny_file, path)
  workdir = str(tmp_path / 'run')
  args = ['--config=configs/gemma.py:finetune,runlocal,frozen',
          f'--config.model.gguf={path}', '--config.model.shape=gguf',
          '--config.batch_size=4', '--config.eval_batch_size=4']
  out = launch_runs.run_module('launch.train', *args,
                            f'--workdir={workdir}')
  assert out.returncode == 0, out.stderr[-2000:]
  final = json.load(open(os.path.join(workdir, 'final_metrics.json')))
  assert final['step'] == gemma_config.get_config(
      'finetune,runlocal').num_steps
  # Another model at the same path: the finished run is not reported as
  # this one's, in one line naming both files' fingerprints.
  tiny_gemma.model_file(path, seed=1)
  out = launch_runs.run_module('launch.train', *args,
                            f'--workdir={workdir}')
  assert out.returncode == 2, out.stderr[-2000:]
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith("error: model.gguf='gguf-sha256:"), line
  assert ': differs from gguf-sha256:' in line


def test_grpo_takes_a_gemma_policy(sft_run, tmp_path):
  workdir = str(tmp_path / 'rl')
  out = launch_runs.run_module(
      'launch.rl', '--config=configs/rl.py:gemma,runlocal',
      f'--config.sft_workdir={sft_run[0]}', f'--workdir={workdir}')
  assert out.returncode == 0, out.stderr[-2000:]
  results = json.load(open(os.path.join(workdir, 'results.json')))
  assert results['versions'] == 2
  assert set(results['pass_at_1']) == {'1', '2'}
  assert results['tokens'] > 0


@pytest.mark.parametrize('change, field', [
    (dict(kind='llama'), 'model.kind'),
    (dict(shape='2b'), 'model.shape'),
    (dict(max_len=0), 'model.max_len'),
    (dict(dtype='float16'), 'model.dtype'),
    (dict(heads=4), 'model.heads'),
    (dict(shape='gguf', gguf='/nonexistent.gguf'), 'model.gguf'),
    (dict(shape='gguf', gguf=''), 'model.shape'),
])
def test_a_bad_model_block_is_one_line_naming_the_field(change, field):
  config = gemma_config.get_config('sft')
  model = config.model.to_dict()
  model.update(change)
  config.model = ml_collections.ConfigDict(model)
  with pytest.raises(ConfigError, match=f'^config\\.{field}'):
    models.create(config)


def test_a_compile_only_shape_is_refused_for_training(tmp_path):
  config = gemma_config.get_config('finetune,shape=1b')
  with pytest.raises(ConfigError,
                     match=r'^config\.model\.shape.*only Gemma 3 270M'):
    models.check_inputs(config)


def test_a_pretrained_vocabulary_is_stored_in_uint32():
  assert lm_tokenizer.token_dtype(256) == np.uint8
  assert lm_tokenizer.token_dtype(65_536) == np.uint16
  assert lm_tokenizer.token_dtype(262_144) == np.uint32
  config = gemma_config.get_config('sft')
  assert sft.token_dtype(config) == np.uint32


def test_the_configs_name_their_jobs():
  with pytest.raises(ValueError, match='pick one'):
    gemma_config.get_config('finetune,sft')
  with pytest.raises(ValueError, match='training job'):
    gemma_config.get_config('sam')
  assert gemma_config.get_config('sft,sam').optimizer.sam.enabled
  assert gemma_config.get_config('finetune,frozen').optimizer.frozen == (
      '^embedding$')
  # The frozen pattern matches Gemma's embedding and nothing else.
  params = {'embedding': 0, 'block_0': {'mlp': {'up': 0}},
            'final_norm': {'scale': 0}}
  assert optim.matching(params, '^embedding$') == {
      'embedding': True, 'block_0': {'mlp': {'up': False}},
      'final_norm': {'scale': False}}


@pytest.mark.slow
def test_a_real_gemma_fine_tunes_and_serves_grpo(tmp_path):
  """The registry's 270M through launch.train (SFT, frozen embedding, 4
  steps), then launch.rl from it: both finish and the RL run makes its 2
  versions (what the SFT learns is the forgetting study's to measure)."""
  sft_dir, rl_dir = str(tmp_path / 'sft'), str(tmp_path / 'rl')
  out = launch_runs.run_module(
      'launch.train', '--config=configs/gemma.py:sft,runlocal,frozen',
      f'--workdir={sft_dir}', timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  out = launch_runs.run_module(
      'launch.rl', '--config=configs/rl.py:gemma,runlocal',
      f'--config.sft_workdir={sft_dir}', f'--workdir={rl_dir}', timeout=600)
  # Its estimated peak is 9.1 GiB (8.9 measured, BENCHMARKS.md): on a host
  # with less free (tests beside it), the run is refused in one line
  # before it starts, where it was killed by the kernel before.
  lines = launch_runs.error_lines(out)
  if out.returncode == 2 and lines and 'GiB this host has free' in lines[-1]:
    assert not os.path.exists(rl_dir)
    pytest.skip(lines[-1])
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.load(open(os.path.join(rl_dir, 'results.json')))[
      'versions'] == 2


@pytest.fixture(scope='module')
def lm_runs(tiny_file, sam_run, tmp_path_factory):
  """Two finished LM runs of the small file, its embedding frozen: Gemmas
  continued on text. The first is configs/gemma.py's 'finetune,frozen';
  the second is the SAM run above (any other run of the file serves: a
  third training run cost 8 s)."""
  config = tiny_gemma.gemma_config(tiny_file, 'finetune,frozen')
  config.batch_size = config.eval_batch_size = 8
  workdir = str(tmp_path_factory.mktemp('lm0'))
  lm_trainer.train_and_evaluate(config, workdir)
  return [workdir, sam_run[0]]


def test_sft_post_trains_an_lm_run_and_pins_it_by_content(tiny_file, lm_runs,
                                                          tmp_path):
  # A Gemma continued on text (block_0 trained), then post-trained with
  # block_0 frozen: the policy's block_0 is the LM run's, bit for bit, not
  # the file's.
  lm_a, lm_b = lm_runs
  source = str(tmp_path / 'source')
  shutil.copytree(lm_a, source)
  config = _sft_config(tiny_file, frozen='^(embedding|block_0/)')
  config.init_from = source
  workdir = str(tmp_path / 'sft')
  sft.train_and_evaluate(config, workdir)
  policy = _leaves(sft.load_policy(workdir).params)
  mid = _leaves(lm_trainer.load_trained(lm_a).params)
  file = _leaves(gemma_gguf.load(tiny_file).params)
  block_0 = [p for p in policy if "['block_0']" in p]
  assert block_0
  for path in block_0:
    assert np.array_equal(policy[path], mid[path]), path
  assert any(not np.array_equal(mid[p], file[p]) for p in block_0)
  # The source replaced by another run: a rerun is refused, naming it.
  shutil.rmtree(source)
  shutil.copytree(lm_b, source)
  with pytest.raises(Exception, match='init_from'):
    sft.train_and_evaluate(config, workdir)


def test_sft_refuses_a_source_without_checkpoints_or_of_other_tokens(
    tiny_file, lm_runs, tmp_path):
  config = _sft_config(tiny_file)
  config.init_from = str(tmp_path / 'nothing')
  with pytest.raises(Exception, match='config.init_from.*no checkpoints'):
    sft.train_and_evaluate(config, str(tmp_path / 'a'))
  # A byte-level warm start from a Gemma run: other tokens, one line.
  byte_config = rl_sft.get_config('runlocal')
  byte_config.init_from = lm_runs[0]
  with pytest.raises(ConfigError, match='init_from.*tokenizer'):
    sft.train_and_evaluate(byte_config, str(tmp_path / 'b'))
