"""ImageNet through TFDS's data_source, decoded on demand (`DecodedSplit`).

A small `imagenet2012` is prepared here as real array_record files with
TFDS's own ImageNet builder (its features, JPEG encoding, version and
split names); only the examples are ours: JPEGs whose quadrant colours
encode their label, so decoding, channel order, cropping and label pairing
are checked pixel by pixel. `tfds.testing.mock_data` checks the split
expressions against TFDS's catalog entry without any files.
"""

import io

import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.datasets.imagenet2012 import imagenet2012_dataset_builder

from configs import resnet50_imagenet
from train.training import input_pipeline
from train.errors import ConfigError, DamagedDataFile
from train.vision import datasets
from train.vision import decoded_split
from train.vision import trainer

SPLIT_SIZES = {'train': 100, 'validation': 6, 'test': 3}
# Quadrant colours: top-left encodes the label; the others are fixed.
TOP_RIGHT, BOTTOM_LEFT, BOTTOM_RIGHT = (250, 10, 10), (10, 250, 10), (10, 10, 250)
GREY_LABEL = 3  # This train example is a one-channel (grey) JPEG.


def _label_colour(label):
  return (40 + 5 * (label % 40), 200 - 4 * (label % 40), 120)


def _quadrants(label, height, width):
  image = np.empty((height, width, 3), np.uint8)
  h, w = height // 2, width // 2
  image[:h, :w] = _label_colour(label)
  image[:h, w:] = TOP_RIGHT
  image[h:, :w] = BOTTOM_LEFT
  image[h:, w:] = BOTTOM_RIGHT
  return image


def _jpeg(image):
  buffer = io.BytesIO()
  Image.fromarray(image).save(buffer, format='JPEG', quality=95)
  return buffer.getvalue()


def _examples(split, damaged):
  for i in range(SPLIT_SIZES[split]):
    label = -1 if split == 'test' else (7 * i) % 1000
    # Sizes vary, both orientations, as ImageNet's do.
    height, width = (240 + 2 * i, 320) if i % 2 else (320, 256 + 3 * i)
    image = _quadrants(label, height, width)
    if split == 'train' and i == GREY_LABEL:
      image = np.repeat(image.mean(-1, keepdims=True).astype(np.uint8), 3,
                        -1)
      data = _jpeg(image[..., 0])
    else:
      data = _jpeg(image)
    if damaged and split == 'validation' and i == 2:
      data = b'not a jpeg' + data[:20]
    yield f'{split}_{i}', {'image': data, 'label': label,
                           'file_name': f'{split}_{i}.JPEG'}


def _prepare(data_dir, damaged=False):
  with tfds.core.registered.skip_registration():

    class Imagenet2012(imagenet2012_dataset_builder.Builder):
      """TFDS's builder, generating our examples instead of the tars."""
      name = 'imagenet2012'

      @classmethod
      def _get_pkg_dir_path(cls):  # TFDS's metadata (labels, citation).
        return imagenet2012_dataset_builder.Builder._get_pkg_dir_path()

      def _split_generators(self, dl_manager):
        del dl_manager
        return {s: _examples(s, damaged) for s in SPLIT_SIZES}

  Imagenet2012(data_dir=data_dir).download_and_prepare(
      file_format='array_record')
  return data_dir


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return _prepare(str(tmp_path_factory.mktemp('tfds')))


@pytest.fixture(scope='module')
def splits(data_dir):
  return {s: datasets.load_split('imagenet2012', s, data_dir)
          for s in datasets.SPLITS}


def _near(pixel, colour, tolerance=12):
  return np.all(np.abs(pixel.astype(int) - np.array(colour)) <= tolerance)


def test_splits_are_train_99_percent_minival_and_validation_as_test(splits):
  # With 1.28M images the hold-out is 12,812 (configs/resnet50_imagenet.py
  # counts on the 1,268,355 left to train).
  assert all(isinstance(s, decoded_split.DecodedSplit)
             for s in splits.values())
  assert (len(splits['train']), len(splits['validation'])) == (99, 1)
  assert len(splits['test']) == SPLIT_SIZES['validation']
  spec = datasets.get_spec('imagenet2012')
  assert (spec.train_split, spec.validation_split, spec.test_split) == (
      'train[:99%]', 'train[99%:]', 'validation')


def test_rows_are_decoded_central_crops_paired_with_their_labels(splits):
  for name in ('train', 'test'):
    split = splits[name]
    batch = split.rows(np.arange(len(split)))
    assert batch['image'].shape == (len(split), 224, 224, 3)
    assert batch['image'].dtype == np.uint8
    assert batch['label'].dtype == np.int32
    labels = set()
    for image, label in zip(batch['image'], batch['label']):
      labels.add(int(label))
      grey = name == 'train' and int(label) == (7 * GREY_LABEL) % 1000
      colours = [_label_colour(label), TOP_RIGHT, BOTTOM_LEFT, BOTTOM_RIGHT]
      if grey:
        colours = [(int(np.mean(c)),) * 3 for c in colours]
      # The central 87.5% crop keeps each quadrant where it was (RGB order:
      # OpenCV decodes BGR and TFDS swaps it back).
      for (r, c), colour in zip(((56, 56), (56, 168), (168, 56), (168, 168)),
                                colours):
        assert _near(image[r, c], colour), (name, label, r, c, image[r, c])
    want = {(7 * i) % 1000 for i in range(SPLIT_SIZES[
        'validation' if name == 'test' else 'train'])}
    if name == 'train':
      assert labels <= want
    else:
      assert labels == want


