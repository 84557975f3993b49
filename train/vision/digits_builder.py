"""TFDS builder for scikit-learn's bundled digits images, prepared offline.

The 1,797 real 8x8 grey-level images (pixel values 0..16) of UCI's optical
handwritten digits ship inside scikit-learn, so this data set is built
locally with no download and no TensorFlow. Splits are stratified per class
from a fixed permutation, so they are the same on every machine:
train 1,259 / validation 179 / test 359 images. `index` is the image's
position in `sklearn.datasets.load_digits()`, which lets tests check that
the splits are disjoint and complete.
"""

import numpy as np
import tensorflow_datasets as tfds

from train.vision import splits

# Fractions of each class held out; the rest is the training split.
TEST_FRACTION = 0.2
VALIDATION_FRACTION = 0.1
_SPLIT_SEED = 20260101


def split_indices() -> dict[str, np.ndarray]:
  """Returns sorted load_digits() indices of each split (stratified, fixed)."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  return splits.stratified(
      load_digits().target,
      lambda n: (int(round(TEST_FRACTION * n)),
                 int(round(VALIDATION_FRACTION * n))), _SPLIT_SEED)


class Digits(tfds.core.GeneratorBasedBuilder):
  """UCI optical digits (scikit-learn's copy), 8x8x1 uint8 images in 0..16."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Stratified train/validation/test splits.'}

  def _info(self) -> tfds.core.DatasetInfo:
    # An explicit DatasetInfo: this builder lives in a module without TFDS
    # metadata files. Tensor (not Image) features need no TensorFlow.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
            'label': tfds.features.ClassLabel(num_classes=10),
            'index': tfds.features.Scalar(dtype=np.int32),
        }),
        supervised_keys=('image', 'label'),
        homepage='https://archive.ics.uci.edu/dataset/80',
        citation='Alpaydin & Kaynak, Optical Recognition of Handwritten '
        'Digits, UCI Machine Learning Repository, 1998.',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the data ships with scikit-learn.
    return {name: self._generate_examples(indices)
            for name, indices in split_indices().items()}

  def _generate_examples(self, indices):
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
    digits = load_digits()
    for i in indices:
      yield int(i), {
          'image': digits.images[i].astype(np.uint8)[..., None],
          'label': int(digits.target[i]),
          'index': int(i),
      }
