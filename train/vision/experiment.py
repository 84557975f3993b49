"""The image classifier's run, validated from the config and assembled.

`build(config, workdir)` checks the data set name and the model first,
then `train.training.experiment.assemble` checks everything the loop shares (step
counts, mesh, batch divisibility, optimizer and method, workdir) and that
every split of the data set can be opened. Nothing is placed or compiled.
"""

from collections.abc import Sequence
import functools
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from train import errors
from train.training import experiment as experiment_lib
from train.vision import datasets
from train.vision import loss
from train.vision import models


def _init_variables(model: nn.Module, image_shape: tuple[int, ...],
                    rng: jax.Array) -> dict:
  return model.init(rng, np.zeros((1, *image_shape), np.uint8), train=False)


def build(config: ml_collections.ConfigDict, workdir: str, *,
          devices: Sequence[Any] | None = None,
          check_data: bool = True) -> experiment_lib.Experiment:
  """Validates `config` and builds the run's parts (see module docstring).

  `devices`: the mesh's (default: this job's); `check_data=False` skips
  opening the data (compiling for a pod needs its shapes only).
  """
  spec = datasets.get_spec(config.dataset)
  rate = config.get('label_noise', 0.0)
  if not (isinstance(rate, (int, float)) and 0.0 <= rate < 1.0):
    raise errors.ConfigError('label_noise', rate,
                             'the fraction of training labels to corrupt '
                             'must be in [0, 1)')
  smoothing = config.get('label_smoothing', 0.0)
  if not (isinstance(smoothing, (int, float)) and 0.0 <= smoothing < 1.0):
    raise errors.ConfigError('label_smoothing', smoothing,
                             'the weight of the uniform target must be in '
                             '[0, 1)')
  model = models.create_model(config.model, spec.num_classes, spec.pixel_max)
  return experiment_lib.assemble(
      config, workdir, model=model,
      init_variables=functools.partial(_init_variables, model,
                                       tuple(spec.image_shape)),
      # Absent (0) in older configs: their loss is unchanged.
      per_example=(functools.partial(loss.classification_loss,
                                     label_smoothing=float(smoothing))
                   if smoothing else loss.classification_loss),
      columns={'image': (spec.image_shape, np.uint8),
               'label': ((), np.int32)},
      check_data=(functools.partial(datasets.check_available,
                                    config.dataset, config.data_dir)
                  if check_data else None),
      devices=devices)
