"""Image-classification data sets: the offline digits set and standard TFDS names.

Every data set is read through TFDS's random-access `data_source` (array
record files, no TensorFlow) and held in host memory as uint8 images and
int32 labels: all the supported sets are small enough, and in-memory
indexing makes batches an exact, cheap function of the step number.

`digits` is built locally from scikit-learn on first use. The standard
names (mnist, cifar10, ...) are read from `data_dir` and never downloaded:
users on pods point `config.data_dir` at prepared data (e.g. in `gs://`).
"""

from collections.abc import Iterator
import contextlib
import dataclasses
import fcntl
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from train.errors import ConfigError, DamagedDataFile
from train.input_pipeline import Batch
from train.vision import digits_builder


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """How to read one data set.

  Attributes:
    num_classes: number of label values.
    image_shape: (height, width, channels) of one image.
    pixel_max: value of a white pixel (images are scaled to [0, 1] by it).
    train_split / validation_split / test_split: TFDS split expressions.
      Sets without a validation split hold out the end of `train`.
    builder: an in-project builder class prepared locally, or None for the
      TFDS catalog (data must already be in `data_dir`).
  """
  num_classes: int
  image_shape: tuple[int, int, int]
  pixel_max: float
  train_split: str = 'train[:90%]'
  validation_split: str = 'train[90%:]'
  test_split: str = 'test'
  builder: type[tfds.core.DatasetBuilder] | None = None


DATASETS: dict[str, DatasetSpec] = {
    'digits': DatasetSpec(10, (8, 8, 1), 16.0, 'train', 'validation', 'test',
                          builder=digits_builder.Digits),
    'mnist': DatasetSpec(10, (28, 28, 1), 255.0),
    'fashion_mnist': DatasetSpec(10, (28, 28, 1), 255.0),
    'kmnist': DatasetSpec(10, (28, 28, 1), 255.0),
    'cifar10': DatasetSpec(10, (32, 32, 3), 255.0),
    'cifar100': DatasetSpec(100, (32, 32, 3), 255.0),
    'svhn_cropped': DatasetSpec(10, (32, 32, 3), 255.0),
}

SPLITS = ('train', 'validation', 'test')


@dataclasses.dataclass(frozen=True)
class ArraySplit:
  """One split in host memory (an `input_pipeline.Split`)."""
  images: np.ndarray  # (N, H, W, C) uint8
  labels: np.ndarray  # (N,) int32

  def __len__(self) -> int:
    return len(self.labels)

  def rows(self, indices: np.ndarray) -> Batch:
    return {'image': self.images[indices], 'label': self.labels[indices]}

  def columns(self) -> Batch:
    return {'image': self.images, 'label': self.labels}


def get_spec(name: str) -> DatasetSpec:
  if name not in DATASETS:
    raise ConfigError('dataset', name, 'unknown data set', sorted(DATASETS))
  return DATASETS[name]


def resolve_data_dir(data_dir: str | None) -> str:
  """The TFDS data directory: the config's, else $TFDS_DATA_DIR or ~/tensorflow_datasets."""
  if data_dir:
    return os.fspath(data_dir)
  return os.fspath(tfds.core.constants.DATA_DIR)


@contextlib.contextmanager
def _file_lock(path: str):
  # Several processes (pytest workers, hosts of one job) may prepare the same
  # local data set at once; TFDS's final rename would race.
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _open_split(name: str, split_expr: str, data_dir: str):
  spec = DATASETS[name]
  if spec.builder is not None:
    builder = spec.builder(data_dir=data_dir)
    if not builder.is_prepared():
      with _file_lock(os.path.join(data_dir, f'.{name}.lock')):
        builder = spec.builder(data_dir=data_dir)
        if not builder.is_prepared():
          builder.download_and_prepare(file_format='array_record')
    return builder.as_data_source(split=split_expr)
  try:
    return tfds.data_source(name, split=split_expr, data_dir=data_dir,
                            download=False)
  except Exception as e:  # TFDS raises several types for "not prepared".
    raise ConfigError(
        'dataset', name,
        f'not found in data_dir={data_dir!r} as array_record files (prepare '
        f'it there with `tfds build {name} --file_format=array_record '
        f'--data_dir=...` or set config.data_dir) [{type(e).__name__}]'
    ) from None


def _files(source) -> list[str]:
  """The files behind a TFDS data source (for messages)."""
  try:
    return [os.fspath(p) for p in
            source.dataset_info.splits[source.split].filepaths]
  except Exception:  # pylint: disable=broad-except
    return ['(files of this split)']


def _read(source, name: str, split: str, indices) -> Iterator[Any]:
  """Records `indices` of `source`, one at a time; a damaged file gives
  one clear error."""
  try:
    for i in indices:
      yield source[int(i)]
  except Exception as e:  # pylint: disable=broad-except
    # array_record and riegeli raise RuntimeError / ValueError / OSError
    # for a truncated or corrupt file.
    raise DamagedDataFile(f'{name} split {split!r}', _files(source),
                          e) from None


def check_available(name: str, data_dir: str | None) -> None:
  """Fails with a ConfigError unless every split of `name` can be opened,
  or `DamagedDataFile` if its first or last record cannot be read (a
  truncated file, before any compute)."""
  spec = get_spec(name)
  data_dir = resolve_data_dir(data_dir)
  for split in SPLITS:
    source = _open_split(name, getattr(spec, f'{split}_split'), data_dir)
    if len(source) == 0:
      raise ConfigError('dataset', name, f'split {split!r} is empty in '
                        f'data_dir={data_dir!r}')
    for _ in _read(source, name, split, {0, len(source) - 1}):
      pass


def load_split(name: str, split: str, data_dir: str | None) -> ArraySplit:
  """Reads one split ('train', 'validation' or 'test') into host memory.

  Raises:
    DamagedDataFile: a record cannot be read.
  """
  spec = get_spec(name)
  if split not in SPLITS:
    raise ValueError(f'split={split!r}; valid choices: {", ".join(SPLITS)}')
  source = _open_split(name, getattr(spec, f'{split}_split'),
                       resolve_data_dir(data_dir))
  n = len(source)
  images = np.empty((n, *spec.image_shape), np.uint8)
  labels = np.empty((n,), np.int32)
  for i, record in enumerate(_read(source, name, split, range(n))):
    try:
      images[i] = np.asarray(record['image']).reshape(spec.image_shape)
      labels[i] = record['label']
    except (KeyError, ValueError) as e:
      raise DamagedDataFile(f'{name} split {split!r} record {i}',
                            _files(source), e) from None
  return ArraySplit(images, labels)
