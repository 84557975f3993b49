"""The SAM paper's recipes as configs (configs/wrn_cifar10.py,
configs/resnet50_imagenet.py): the full-size runs built without data or
compute (shapes, parameter counts, shardings), and each `runlocal` trained
through the real trainer."""

import json
import os
import subprocess

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import resnet50_imagenet
from configs import wrn_cifar10
from tests import launch_runs
from train.errors import ConfigError
from train.vision import datasets
from train.vision import experiment
from train.vision import loss
from train.vision import trainer

RECIPES = {'wrn_cifar10': wrn_cifar10, 'resnet50_imagenet': resnet50_imagenet}


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize('name,parameters,steps', [
    # 200 epochs of 45,000 // 256 batches; 100 epochs of 1,268,355 // 4096.
    ('wrn_cifar10', 36_479_194, 200 * 175),
    ('resnet50_imagenet', 25_557_032, 100 * 309),
])
def test_full_size_run_builds_from_shapes_alone(name, parameters, steps,
                                                tmp_path):
  config = RECIPES[name].get_config()
  assert config.num_steps == steps
  # The data check opens every split: TFDS's mock stands in for the files.
  with tfds.testing.mock_data(num_examples=2):
    exp = experiment.build(config, str(tmp_path))
  assert _count(exp.abstract_state.params) == parameters
  assert exp.hooks.name == 'sam'
  assert dict(exp.mesh.shape) == {'data': 8, 'model': 1}
  # SAM's momentum follows each parameter, sharded as it is.
  assert _count(exp.abstract_state.opt_state) >= parameters


@pytest.mark.parametrize('name', sorted(RECIPES))
def test_channels_can_be_split_over_the_model_axis(name, tmp_path):
  config = RECIPES[name].get_config()
  config.mesh.shape = (4, 2)
  with tfds.testing.mock_data(num_examples=2):
    exp = experiment.build(config, str(tmp_path))
  params = exp.abstract_state.params
  kernel = (params['group2_block0']['conv2']['kernel']
            if name == 'wrn_cifar10'
            else params['stage3_block0']['conv2']['kernel'])
  assert kernel.sharding.spec == P(None, None, None, 'model')
  assert exp.batch_sharding.spec == P('data')


def test_the_recipes_are_the_paper_s():
  wrn, r50 = wrn_cifar10.get_config(), resnet50_imagenet.get_config()
  for config in (wrn, r50):
    opt = config.optimizer
    assert (opt.name, opt.momentum, opt.nesterov, opt.schedule,
            opt.warmup_steps) == ('momentum', 0.9, True, 'cosine', 0)
    assert (opt.weight_decay_mode, opt.grad_clip_norm) == ('l2', 5.0)
    assert opt.sam.enabled and opt.sam.rho == 0.05
    assert config.model.dtype == 'bfloat16'
  assert (wrn.dataset, wrn.augmentation, wrn.batch_size) == (
      'cifar10', 'crop_flip', 256)
  assert (wrn.model.depth, wrn.model.widen_factor) == (28, 10)
  assert (wrn.optimizer.learning_rate, wrn.optimizer.weight_decay) == (0.1,
                                                                       5e-4)
  assert (r50.dataset, r50.augmentation, r50.batch_size) == (
      'imagenet2012', 'inception', 4096)
  assert tuple(r50.model.stage_sizes) == (3, 4, 6, 3)
  assert (r50.optimizer.learning_rate, r50.optimizer.weight_decay) == (1.0,
                                                                       1e-4)
  assert r50.label_smoothing == 0.1 and 'label_smoothing' not in wrn


def test_label_smoothing_reaches_the_training_loss_only(tmp_path):
  # The run's per-example loss against the loss function called directly:
  # smoothed in training, plain in evaluation.
  config = resnet50_imagenet.get_config('runlocal')
  exp = experiment.build(config, str(tmp_path))
  variables = jax.tree.map(
      np.asarray, nn.meta.unbox(exp.init_variables(jax.random.key(0))))
  rng = np.random.default_rng(0)
  batch = {'image': rng.integers(0, 256, (4, 28, 28, 1), np.uint8),
           'label': rng.integers(0, 10, (4,), np.int32)}
  # Jitted, as the trainer runs them (op by op, the ResNet took 48 s).
  per_example = jax.jit(exp.per_example, static_argnums=(0, 3))
  direct = jax.jit(loss.classification_loss, static_argnums=(0, 3),
                   static_argnames='label_smoothing')
  for train, smoothing in ((True, 0.1), (False, 0.0)):
    got = per_example(exp.model, variables, batch, train)[0]
    want = direct(exp.model, variables, batch, train,
                  label_smoothing=smoothing)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
  plain = direct(exp.model, variables, batch, True)[0]
  assert not np.allclose(per_example(exp.model, variables, batch, True)[0],
                         plain)