def test_views_are_deterministic_and_new_each_epoch(splits):
  split = splits['train'].with_training_views(seed=5)
  idx = np.arange(8)
  a = split.train_rows(idx, 3)
  np.testing.assert_array_equal(a['image'], split.train_rows(idx, 3)['image'])
  np.testing.assert_array_equal(a['label'], split.rows(idx)['label'])
  assert not np.array_equal(a['image'], split.train_rows(idx, 4)['image'])
  other = splits['train'].with_training_views(seed=6)
  assert not np.array_equal(a['image'], other.train_rows(idx, 3)['image'])
  # Evaluation reads never depend on the epoch or the seed.
  np.testing.assert_array_equal(split.rows(idx)['image'],
                                splits['train'].rows(idx)['image'])
  # Without views, training batches are the central crops.
  np.testing.assert_array_equal(splits['train'].train_rows(idx, 3)['image'],
                                splits['train'].rows(idx)['image'])


def test_inception_views_crop_and_flip(splits):
  split = splits['train'].with_training_views(seed=0)
  label = int(split.rows(np.array([0]))['label'][0])
  views = [split.train_rows(np.array([0]), e)['image'][0] for e in range(40)]
  colour = _label_colour(label)
  # A crop that keeps a corner region shows that quadrant's colour there,
  # mirrored in flipped views; every view is one of the image's colours.
  corners = [(v[4, 4], v[4, -5]) for v in views]
  flipped = sum(_near(left, TOP_RIGHT) and _near(right, colour)
                for left, right in corners)
  unflipped = sum(_near(left, colour) and _near(right, TOP_RIGHT)
                  for left, right in corners)
  assert flipped and unflipped
  # The label's quadrant fills a quarter of the central crop; random boxes
  # zoom in on it or leave it out.
  share = [np.mean(np.all(np.abs(v.astype(int) - colour) <= 12, axis=-1))
           for v in views]
  central = split.rows(np.array([0]))['image'][0]
  assert 0.2 < np.mean(np.all(np.abs(central.astype(int) - colour) <= 12,
                              axis=-1)) < 0.3
  assert min(share) < 0.1 and max(share) > 0.4


def test_resumed_batches_equal_uninterrupted_ones(splits):
  split = splits['train'].with_training_views(seed=1)
  full = [b['image'] for b in input_pipeline.TrainBatches(
      split, 8, seed=0).iterate(0, 9)]
  resumed = [b['image'] for b in input_pipeline.TrainBatches(
      split, 8, seed=0).iterate(6, 9)]
  for a, b in zip(full[6:], resumed):
    np.testing.assert_array_equal(a, b)


def test_the_split_is_never_copied_to_the_devices(splits):
  split = splits['train']
  assert input_pipeline.on_demand(split)
  assert input_pipeline.nbytes(split) == len(split) * (224 * 224 * 3 + 4)
  assert not input_pipeline.fits_on_devices(split, 1e9)
  with pytest.raises(NotImplementedError, match='decoded on demand'):
    split.columns()


def test_a_damaged_jpeg_names_the_record_and_the_files(tmp_path):
  data_dir = _prepare(str(tmp_path), damaged=True)
  split = datasets.load_split('imagenet2012', 'test', data_dir)
  with pytest.raises(DamagedDataFile,
                     match=r"cannot read imagenet2012 split 'test' record "
                     r'\d+: damaged data file\(s\) .*imagenet2012-validation'
                     r'\.array_record'):
    split.rows(np.arange(len(split)))


def test_the_trainer_trains_on_views_and_evaluates_central_crops(data_dir):
  config = resnet50_imagenet.get_config()
  config.data_dir = data_dir
  config.seed = 11
  data = trainer.load_data(config)
  assert data.train.augment and data.train.seed == 11
  assert not data.validation.augment
  assert len(data.final()['test']) == SPLIT_SIZES['validation']


def test_label_noise_on_imagenet_is_refused_before_anything_runs(tmp_path):
  config = resnet50_imagenet.get_config()
  config.label_noise = 0.2
  with pytest.raises(ConfigError, match=r"config.label_noise=0.2: not "
                     r"supported for 'imagenet2012'"):
    trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_standard_split_names_under_mock_data(tmp_path):
  """TFDS's catalog entry for imagenet2012 with no files at all: the split
  expressions resolve and read back (nothing is downloaded)."""
  with tfds.testing.mock_data(num_examples=6):
    datasets.check_available('imagenet2012', str(tmp_path))
    for name in datasets.SPLITS:
      split = datasets.load_split('imagenet2012', name, str(tmp_path))
      batch = split.rows(np.arange(len(split)))
      assert batch['image'].shape == (6, 224, 224, 3)
      assert batch['label'].max() < 1000 and batch['label'].min() >= 0
  assert not list(tmp_path.iterdir())
