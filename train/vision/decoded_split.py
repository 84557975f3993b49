"""A split whose images are decoded and cropped when read: ImageNet on the host.

ImageNet's 1.28M training JPEGs (about 140 GB) cannot be held in host
memory as `datasets.ArraySplit` holds the small sets. `DecodedSplit` keeps
the TFDS data source (array_record files, random access, no TensorFlow)
and makes each batch's examples when they are asked for: TFDS's
`data_source` returns an `Image` feature decoded to an (H, W, 3) uint8
array (OpenCV's `imdecode`, grey images repeated to 3 channels), and
`train.vision.crops` cuts it to the model's square size. Reads, decoding
and resizing run in a thread pool (array_record's reader is thread-safe,
and OpenCV and PIL release the GIL), so a host decodes its share of a
batch in parallel.

Views are deterministic: `rows(indices)` gives the central crop (the
evaluation view), a pure function of the index. With `augment=True`,
`train_rows(indices, epoch)`, which `input_pipeline.TrainBatches` calls
for training batches, gives an Inception crop and flip drawn from
`np.random.default_rng([seed, epoch, index])`, so every epoch sees new
views and a resumed run sees the same batches (batch k stays a pure
function of the seed and k).
"""

from collections.abc import Callable, Sequence
from concurrent import futures
import os
from typing import Any

import numpy as np

from train.errors import DamagedDataFile
from train.training.input_pipeline import Batch
from train.vision import crops

# Threads decoding one host's batch; more than the cores gains nothing.
MAX_WORKERS = 32


class DecodedSplit:
  """One split of a TFDS image set, decoded on demand (an
  `input_pipeline.Split` with `on_demand = True`).

  Args:
    source: a TFDS data source of records {'image': (H, W, 3) uint8,
      'label': int}.
    name, split: the set and split, for messages.
    size: the square side of the images it gives.
    augment: whether `train_rows` gives random views (else central crops).
    seed: seeds the random views.
    files: `() -> [paths]` of the split's files, for messages.
    workers: decoding threads (default: the cores, at most MAX_WORKERS).
  """
  on_demand = True

  def __init__(self, source: Any, name: str, split: str, size: int, *,
               augment: bool = False, seed: int = 0,
               files: Callable[[], Sequence[str]] = lambda: [],
               workers: int | None = None):
    self.source = source
    self.name = name
    self.split = split
    self.size = size
    self.augment = augment
    self.seed = seed
    self._files = files
    self._workers = workers or min(MAX_WORKERS, os.cpu_count() or 1)
    self._pool = None

  def __len__(self) -> int:
    return len(self.source)

  @property
  def decoded_nbytes(self) -> int:
    """Host memory the decoded split would take (it is never held)."""
    return len(self) * (self.size * self.size * 3 + 4)

  def rows(self, indices: np.ndarray) -> Batch:
    """Central crops of the examples at `indices` (the evaluation view)."""
    return self._batch(indices, lambda i, image: crops.central_crop(
        image, self.size))

  def with_training_views(self, seed: int) -> 'DecodedSplit':
    """This split, whose `train_rows` gives random views seeded by `seed`."""
    return DecodedSplit(self.source, self.name, self.split, self.size,
                        augment=True, seed=seed, files=self._files,
                        workers=self._workers)

  def train_rows(self, indices: np.ndarray, epoch: int) -> Batch:
    """Random training views of the examples at `indices` in `epoch`
    (central crops without `augment`)."""
    if not self.augment:
      return self.rows(indices)

    def view(i, image):
      rng = np.random.default_rng([self.seed, epoch, i])
      return crops.inception_crop(image, self.size, rng)
    return self._batch(indices, view)

  def columns(self) -> Batch:
    raise NotImplementedError(
        f'{self.name} split {self.split!r}: its {len(self):,} images are '
        'decoded on demand and never held whole '
        f'({self.decoded_nbytes / 2**30:.1f} GiB decoded), so the split '
        'cannot be copied to the devices (input_pipeline.fits_on_devices is '
        'False for it)')

  def _batch(self, indices: np.ndarray,
             view: Callable[[int, np.ndarray], np.ndarray]) -> Batch:
    indices = [int(i) for i in np.asarray(indices).reshape(-1)]
    if self._pool is None:
      self._pool = futures.ThreadPoolExecutor(
          self._workers, thread_name_prefix=f'decode-{self.name}')
    examples = list(self._pool.map(
        lambda i: self._example(i, view), indices))
    images = np.empty((len(indices), self.size, self.size, 3), np.uint8)
    labels = np.empty((len(indices),), np.int32)
    for k, (image, label) in enumerate(examples):
      images[k] = image
      labels[k] = label
    return {'image': images, 'label': labels}

  def _example(self, i: int, view) -> tuple[np.ndarray, int]:
    try:
      record = self.source[i]
      image = np.asarray(record['image'], np.uint8)
      if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f'image of shape {image.shape}, not (H, W, 3)')
      return view(i, image), int(record['label'])
    except Exception as e:  # pylint: disable=broad-except
      # array_record raises RuntimeError / ValueError / OSError for a
      # damaged file; OpenCV returns None for a damaged JPEG, which TFDS
      # then fails on.
      raise DamagedDataFile(f'{self.name} split {self.split!r} record {i}',
                            list(self._files()), e) from None
