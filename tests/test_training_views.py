"""Training and evaluation views of images (`train.vision.crops`,
`datasets.CropFlipSplit`): geometry against hand-computed boxes and
brute-force searches, determinism in (seed, epoch, index), and resumable
batches through `input_pipeline.TrainBatches`."""

import numpy as np
import pytest

from train.training import input_pipeline
from train.errors import ConfigError
from train.vision import crops
from train.vision import datasets


def _position_image(height, width):
  """Pixel (r, c) holds (r, c, r + c) mod 256: every window is distinct."""
  r, c = np.meshgrid(np.arange(height), np.arange(width), indexing='ij')
  return np.stack([r % 256, c % 256, (r + c) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize('height,width,size,want', [
    # flax's ImageNet example: side int(224 / 256 * min(h, w)), offsets
    # ((h - side) + 1) // 2.
    (256, 300, 224, (16, 38, 224, 224)),
    (375, 500, 224, (24, 86, 328, 328)),
    (500, 333, 224, (105, 21, 291, 291)),
    # The padding is absolute: at size 32 it keeps half the side.
    (32, 32, 32, (8, 8, 16, 16)),
])
def test_central_box_is_flax_s_evaluation_crop(height, width, size, want):
  assert crops.central_box(height, width, size) == want


def test_central_crop_without_resizing_is_the_central_window():
  image = _position_image(256, 300)
  np.testing.assert_array_equal(crops.central_crop(image, 224),
                                image[16:240, 38:262])


def test_inception_boxes_lie_inside_with_the_paper_s_area_and_aspect():
  rng = np.random.default_rng(0)
  height, width = 400, 400  # Square: no aspect ratio fits more often.
  areas, ratios = [], []
  for _ in range(2000):
    top, left, h, w = crops.inception_box(height, width, rng)
    assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
    areas.append(h * w / (height * width))
    ratios.append(w / h)
  # Rounding w and h to pixels moves the area and ratio by under 1%.
  assert 0.08 * 0.98 <= min(areas) and max(areas) <= 1.0
  assert 3 / 4 * 0.98 <= min(ratios) and max(ratios) <= 4 / 3 * 1.02
  # Area uniform on [0.08, 1] (large ones rejected more often): all of it.
  assert min(areas) < 0.1 and max(areas) > 0.9
  assert abs(np.mean(np.log(ratios))) < 0.02  # log-uniform, centred on 1


def test_inception_crop_falls_back_to_the_central_crop():
  # A 2 x 400 strip fits no box of aspect ratio <= 4/3 and area >= 8%.
  image = _position_image(2, 400)
  assert crops.inception_box(2, 400, np.random.default_rng(0)) is None
  central = crops.central_crop(image, 16)
  for seed in range(4):
    out = crops.inception_crop(image, 16, np.random.default_rng(seed))
    assert (np.array_equal(out, central)
            or np.array_equal(out, central[:, ::-1]))


def test_inception_crops_vary_and_flip_half_the_time():
  image = _position_image(120, 160)
  outs = [crops.inception_crop(image, 32, np.random.default_rng(s))
          for s in range(200)]
  assert all(o.shape == (32, 32, 3) and o.dtype == np.uint8 for o in outs)
  # Column c of an unflipped view has a larger x-coordinate (green channel)
  # on its right than on its left.
  flipped = sum(int(o[:, -1, 1].astype(int).sum() < o[:, 0, 1].astype(int)
                    .sum()) for o in outs)
  assert 70 < flipped < 130
  assert len({o.tobytes() for o in outs}) == len(outs)


def _find_window(out, image, pad):
  """(top, left, flipped) of `out` in the reflect-padded image, by brute
  force over every offset."""
  padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode='reflect')
  h, w = image.shape[:2]
  found = [(t, l, f) for t in range(2 * pad + 1) for l in range(2 * pad + 1)
           for f in (False, True)
           if np.array_equal(out, (padded[t:t + h, l:l + w][:, ::-1] if f
                                   else padded[t:t + h, l:l + w]))]
  assert len(found) == 1
  return found[0]


def _array_split(n=40, size=32):
  images = np.stack([np.roll(_position_image(size, size), i, axis=0)
                     for i in range(n)])
  return datasets.ArraySplit(images, np.arange(n, dtype=np.int32))


def test_crop_flip_views_are_padded_windows_covering_every_offset():
  split = datasets.CropFlipSplit(_array_split(), seed=3)
  assert split.pad == 4  # 32 // 8, the SAM code's 4 pixels.
  seen = set()
  for epoch in range(6):
    batch = split.train_rows(np.arange(40), epoch)
    for i, out in enumerate(batch['image']):
      seen.add(_find_window(out, split.base.images[i], 4))
    np.testing.assert_array_equal(batch['label'], np.arange(40))
  offsets = {(t, l) for t, l, _ in seen}
  assert {t for t, _ in offsets} == set(range(9))
  assert {l for _, l in offsets} == set(range(9))
  assert {f for _, _, f in seen} == {False, True}
  # Evaluation and columns are the images as they are.
  np.testing.assert_array_equal(split.rows(np.arange(5))['image'],
                                split.base.images[:5])


def test_views_are_a_function_of_seed_epoch_and_index():
  split = datasets.CropFlipSplit(_array_split(), seed=3)
  a = split.train_rows(np.array([5, 9, 2]), 7)['image']
  # The same example gives the same view in any batch, at any position.
  b = split.train_rows(np.array([2, 5]), 7)['image']
  np.testing.assert_array_equal(a[0], b[1])
  np.testing.assert_array_equal(a[2], b[0])
  other_epoch = split.train_rows(np.array([5, 9, 2]), 8)['image']
  other_seed = datasets.CropFlipSplit(split.base, seed=4).train_rows(
      np.array([5, 9, 2]), 7)['image']
  assert not np.array_equal(a, other_epoch)
  assert not np.array_equal(a, other_seed)


def test_resumed_batches_equal_uninterrupted_ones_and_stay_on_the_host():
  split = datasets.CropFlipSplit(_array_split(n=64), seed=1)
  full = [b['image'] for b in input_pipeline.TrainBatches(
      split, 16, seed=0).iterate(0, 12)]
  resumed = [b['image'] for b in input_pipeline.TrainBatches(
      split, 16, seed=0).iterate(7, 12)]
  for a, b in zip(full[7:], resumed):
    np.testing.assert_array_equal(a, b)
  # An example seen in epoch 0 comes back in epoch 1 (4 steps each) in
  # another view.
  batches = input_pipeline.TrainBatches(split, 16, seed=0)
  example = batches.global_indices(0)[0]
  step, position = next((s, list(batches.global_indices(s)).index(example))
                        for s in range(4, 8)
                        if example in batches.global_indices(s))
  assert not np.array_equal(full[0][0], full[step][position])
  # Host-made views never go to the devices, however small the split.
  assert not input_pipeline.fits_on_devices(split, 1e6)
  assert input_pipeline.fits_on_devices(split.base, 1e6)


@pytest.mark.parametrize('name,augmentation,match', [
    ('cifar10', 'inception',
     r"config.augmentation='inception': not an augmentation of 'cifar10' "
     r"\(held in memory\); valid choices: 'none', 'crop_flip'"),
    ('imagenet2012', 'crop_flip',
     r"config.augmentation='crop_flip': not an augmentation of "
     r"'imagenet2012' \(decoded on demand\); valid choices: 'none', "
     r"'inception'"),
    ('digits', 'flip', r"valid choices: 'none', 'crop_flip'"),
])
def test_unknown_augmentations_name_the_field_and_the_choices(
    name, augmentation, match):
  with pytest.raises(ConfigError, match=match):
    datasets.check_augmentation(name, augmentation)


def test_default_augmentations_keep_older_runs_unchanged():
  assert datasets.default_augmentation('digits') == 'none'
  assert datasets.default_augmentation('cifar10') == 'none'
  assert datasets.default_augmentation('imagenet2012') == 'inception'
  assert set(datasets.AUGMENTATIONS) == {'none', 'crop_flip', 'inception'}
