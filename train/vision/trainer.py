"""`train_and_evaluate(config, workdir)`: the supervised image-classification trainer.

The image product's parts on the shared loop (`train.training.loop`): the
experiment (`train.vision.experiment.build`: data set, model, loss) and
the splits, read through TFDS into host memory (or, for ImageNet, opened
to be decoded on demand): training and validation, and the test split,
evaluated once at the end (never used for training or model selection).
Resume, preemption, the non-finite policy, metrics and plots are the
loop's.
"""

import functools

import ml_collections

from train import errors
from train.training import loop
from train.vision import datasets
from train.vision import experiment
from train.vision import label_noise

FINAL_METRICS = loop.FINAL_METRICS


def load_data(config: ml_collections.ConfigDict) -> loop.Data:
  """The training and validation splits now; validation and test at the end.

  With `config.label_noise` > 0 the training split's labels are corrupted
  (`train.vision.label_noise.symmetric`); validation and test stay clean.
  Training batches are the views `config.augmentation` names
  (`datasets.AUGMENTATIONS`; absent: `datasets.default_augmentation`),
  drawn from (`config.seed`, epoch, index).
  """
  train, validation = (
      datasets.load_split(config.dataset, split, config.data_dir)
      for split in ('train', 'validation'))
  rate = config.get('label_noise', 0.0)
  if rate:
    train = datasets.ArraySplit(train.images, label_noise.symmetric(
        train.labels, datasets.get_spec(config.dataset).num_classes, rate,
        config.get('label_noise_seed', 0)))
  train = datasets.training_views(train, _augmentation(config), config.seed)
  return loop.Data(
      train=train, validation=validation,
      final=lambda: {'val': validation,
                     'test': datasets.load_split(config.dataset, 'test',
                                                 config.data_dir)})


def _augmentation(config: ml_collections.ConfigDict) -> str:
  return config.get('augmentation',
                    datasets.default_augmentation(config.dataset))


def check_data_settings(config: ml_collections.ConfigDict) -> None:
  """ConfigError for an augmentation the data set does not have, or label
  noise on a set decoded on demand (its labels are not held, so they
  cannot be flipped once for the whole run)."""
  datasets.check_augmentation(config.dataset, _augmentation(config))
  rate = config.get('label_noise', 0.0)
  if rate and datasets.get_spec(config.dataset).on_demand:
    raise errors.ConfigError(
        'label_noise', rate, f'not supported for {config.dataset!r}, whose '
        'images are decoded on demand; use a data set held in memory')


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains, evaluates and checkpoints into `workdir`; returns the final metrics.

  Raises:
    UsageError: a setting is invalid (before anything is compiled).
    NonFiniteLossError: a non-finite loss with `config.nonfinite='stop'`.
    Preempted: SIGTERM arrived; a checkpoint was saved first.
  """
  check_data_settings(config)
  exp = experiment.build(config, workdir)
  return loop.train_and_evaluate(exp, functools.partial(load_data, config))
