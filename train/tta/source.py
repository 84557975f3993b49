"""The source model of test-time adaptation: a classifier `launch.train` trained.

`load(config)` reads the newest checkpoint of `config.source_workdir` that
loads and verifies, rebuilds the model from the config saved with it, and
checks that it classifies the images of the stream's data set (same image
shape and number of classes). A damaged checkpoint there is skipped and
left in place: the source workdir belongs to its training run.
"""

import dataclasses
from typing import Any

from absl import logging
import flax.linen as nn
import jax
import ml_collections

from train.run import checksums
from train.training import experiment as experiment_lib
from train.errors import UsageError
from train.tta import data as tta_data
from train.vision import datasets
from train.vision import experiment


@dataclasses.dataclass(frozen=True)
class Source:
  """A trained classifier on the host.

  Attributes:
    config: its training config.
    spec: its data set's spec.
    model: the Flax module.
    params: its parameters (unboxed, host numpy).
    batch_stats: its running BN statistics ({} without BatchNorm).
    step: the checkpoint's step.
  """
  config: ml_collections.ConfigDict
  spec: datasets.DatasetSpec
  model: nn.Module
  params: Any
  batch_stats: Any
  step: int
  # `checksums.digest` of (params, batch_stats): pins the source by content.
  fingerprint: str


def load(config: ml_collections.ConfigDict) -> Source:
  """The source classifier of `config.source_workdir`.

  Raises:
    UsageError: it holds no checkpoint, not a classifier's, or one for
      images of another shape or number of classes than the stream's.
    NoGoodCheckpoint: it holds checkpoints and none loads and verifies.
  """
  field = 'config.source_workdir'

  def build(source_config: ml_collections.ConfigDict, workdir: str):
    stream = tta_data.stream_spec(config)
    spec = datasets.get_spec(source_config.dataset)
    if (spec.image_shape, spec.num_classes) != (stream.image_shape,
                                                stream.num_classes):
      raise UsageError(
          field, config.source_workdir,
          f'its classifier was trained on {source_config.dataset!r} '
          f'({spec.image_shape} images, {spec.num_classes} classes); the '
          f'stream {config.dataset!r} has {stream.image_shape} images and '
          f'{stream.num_classes} classes')
    return experiment.build(source_config, workdir)

  run = experiment_lib.load_trained(
      config.source_workdir, build, field=field, task='classification',
      what='an image classifier',
      hint='train a classifier first, e.g. `python -m launch.train '
      '--config=configs/digits.py:dataset=mnist5k '
      f'--workdir={config.source_workdir}`')
  logging.info('Source classifier: step %d of %s', run.step,
               run.exp.workdir)
  used = (nn.meta.unbox(run.state.params), run.state.batch_stats)
  host = jax.device_get(used)
  return Source(config=run.config,
                spec=datasets.get_spec(run.config.dataset), model=run.exp.model,
                params=host[0], batch_stats=host[1] or {}, step=run.step,
                fingerprint=checksums.digest(used))
