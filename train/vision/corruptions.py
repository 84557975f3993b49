"""The 15 common corruptions of ImageNet-C / CIFAR-10-C, for grey-level images.

Every family comes from `imagecorruptions` (the imagecorruptions-imaug 1.1.5
release, the maintained fork of Michaelis et al.'s package, which runs with
numpy 2 and scikit-image 0.26), at its ImageNet-C severity parameters. Its
per-family functions are called directly: its `corrupt()` entry point refuses
images under 32 pixels, the functions themselves run on 28x28. A grey image
goes through the library's own single-channel path (so the noises keep their
published per-pixel strength), except for three families whose
single-channel paths are broken in the library: glass_blur (it blurs along
one axis only), motion_blur (an IndexError) and frost (it weighs the
texture's BGR channels as RGB). Those get the image replicated to three
channels, as the library's `corrupt()` does; glass_blur and motion_blur
return three identical channels and one is kept, frost returns the image
under a blue-white texture, brought back to grey with ITU-R 601-2 luma
(PIL's 'L' conversion).

Hendrycks & Dietterich tuned the parameters for 224x224 images and most are
in pixels, so on 28x28 the blurs are strong for the image size: defocus at
severities 4-5 and glass from severity 3 leave little of the digit, glass's
severity 3 (three shuffling passes) is as far from the clean image as 4
(two), and motion_blur's kernels (31 to 41 taps at severities 2-5) are cut
where they run past the image. elastic_transform is the package's variant
(no affine step, displacements smoothed over 1% of the side): on 28x28 that
is 0.28 pixels, so it moves pixels independently, by up to 1.75 (severity 1)
to 4.2 (severity 5) pixels, rather than bending strokes. The original
imagecorruptions 1.1.2 does not import here (pkg_resources is gone from
setuptools 84), and its fog and glass_blur fail with numpy 2 and
scikit-image 0.26.

Outputs are deterministic: image k's random draws are seeded from
(corruption, severity, indices[k]), so a set of images gives the same bytes
on every run with the pinned libraries, whatever the batch it is in.

References:
  Hendrycks & Dietterich, Benchmarking Neural Network Robustness to Common
  Corruptions and Perturbations, ICLR 2019.
  Michaelis et al., Benchmarking Robustness in Object Detection: Autonomous
  Driving when Winter is Coming, 2019 (the `imagecorruptions` package).
"""

from collections.abc import Sequence
import contextlib
import threading

import numpy as np

from train.errors import UsageError

# The benchmark's 15 families, in its standard order (noise, blur, weather,
# digital).
CORRUPTIONS = (
    'gaussian_noise', 'shot_noise', 'impulse_noise',
    'defocus_blur', 'glass_blur', 'motion_blur', 'zoom_blur',
    'snow', 'frost', 'fog',
    'brightness', 'contrast', 'elastic_transform', 'pixelate',
    'jpeg_compression',
)
SEVERITIES = (1, 2, 3, 4, 5)
# Families whose output depends on random draws (the others are fixed
# functions of the image).
RANDOM_CORRUPTIONS = frozenset({
    'gaussian_noise', 'shot_noise', 'impulse_noise', 'glass_blur',
    'motion_blur', 'snow', 'frost', 'fog', 'elastic_transform'})

# The library's single-channel path is broken for these (see module doc).
_THREE_CHANNELS = frozenset({'glass_blur', 'motion_blur', 'frost'})
_LUMA = np.array([0.299, 0.587, 0.114])
# These take their seed as an argument; the rest draw from numpy's global
# RandomState, which is seeded around each call.
_SEED_ARGUMENT = frozenset({'impulse_noise', 'glass_blur'})
_ROOT_SEED = 20260113
# The global RandomState is shared: one corruption call at a time.
_LOCK = threading.Lock()


