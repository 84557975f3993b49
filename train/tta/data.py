"""The test streams' data: a data set's test split under the standard corruptions.

`config.dataset` names the clean data set the source classifier was
trained on; the stream reads `<dataset>_corrupted/<corruption>_<severity>`
(TFDS's naming for CIFAR-10-C; `mnist5k_corrupted` is built in-project,
offline), one set per corruption in `config.corruptions`, at
`config.severity`. EATA's in-distribution samples for its Fisher are the
clean data set's validation split (never the test split the stream
corrupts).
"""

import dataclasses

import ml_collections
import numpy as np

from train.errors import ConfigError
from train.tta import streams
from train.vision import corruptions as corruptions_lib
from train.vision import datasets

SEVERITIES = (1, 2, 3, 4, 5)


def corruption_names(config: ml_collections.ConfigDict) -> list[str]:
  """`config.corruptions` as a list: 'all' (the 15 in the standard order),
  or a comma-separated subset."""
  value = config.corruptions
  if value == 'all':
    return list(corruptions_lib.CORRUPTIONS)
  names = [n.strip() for n in str(value).split(',') if n.strip()]
  for name in names:
    if name not in corruptions_lib.CORRUPTIONS:
      raise ConfigError('corruptions', name, 'unknown corruption',
                        ('all', *corruptions_lib.CORRUPTIONS))
  if not names:
    raise ConfigError('corruptions', value, 'names no corruption',
                      ('all', *corruptions_lib.CORRUPTIONS))
  return names


def check(config: ml_collections.ConfigDict) -> None:
  """The stream's settings (ConfigError naming the field)."""
  corruption_names(config)
  if config.severity not in SEVERITIES:
    raise ConfigError('severity', config.severity, 'unknown severity',
                      SEVERITIES)
  stream_spec(config)


def stream_spec(config: ml_collections.ConfigDict) -> datasets.DatasetSpec:
  """The clean data set's spec (its corrupted test split is the stream)."""
  name = f'{config.dataset}_corrupted'
  if name not in datasets.CORRUPTED:
    raise ConfigError('dataset', config.dataset,
                      'has no corrupted test sets',
                      sorted(n[:-len('_corrupted')]
                             for n in datasets.CORRUPTED))
  return datasets.get_spec(config.dataset)


@dataclasses.dataclass(frozen=True)
class Stream:
  """The stream's samples, per corruption, in host memory."""
  corruptions: list[str]
  images: list[np.ndarray]
  labels: list[np.ndarray]

  def images_of(self, batch: streams.Batch) -> np.ndarray:
    return np.stack([self.images[c][i]
                     for c, i in zip(batch.corruption, batch.sample)])

  def labels_of(self, batch: streams.Batch) -> np.ndarray:
    return np.asarray([self.labels[c][i]
                       for c, i in zip(batch.corruption, batch.sample)],
                      np.int32)


def load(config: ml_collections.ConfigDict) -> Stream:
  """Reads every corruption's test set at `config.severity`.

  Raises:
    ConfigError: the data set is not there (standard names are never
      downloaded).
    DamagedDataFile: a record cannot be read.
  """
  names = corruption_names(config)
  splits = [datasets.load_corrupted(config.dataset, name, config.severity,
                                    config.data_dir) for name in names]
  return Stream(names, [s.images for s in splits], [s.labels for s in splits])


def in_distribution_batches(config: ml_collections.ConfigDict
                            ) -> list[np.ndarray]:
  """EATA's Fisher samples: `method.fisher_samples` clean validation images,
  in batches of `batch_size`."""
  split = datasets.load_split(config.dataset, 'validation', config.data_dir)
  n = min(config.method.fisher_samples, len(split))
  images = split.images[:n]
  return [images[i:i + config.batch_size]
          for i in range(0, n, config.batch_size)]
