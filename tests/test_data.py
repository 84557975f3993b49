"""Data: the offline digits builder, deterministic resumable batches, host slicing, TFDS names."""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
from sklearn.datasets import load_digits
import tensorflow_datasets as tfds

from train.training import input_pipeline
from train.errors import ConfigError
from train.vision import datasets
from train.vision import digits_builder


@pytest.fixture(scope='module')
def digits_splits():
  return {s: datasets.load_split('digits', s, None) for s in datasets.SPLITS}


def test_digits_splits_are_disjoint_complete_and_stratified():
  idx = digits_builder.split_indices()
  all_idx = np.concatenate(list(idx.values()))
  assert len(all_idx) == 1797 and len(np.unique(all_idx)) == 1797
  labels = load_digits().target
  for name, frac in (('test', 0.2), ('validation', 0.1)):
    counts = np.bincount(labels[idx[name]], minlength=10)
    expected = np.round(frac * np.bincount(labels, minlength=10))
    np.testing.assert_array_equal(counts, expected)
  # Fixed on every machine: a second call gives the same split.
  for name, values in digits_builder.split_indices().items():
    np.testing.assert_array_equal(values, idx[name])


def test_prepared_records_are_the_sklearn_images(digits_splits):
  ref = load_digits()
  idx = digits_builder.split_indices()
  for name, data in digits_splits.items():
    assert len(data) == len(idx[name])
    assert data.images.dtype == np.uint8 and data.images.shape[1:] == (8, 8, 1)
    assert data.images.max() == 16
  builder = digits_builder.Digits(data_dir=datasets.resolve_data_dir(None))
  test_source = builder.as_data_source(split='test')
  for k in (0, 17, len(test_source) - 1):
    record = test_source[k]  # Matched to sklearn through its stored index.
    i = int(record['index'])
    np.testing.assert_array_equal(record['image'][..., 0], ref.images[i])
    assert record['label'] == ref.target[i]


def _batches(n=103, batch=8, seed=3, **kw):
  data = datasets.ArraySplit(
      images=np.arange(n, dtype=np.uint8).reshape(n, 1, 1, 1),
      labels=np.arange(n, dtype=np.int32))
  return input_pipeline.TrainBatches(data, batch, seed, **kw)


def test_each_epoch_visits_distinct_examples_in_a_new_order():
  it = _batches()
  spe = it.steps_per_epoch
  assert spe == 103 // 8
  epoch0 = np.concatenate([it.local_batch(s)['label'] for s in range(spe)])
  epoch1 = np.concatenate([it.local_batch(s)['label']
                           for s in range(spe, 2 * spe)])
  assert len(np.unique(epoch0)) == len(epoch0) == spe * 8
  assert not np.array_equal(epoch0, epoch1)


def test_restart_at_a_step_gives_the_same_batches_as_continuing():
  full = [b['label'] for b in _batches().iterate(0, 40)]
  resumed = [b['label'] for b in _batches().iterate(23, 40)]
  for a, b in zip(full[23:], resumed):
    np.testing.assert_array_equal(a, b)
  other_seed = [b['label'] for b in _batches(seed=4).iterate(0, 40)]
  assert not all(np.array_equal(a, b) for a, b in zip(full, other_seed))


def test_process_slices_concatenate_to_the_global_batch():
  whole = _batches()
  parts = [_batches(process_index=i, process_count=4) for i in range(4)]
  for step in (0, 5, 30):
    glued = np.concatenate([p.local_batch(step)['label'] for p in parts])
    np.testing.assert_array_equal(glued, whole.local_batch(step)['label'])
    np.testing.assert_array_equal(glued, whole.global_indices(step))


def test_eval_batches_cover_every_example_once_with_padding_masked():
  data = datasets.ArraySplit(np.zeros((21, 1, 1, 1), np.uint8),
                             np.arange(21, dtype=np.int32))
  seen = []
  for batch in input_pipeline.eval_batches(data, 8):
    assert batch['label'].shape == (8,)
    seen.extend(batch['label'][batch['mask'] > 0])
  assert sorted(seen) == list(range(21))
  halves = [list(input_pipeline.eval_batches(data, 8, i, 2)) for i in (0, 1)]
  glued = np.concatenate([np.concatenate([a['mask'], b['mask']])
                          for a, b in zip(*halves)])
  assert glued.sum() == 21


def test_standard_tfds_name_loads_from_data_dir_under_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=24):
    datasets.check_available('mnist', str(tmp_path))
    train = datasets.load_split('mnist', 'train', str(tmp_path))
    val = datasets.load_split('mnist', 'validation', str(tmp_path))
    test = datasets.load_split('cifar10', 'test', str(tmp_path))
  assert train.images.shape[1:] == (28, 28, 1) and train.images.dtype == np.uint8
  # mock_data serves num_examples per split expression (it ignores slicing).
  assert len(train) == len(val) == 24
  assert test.images.shape == (24, 32, 32, 3)
  assert train.labels.dtype == np.int32 and train.labels.max() < 10


def test_missing_standard_data_set_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match=r"config.dataset='cifar10'.*not found "
                     r"in data_dir="):
    datasets.check_available('cifar10', str(tmp_path))


def test_unknown_data_set_lists_the_choices():
  with pytest.raises(ConfigError, match="valid choices: 'cifar10'.*'digits'"):
    datasets.get_spec('imagenet21k')


def test_device_batches_keep_order_and_sharding():
  mesh = jax.make_mesh((8,), ('data',))
  sharding = NamedSharding(mesh, P('data'))
  it = _batches(batch=16)
  out = list(input_pipeline.to_devices(it.iterate(0, 7), sharding))
  assert len(out) == 7
  for step, batch in enumerate(out):
    assert batch['label'].sharding == sharding
    np.testing.assert_array_equal(np.asarray(batch['label']),
                                  it.local_batch(step)['label'])
