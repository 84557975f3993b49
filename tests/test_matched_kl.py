"""train.steering.matched_kl against direct computations on constructed sweeps."""

import numpy as np
import pytest

from train.steering import matched_kl


def _sweep(rng, a=6, n=40):
  kl = np.sort(rng.uniform(0.01, 1.0, a))
  return kl, rng.integers(0, 2, (a, n)).astype(float)


def test_at_a_swept_kl_the_scores_are_that_points():
  kl, scores = _sweep(np.random.default_rng(0))
  out = matched_kl.scores_at_kl(kl, scores, kl)
  np.testing.assert_array_equal(out, scores)


def test_between_points_it_is_the_linear_interpolation_of_each_item():
  rng = np.random.default_rng(1)
  kl, scores = _sweep(rng)
  for i in range(len(kl) - 1):
    w = rng.uniform()
    target = (1 - w) * kl[i] + w * kl[i + 1]
    out = matched_kl.scores_at_kl(kl, scores, [target])[0]
    np.testing.assert_allclose(out, (1 - w) * scores[i] + w * scores[i + 1],
                               atol=1e-12)
    # The mean commutes: the accuracy curve read at the target.
    assert out.mean() == pytest.approx(
        np.interp(target, kl, scores.mean(axis=1)))


def test_order_of_the_sweep_does_not_matter():
  rng = np.random.default_rng(2)
  kl, scores = _sweep(rng)
  perm = rng.permutation(len(kl))
  targets = rng.uniform(kl[0], kl[-1], 7)
  np.testing.assert_array_equal(
      matched_kl.scores_at_kl(kl[perm], scores[perm], targets),
      matched_kl.scores_at_kl(kl, scores, targets))


def test_outside_the_sweep_is_nan_and_the_base_point_closes_the_gap():
  kl = np.array([0.2, 0.4])
  scores = np.array([[1.0, 0.0], [1.0, 1.0]])
  out = matched_kl.scores_at_kl(kl, scores, [0.1, 0.5])
  assert np.all(np.isnan(out))
  base = np.array([0.0, 0.0])
  out = matched_kl.scores_at_kl(kl, scores, [0.0, 0.1, 0.3], base)
  np.testing.assert_allclose(out, [[0, 0], [0.5, 0], [1, 0.5]])


def test_a_non_monotone_sweep_reads_the_curve_in_kl_order():
  # alpha 0.2, 0.5, 1.0 with KL 0.3, 0.1, 0.2: sorted by KL the curve is
  # (0.1, s1), (0.2, s2), (0.3, s0).
  kl = np.array([0.3, 0.1, 0.2])
  scores = np.array([[1.0], [0.0], [0.5]])
  out = matched_kl.scores_at_kl(kl, scores, [0.15, 0.25])
  np.testing.assert_allclose(out, [[0.25], [0.75]])


def test_bad_shapes_and_kls():
  with pytest.raises(ValueError, match='need \\(A,\\) and \\(A, N\\)'):
    matched_kl.scores_at_kl(np.ones(3), np.ones((2, 4)), [0.1])
  with pytest.raises(ValueError, match='no points'):
    matched_kl.scores_at_kl(np.ones(0), np.ones((0, 4)), [0.1])
  with pytest.raises(ValueError, match='finite and >= 0'):
    matched_kl.scores_at_kl(np.array([0.1, np.nan]), np.ones((2, 1)), [0.1])
  with pytest.raises(ValueError, match='base_scores'):
    matched_kl.scores_at_kl(np.ones(2), np.ones((2, 3)), [0.1], np.ones(2))