def check(corruption: str, severity: int) -> None:
  """Raises UsageError (a ValueError) naming the bad argument and the choices."""
  if corruption not in CORRUPTIONS:
    raise UsageError('corruption', corruption, 'unknown corruption',
                     CORRUPTIONS)
  if (isinstance(severity, bool) or not isinstance(severity, (int, np.integer))
      or severity not in SEVERITIES):
    raise UsageError('severity', severity, 'unknown severity', SEVERITIES)


def image_seed(corruption: str, severity: int, index: int) -> int:
  """The 32-bit seed of one image's random draws."""
  sequence = np.random.SeedSequence(
      (_ROOT_SEED, CORRUPTIONS.index(corruption), int(severity), int(index)))
  return int(sequence.generate_state(1)[0])


@contextlib.contextmanager
def _seeded_global_rng(seed: int):
  state = np.random.get_state()
  np.random.seed(seed)
  try:
    yield
  finally:
    np.random.set_state(state)


def _indices(indices: int | Sequence[int] | np.ndarray, n: int) -> np.ndarray:
  if isinstance(indices, (int, np.integer)) and not isinstance(indices, bool):
    indices = np.arange(int(indices), int(indices) + n)
  indices = np.asarray(indices)
  if (indices.shape != (n,) or indices.dtype.kind not in 'iu'
      or (n and indices.min() < 0)):
    raise UsageError('indices', indices if indices.size <= 8 else
                     f'array of shape {indices.shape}',
                     f'must be {n} non-negative integers (one per image), or '
                     'one integer (the first of consecutive indices)')
  return indices


def corrupt(images: np.ndarray, corruption: str, severity: int,
            indices: int | Sequence[int] | np.ndarray) -> np.ndarray:
  """Corrupts grey-level images with one family at one severity.

  Args:
    images: uint8 array (N, H, W) or (N, H, W, 1), values 0..255.
    corruption: one of `CORRUPTIONS`.
    severity: 1..5.
    indices: one non-negative integer per image that, with the corruption
      and severity, seeds its random draws (e.g. its index in the source data
      set); an int `i` stands for i, i + 1, ..., i + N - 1.

  Returns:
    uint8 array of the input's shape.

  Raises:
    UsageError: an unknown corruption, a severity outside 1..5, images of
      another dtype or shape, or indices that do not match the images.

  Example:
    >>> clean = np.zeros((2, 28, 28), np.uint8)
    >>> corrupt(clean, 'fog', 3, indices=[10, 11]).shape
    (2, 28, 28)
  """
  check(corruption, severity)
  images = np.asarray(images)
  if (images.dtype != np.uint8 or images.ndim not in (3, 4)
      or (images.ndim == 4 and images.shape[-1] != 1)):
    raise UsageError('images', f'{images.dtype} array of shape {images.shape}',
                     'must be uint8 grey-level images, shape (N, H, W) or '
                     '(N, H, W, 1)')
  indices = _indices(indices, len(images))
  # Lazy: the library loads OpenCV, numba and scikit-image (seconds).
  import imagecorruptions  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  function = imagecorruptions.corruption_dict[corruption]
  out = np.empty_like(images)
  with _LOCK:
    for k, (image, index) in enumerate(zip(images, indices)):
      grey = image.reshape(image.shape[:2])
      seed = image_seed(corruption, severity, index)
      kwargs = {'seed': seed} if corruption in _SEED_ARGUMENT else {}
      if corruption in _THREE_CHANNELS:
        grey = np.repeat(grey[..., None], 3, axis=-1)
      with _seeded_global_rng(seed):
        result = function(Image.fromarray(grey), severity, **kwargs)
      if corruption == 'frost':
        result = np.clip(np.rint(np.asarray(result) @ _LUMA), 0, 255)
      # As the library's own corrupt(): values are clipped to 0..255 there,
      # and truncated to uint8 here.
      result = np.uint8(np.asarray(result))
      if result.ndim == 3:
        result = result[..., 0]
      out[k] = result.reshape(out[k].shape)
  return out
