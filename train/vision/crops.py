"""Training and evaluation views of images, in numpy: ImageNet-style crops
to a fixed square size, and CIFAR-style padded crops.

`central_crop` is the evaluation view of flax's ImageNet example and the
SAM code: the central square of side size / (size + 32) of the shorter
side (0.875 for 224), resized to size x size: the same region as "resize
the shorter side to 256, then crop the central 224". `inception_crop` is
the training view of Szegedy et al. (2015) as torchvision's
RandomResizedCrop draws it: a box of 8% to 100% of the area with aspect
ratio in [3/4, 4/3] (log-uniform), 10 tries, else the central crop; then a
horizontal flip with probability 1/2. Its randomness comes from the `rng`
passed in, so a caller that seeds it from (seed, epoch, index) gets a view
that is a pure function of those.

`padded_crop_flip` is the "basic" augmentation of small images (CIFAR):
pad by 4 pixels (reflected), crop the original size at random, flip.

Resizing is PIL's bicubic filter, whose support widens with the scale
factor, so shrinking is antialiased (unlike TF's `resize_bicubic` in the
SAM code; the difference is the usual one between pipelines).
"""

import math

import numpy as np
from PIL import Image

# The evaluation crop keeps size / (size + CROP_PADDING) of the shorter side.
CROP_PADDING = 32
AREA_RANGE = (0.08, 1.0)
ASPECT_RANGE = (3 / 4, 4 / 3)
ATTEMPTS = 10


def _resize(image: np.ndarray, box: tuple[int, int, int, int],
            size: int) -> np.ndarray:
  """The region `box` = (top, left, height, width) of `image` as size x size."""
  top, left, height, width = box
  resized = Image.fromarray(image).resize(
      (size, size), Image.Resampling.BICUBIC,
      box=(left, top, left + width, top + height))
  return np.asarray(resized, dtype=np.uint8)


def central_box(height: int, width: int,
                size: int) -> tuple[int, int, int, int]:
  """(top, left, side, side) of the central square the evaluation view keeps."""
  side = max(1, int(size / (size + CROP_PADDING) * min(height, width)))
  return ((height - side + 1) // 2, (width - side + 1) // 2, side, side)


def inception_box(height: int, width: int,
                  rng: np.random.Generator) -> tuple[int, int, int, int] | None:
  """(top, left, h, w) of a random box, or None if no try fit the image."""
  area = height * width
  log_ratio = (math.log(ASPECT_RANGE[0]), math.log(ASPECT_RANGE[1]))
  for _ in range(ATTEMPTS):
    target = area * rng.uniform(*AREA_RANGE)
    ratio = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target * ratio)))
    h = int(round(math.sqrt(target / ratio)))
    if 0 < w <= width and 0 < h <= height:
      return (int(rng.integers(0, height - h + 1)),
              int(rng.integers(0, width - w + 1)), h, w)
  return None


def central_crop(image: np.ndarray, size: int) -> np.ndarray:
  """The evaluation view of an (H, W, 3) uint8 image: (size, size, 3) uint8."""
  return _resize(image, central_box(*image.shape[:2], size), size)


def inception_crop(image: np.ndarray, size: int,
                   rng: np.random.Generator) -> np.ndarray:
  """A random training view of an (H, W, 3) uint8 image: (size, size, 3)."""
  height, width = image.shape[:2]
  box = inception_box(height, width, rng)
  if box is None:
    box = central_box(height, width, size)
  out = _resize(image, box, size)
  if rng.random() < 0.5:
    out = out[:, ::-1]
  return out


def padded_crop_flip(image: np.ndarray, pad: int,
                     rng: np.random.Generator) -> np.ndarray:
  """A random training view of a small image, same shape: the image padded
  by `pad` pixels on each side (reflected), a random crop of its original
  size, then a horizontal flip with probability 1/2 (the "basic"
  augmentation of CIFAR training, e.g. the SAM code's)."""
  height, width = image.shape[:2]
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode='reflect')
  top, left = rng.integers(0, 2 * pad + 1, size=2)
  out = padded[top:top + height, left:left + width]
  if rng.random() < 0.5:
    out = out[:, ::-1]
  return out