def test_training_batches_are_the_configured_views():
  config = wrn_cifar10.get_config('runlocal')
  config.seed = 4
  data = trainer.load_data(config)
  assert isinstance(data.train, datasets.CropFlipSplit)
  assert data.train.seed == 4
  assert isinstance(data.validation, datasets.ArraySplit)
  config.augmentation = 'none'
  assert isinstance(trainer.load_data(config).train, datasets.ArraySplit)


# Both runs are slow (resnet50_imagenet's 65 s, wrn_cifar10's 29 s of the
# suite on 2 cores). Their parts run by default: the recipes' data views
# (test_training_batches_are_the_configured_views), the models
# (test_vision_models), the full-size jobs built
# (test_full_size_run_builds_from_shapes_alone), the loss
# (test_label_smoothing_reaches_the_training_loss_only) and SAM learning
# through the same trainer on digits (test_sam_trainer.py's
# test_sam_run_logs_its_diagnostics_and_warm_start).
#
# The run is `python -m launch.train` (the real trainer, as the configs'
# docstrings run it), in its own process for one reason: there its
# programs are compiled at LLVM level 1, not at the suite's level 0
# (tests/conftest.py). The WRN's 40 SAM steps are where the level-0
# programs' speed is felt: the run took 46-50 s of CPU at level 0 (in this
# process or a launcher's; 30 s of it running the steps), 26 s at level 1,
# 28 s at level 2 and 54 s at XLA's default (3; slower compiles). What the
# test checks holds at any level (conftest's note).
@pytest.fixture(scope='module', params=[
    pytest.param(name, marks=pytest.mark.slow) for name in sorted(RECIPES)])
def smoke_run(request, tmp_path_factory):
  config = RECIPES[request.param].get_config('runlocal')
  workdir = str(tmp_path_factory.mktemp(request.param) / 'run')
  env = dict(os.environ)
  env['XLA_FLAGS'] = ' '.join(
      [f for f in env.get('XLA_FLAGS', '').split()
       if not f.startswith('--xla_backend_optimization_level=')]
      + ['--xla_backend_optimization_level=1'])
  proc = subprocess.run(
      launch_runs.command(workdir,
                          config=f'configs/{request.param}.py:runlocal'),
      cwd=launch_runs.REPO_ROOT, env=env, capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(workdir, trainer.FINAL_METRICS)) as f:
    return config, workdir, json.load(f)


def test_runlocal_trains_the_recipe_and_learns(smoke_run):
  config, workdir, final = smoke_run
  assert final['step'] == config.num_steps == 40
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  losses = [r['train_loss'] for r in records if 'train_loss' in r]
  assert len(losses) == 4 and losses[-1] < 0.85 * losses[0]
  # SAM ran: its statistics are logged.
  assert any(k.startswith('opt/') for r in records for k in r)
  assert final['test_accuracy'] > 0.25  # 10 classes: chance is 0.1.


@pytest.mark.parametrize('field,value,match', [
    ('augmentation', 'inception',
     r"config.augmentation='inception': not an augmentation of"),
    ('model.dtype', 'float16', r"config.model.dtype='float16'"),
    ('model.depth', 26, r'config.model.depth=26'),
    ('label_smoothing', 1.0, r'config.label_smoothing=1.0: .*\[0, 1\)'),
])
def test_a_bad_setting_fails_before_the_workdir_is_touched(field, value,
                                                           match, tmp_path):
  config = wrn_cifar10.get_config('runlocal')
  section, _, key = field.rpartition('.')
  (config[section] if section else config)[key] = value
  with pytest.raises(ConfigError, match=match):
    trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
