"""End-to-end training in the small mode, in process: outputs, accuracy, non-finite policies."""

import glob
import json
import os

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import digits
from train.run import checkpointing
from train.training import optim
from train.errors import NonFiniteLossError
from train.vision import datasets
from train.vision import experiment
from train.vision import trainer


@pytest.fixture(scope='module')
def finished_run(digits_runlocal_run):
  return (digits.get_config('runlocal'),) + tuple(digits_runlocal_run)


def test_small_run_learns_and_reports_held_out_test_accuracy(finished_run):
  _, _, final = finished_run
  assert final['step'] == 40
  # 40 steps of 64 images: far above chance (0.1) on the 360 test images.
  assert final['test_accuracy'] > 0.85
  assert 0 < final['test_loss'] < 1.0


def _cnn_logits(variables, images, pixel_max):
  """`train.vision.models.CNN` in evaluation mode, in float64 numpy."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), variables['params'])
  stats = jax.tree.map(lambda x: np.asarray(x, np.float64),
                       variables['batch_stats'])

  def batch_norm(x, name):  # Flax's default epsilon.
    s = stats[name]
    return ((x - s['mean']) / np.sqrt(s['var'] + 1e-5) * p[name]['scale']
            + p[name]['bias'])

  x = images.astype(np.float64) / pixel_max
  n, h, w, _ = x.shape
  for i in range(sum(name.startswith('conv') for name in p)):
    kernel = p[f'conv{i}']['kernel']  # (3, 3, in, out), 'SAME' padding.
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    x = sum(padded[:, a:a + h, b:b + w] @ kernel[a, b]
            for a in range(3) for b in range(3))
    x = np.maximum(batch_norm(x, f'bn{i}'), 0)
  assert h % 2 == 0 and w % 2 == 0  # 2x2 pooling needs no padding then.
  x = x.reshape(n, h // 2, 2, w // 2, 2, -1).mean(axis=(2, 4)).reshape(n, -1)
  x = x @ p['hidden']['kernel'] + p['hidden']['bias']
  x = np.maximum(batch_norm(x, 'bn_hidden'), 0)
  return x @ p['head']['kernel'] + p['head']['bias']


def _check_test_metrics_against_the_checkpoint(config, workdir, final):
  """The logged test metrics, recomputed from the last checkpoint in numpy
  over the whole test split at once (no batches, padding or mesh)."""
  state = _restore_all(config, workdir)[final['step']]
  spec = datasets.get_spec(config.dataset)
  test = datasets.load_split(config.dataset, 'test', config.data_dir)
  logits = _cnn_logits(
      jax.device_get({'params': state.params,
                      'batch_stats': state.batch_stats}),
      test.images, spec.pixel_max)
  top = logits.max(axis=1, keepdims=True)
  log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
  loss = np.mean(log_z - logits[np.arange(len(test)), test.labels])
  correct = int(np.sum(logits.argmax(axis=1) == test.labels))
  assert round(final['test_accuracy'] * len(test)) == correct
  np.testing.assert_allclose(final['test_accuracy'], correct / len(test),
                             rtol=1e-6)
  np.testing.assert_allclose(final['test_loss'], loss, rtol=1e-5)


def test_logged_test_metrics_equal_a_recomputation_from_the_checkpoint(
    finished_run):
  config, workdir, final = finished_run
  _check_test_metrics_against_the_checkpoint(config, workdir, final)


def test_outputs_in_the_workdir(finished_run):
  config, workdir, final = finished_run
  records = [json.loads(l) for l in open(os.path.join(workdir,
                                                      'metrics.jsonl'))]
  assert all(isinstance(r['step'], int) for r in records)
  assert all(isinstance(v, float) for r in records for k, v in r.items()
             if k != 'step')
  train_steps = [r['step'] for r in records if 'train_loss' in r]
  assert train_steps == list(range(config.log_every, 41, config.log_every))
  assert [r['step'] for r in records if 'val_accuracy' in r] == [20, 40]
  assert records[-1]['test_accuracy'] == final['test_accuracy']
  assert glob.glob(os.path.join(workdir, 'tensorboard', 'events.out.*'))
  with open(os.path.join(workdir, 'curves.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  ckpts = checkpointing.Checkpoints(workdir, every_steps=20, keep=3)
  assert ckpts.all_steps() == [20, 40]
  ckpts.close()
  with open(os.path.join(workdir, trainer.FINAL_METRICS)) as f:
    assert json.load(f) == final


def test_logged_learning_rate_is_the_schedules(finished_run):
  config, workdir, _ = finished_run
  schedule = optim.learning_rate_schedule(config.optimizer, config.num_steps)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    logged = [json.loads(l) for l in f]
  logged = [r for r in logged if 'learning_rate' in r]
  assert len(logged) == config.num_steps // config.log_every
  for r in logged:
    np.testing.assert_allclose(r['learning_rate'],
                               float(schedule(r['step'] - 1)), rtol=1e-5)


def test_a_finished_run_is_not_trained_again(finished_run):
  config, workdir, final = finished_run
  before = open(os.path.join(workdir, 'metrics.jsonl')).read()
  assert trainer.train_and_evaluate(config, workdir) == final
  assert open(os.path.join(workdir, 'metrics.jsonl')).read() == before


def _restore_all(config, workdir):
  exp = experiment.build(config, workdir)
  ckpts = checkpointing.Checkpoints(workdir, every_steps=1, keep=10)
  out = {s: ckpts.restore(s, exp.abstract_state)[0] for s in ckpts.all_steps()}
  ckpts.close()
  return out


def _diverging(config):
  """A learning rate that drives the loss to inf/NaN within a few steps."""
  config.optimizer.learning_rate = 1e30
  config.optimizer.warmup_steps = 0
  config.optimizer.schedule = 'constant'
  return config


def test_nonfinite_loss_stops_naming_the_step_and_saves_nothing_bad(
    digits_config, tmp_path):
  config = _diverging(digits_config)
  config.checkpoint_every = 1  # Any non-finite state would be saved at once.
  with pytest.raises(NonFiniteLossError) as info:
    trainer.train_and_evaluate(config, str(tmp_path))
  bad = info.value.step
  assert f'at step {bad}' in str(info.value)
  saved = _restore_all(config, str(tmp_path))
  assert max(saved) <= bad  # Nothing saved after the bad step ...
  for state in saved.values():  # ... and everything saved is finite.
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(
        jax.device_get(state.params)))
  assert not os.path.exists(os.path.join(tmp_path, trainer.FINAL_METRICS))


def test_nonfinite_skip_policy_keeps_the_last_finite_parameters(
    digits_config, tmp_path):
  config = _diverging(digits_config)
  config.nonfinite = 'skip'
  config.num_steps = 10
  config.log_every = 5
  config.eval_every = 5
  trainer.train_and_evaluate(config, str(tmp_path))
  final = _restore_all(config, str(tmp_path))[10]
  assert int(final.skipped_steps) > 0
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(
      jax.device_get(final.params)))
  records = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  assert records[-2]['skipped_steps'] == int(final.skipped_steps)


def test_standard_tfds_name_trains_end_to_end_under_mock_data(
    digits_config, tmp_path):
  config = digits_config
  config.dataset = 'mnist'
  config.data_dir = str(tmp_path / 'tfds')
  (tmp_path / 'tfds').mkdir()  # A data_dir must exist (none is created).
  config.num_steps = 4
  config.optimizer.warmup_steps = 1
  config.log_every = config.eval_every = config.checkpoint_every = 2
  config.eval_batch_size = 48  # 128 test examples: the last batch is padded.
  with tfds.testing.mock_data(num_examples=128):
    final = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
    assert final['step'] == 4
    # Random labels: the accuracy is near chance, so check how it was
    # computed instead.
    _check_test_metrics_against_the_checkpoint(config, str(tmp_path / 'run'),
                                               final)
