"""Steering methods compared at the same KL: accuracy interpolated on the alpha sweep.

Each method's alpha sweep gives points (KL_a, accuracy_a) with a KL that
differs from method to method at the same alpha. To compare methods at the
same cost in distribution shift, each item's score is interpolated linearly
in KL between the two sweep points that bracket a target KL; the unsteered
model is the point KL = 0. Interpolating each item (not only the mean)
keeps the per-item scores that the bootstrap (`train.analysis.stats`) resamples,
and the mean of the interpolated items equals the interpolated mean
accuracy, since interpolation is linear.

A target KL beyond the sweep's largest is not extrapolated: it is NaN, and
the study reports the method as not reaching that KL. Where the KL is not
monotone in alpha (a gate that fires less at larger alpha), the points are
taken in order of KL: the curve is accuracy as a function of KL, whichever
alpha produced it.
"""

import numpy as np


def scores_at_kl(kl: np.ndarray, scores: np.ndarray, targets: np.ndarray,
                 base_scores: np.ndarray | None = None) -> np.ndarray:
  """Per-item scores interpolated at target KLs.

  Args:
    kl: (A,) KL of each sweep point (finite, >= 0).
    scores: (A, N) per-item scores at each point (e.g. 0/1 correctness).
    targets: (T,) KL values to read the curve at.
    base_scores: (N,) the unsteered model's scores, the point KL = 0;
      without it, targets below the smallest swept KL are NaN too.

  Returns:
    (T, N) interpolated scores; rows of targets outside the sweep are NaN.
  """
  kl = np.asarray(kl, np.float64)
  scores = np.asarray(scores, np.float64)
  targets = np.asarray(targets, np.float64)
  if kl.ndim != 1 or scores.ndim != 2 or scores.shape[0] != kl.shape[0]:
    raise ValueError(f'kl {kl.shape} and scores {scores.shape}: need (A,) '
                     'and (A, N)')
  if kl.size == 0:
    raise ValueError('kl: the sweep has no points')
  if not np.all(np.isfinite(kl)) or np.any(kl < 0):
    raise ValueError(f'kl={kl}: must be finite and >= 0')
  if base_scores is not None:
    base_scores = np.asarray(base_scores, np.float64)
    if base_scores.shape != scores.shape[1:]:
      raise ValueError(f'base_scores {base_scores.shape}: need '
                       f'{scores.shape[1:]}')
    kl = np.concatenate([[0.0], kl])
    scores = np.concatenate([base_scores[None], scores])
  order = np.argsort(kl, kind='stable')
  kl, scores = kl[order], scores[order]
  out = np.full((targets.size, scores.shape[1]), np.nan)
  for t, target in enumerate(targets):
    if not kl[0] <= target <= kl[-1]:
      continue
    hi = int(np.searchsorted(kl, target, side='left'))
    if kl[hi] == target:  # A swept point (the first of equal KLs).
      out[t] = scores[hi]
      continue
    lo = hi - 1
    w = (target - kl[lo]) / (kl[hi] - kl[lo])
    out[t] = (1 - w) * scores[lo] + w * scores[hi]
  return out
