"""Symmetric label noise on a training split (the setting of SAM's largest gains).

Foret et al. (2021, Table 4) and the label-noise literature they follow
corrupt a fraction of the training labels uniformly at random. Our
choices, so that a rate means the same thing on every run and machine:

- exactly round(rate * N) examples are corrupted (not each one with
  probability `rate`), chosen by a seeded permutation;
- each corrupted label becomes a class drawn uniformly from the *other*
  classes, so every corrupted label is wrong and the realised noise rate
  is the rate asked for (a draw over all classes would leave 1/K of them
  right);
- only the training split is corrupted: validation and test keep their
  clean labels, so test accuracy measures what was learned, not how well
  the noise was fitted;
- the corruption has its own seed (`config.label_noise_seed`), separate
  from the training seed, so that seeds of a study train on the same
  noisy data set and their spread is the training's.
"""

import numpy as np

__all__ = ['symmetric']


def symmetric(labels: np.ndarray, num_classes: int, rate: float,
              seed: int) -> np.ndarray:
  """A copy of `labels` with round(rate * N) of them flipped to another class.

  Args:
    labels: (N,) integer labels in [0, num_classes).
    num_classes: K >= 2.
    rate: in [0, 1).
    seed: the corruption's seed (the same seed gives the same labels).

  Returns:
    (N,) labels of the same dtype; exactly round(rate * N) differ from
    `labels`, each uniform over the K - 1 other classes.
  """
  if not 0.0 <= rate < 1.0:
    raise ValueError(f'label noise rate {rate} is outside [0, 1)')
  if num_classes < 2:
    raise ValueError(f'num_classes={num_classes}: label noise needs >= 2')
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  n_flip = int(round(rate * len(labels)))
  flipped = rng.permutation(len(labels))[:n_flip]
  # An offset in [1, K) added modulo K: uniform over the other classes.
  offsets = rng.integers(1, num_classes, size=n_flip)
  out = labels.copy()
  out[flipped] = (labels[flipped] + offsets) % num_classes
  return out
