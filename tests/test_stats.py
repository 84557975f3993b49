"""train.analysis.stats against direct computations: exact enumeration on tiny
data, the closed-form variance of the two-level bootstrap, and edges."""

import itertools
import math

import numpy as np
import pytest

from train import errors
from train.analysis import stats


def test_nested_mean_weighs_every_unit_the_same():
  data = [[np.array([1.0, 0.0]), np.array([1.0])],  # Seed 0: sets 0.5, 1.
          [np.array([0.0, 0.0, 0.0, 1.0])]]  # Seed 1: 0.25.
  assert stats.nested_mean(data) == pytest.approx((0.75 + 0.25) / 2)


def test_one_level_matches_the_exact_bootstrap_distribution():
  items = np.array([0.0, 1.0, 3.0])
  # Every one of the 27 equally likely resamples, enumerated.
  exact = np.array([items[list(i)].mean()
                    for i in itertools.product(range(3), repeat=3)])
  reps = stats.replicates(items, num_samples=200_000, seed=1)
  assert reps.mean() == pytest.approx(exact.mean(), abs=0.01)
  assert reps.var() == pytest.approx(exact.var(), rel=0.02)
  for q in (0.1, 0.5, 0.9):
    assert abs(np.quantile(reps, q) - np.quantile(exact, q)) <= 1 / 3 + 1e-9


def test_two_levels_match_the_closed_form_variance():
  # Var of a two-stage bootstrap mean with S seeds of n items each:
  # (1/S) [ pop. var of the seed means + mean over seeds of (var_s / n) ].
  rng = np.random.default_rng(0)
  # Both levels weigh about the same here, so dropping either shows.
  s, n = 3, 4
  seeds = [rng.normal(mu, 1.0, size=n) for mu in (0.0, 0.5, 1.0)]
  means = np.array([x.mean() for x in seeds])
  expected = (means.var() + np.mean([x.var() / n for x in seeds])) / s
  reps = stats.replicates(seeds, num_samples=100_000, seed=2)
  assert reps.var() == pytest.approx(expected, rel=0.03)
  assert reps.mean() == pytest.approx(means.mean(), abs=0.02)


def _plain_replicates(data, n, rng):
  # The resampling as first written: drawn while it resamples, no cache.
  if isinstance(data, np.ndarray):
    return data[rng.integers(0, data.size, size=(n, data.size))].mean(axis=1)
  k = len(data)
  picks = rng.integers(0, k, size=(n, k))
  draws = [_plain_replicates(child, int((picks == c).sum()), rng)
           for c, child in enumerate(data)]
  out = np.empty((n, k))
  for c in range(k):
    out[picks == c] = draws[c]
  return out.mean(axis=1)


def test_replicates_are_the_plain_resamplings_bit_for_bit():
  # Stored reports' intervals were made by the plain resampling; the cached
  # draws must give the same bits, for a second data of the same shape
  # (a cache hit) as for the first, and on ragged levels.
  rng = np.random.default_rng(11)
  for shape in ([[7, 3], [5]], [4, 4, 9], [[[2, 6]], [[3], [1, 8]]]):
    def make(s):
      return (rng.normal(size=s) if isinstance(s, int)
              else [make(child) for child in s])
    for seed in (0, 3, 0):
      data = make(shape)
      want = _plain_replicates(data, 301, np.random.default_rng(seed))
      got = stats.replicates(data, 301, seed)
      np.testing.assert_array_equal(got, want)
  # Past the cache's bound the draws are made, not kept, with the same bits.
  big = [rng.normal(size=3000), rng.normal(size=2000)]
  n = stats.CACHED_INDICES // 5000 + 1
  misses = stats._cached_plan.cache_info().misses
  np.testing.assert_array_equal(
      stats.replicates(big, n, 4),
      _plain_replicates(big, n, np.random.default_rng(4)))
  assert stats._cached_plan.cache_info().misses == misses


def test_identical_methods_give_a_zero_width_paired_interval():
  rng = np.random.default_rng(3)
  correct = [[rng.integers(0, 2, 50).astype(float) for _ in range(3)]
             for _ in range(3)]
  diff = [[c - c for c in seed] for seed in correct]
  assert stats.interval(diff, 500) == (0.0, 0.0, 0.0)


def test_constant_data_and_the_interval_contains_the_mean():
  const = [[np.full(5, 0.7)], [np.full(9, 0.7)]]
  m, lo, hi = stats.interval(const, 300)
  assert m == pytest.approx(0.7) and lo == pytest.approx(0.7)
  assert hi == pytest.approx(0.7)
  rng = np.random.default_rng(4)
  data = [rng.integers(0, 2, 200).astype(float) for _ in range(3)]
  m, lo, hi = stats.interval(data, 2000, seed=5)
  assert lo < m < hi
  # A 95% interval of three seeds of 200 coin flips: about +-1.96 SE.
  se = np.sqrt(0.25 / 600)
  assert 2 * 1.96 * se * 0.6 < hi - lo < 2 * 1.96 * se * 1.8


def test_the_interval_is_a_function_of_its_seed():
  data = [np.arange(10.0), np.arange(5.0)]
  assert stats.interval(data, 400, seed=7) == stats.interval(
      data, 400, seed=7)
  assert stats.interval(data, 400, seed=7) != stats.interval(
      data, 400, seed=8)


@pytest.mark.parametrize('data, message', [
    ([], 'data: a level must be a non-empty list'),
    ([np.array([1.0]), []], r'data\[1\]: a level must be a non-empty list'),
    ([np.array([1.0]), [np.array([1.0])]], 'data: children differ in depth'),
    ([np.zeros(0)], r'data\[0\]: a leaf must be a non-empty 1-D array'),
    ([np.zeros((2, 2))], r'data\[0\]: a leaf must be a non-empty 1-D'),
    ([np.array([1.0, np.nan])], r'data\[0\]: item scores must be finite'),
])
def test_malformed_data_is_one_line_naming_the_position(data, message):
  with pytest.raises(ValueError, match=message):
    stats.interval(data, 10)


def test_bad_arguments():
  with pytest.raises(ValueError, match='num_samples=0'):
    stats.replicates([np.ones(3)], 0)
  with pytest.raises(ValueError, match='level=1'):
    stats.interval([np.ones(3)], 10, level=1)


def test_mean_std_is_the_sample_deviation_of_the_scaled_values():
  values = [0.25, 0.5, 0.125]
  scaled = np.array(values) * 100
  assert stats.mean_std(values, 100.0) == (
      f'{scaled.mean():.1f} ± {scaled.std(ddof=1):.1f}')
  assert stats.mean_std([0.5], 100.0, digits=2) == '50.00'
  assert stats.mean_std([]) == '-'
  assert stats.mean_std([4.34e4, -2.27e5], digits=2, notation='e') == (
      '-9.18e+04 ± 1.91e+05')
  with pytest.raises(ValueError, match="notation='g'.*'f', 'e'"):
    stats.mean_std([1.0], notation='g')


def test_t_interval_is_students_from_the_table_quantiles():
  # t_{0.975} with 2 and 9 degrees of freedom: 4.303 and 2.262 (tables).
  lo, hi = stats.t_interval([1.0, 2.0, 3.0])
  assert (lo, hi) == (pytest.approx(2 - 4.3027 / np.sqrt(3), abs=1e-4),
                      pytest.approx(2 + 4.3027 / np.sqrt(3), abs=1e-4))
  values = np.random.default_rng(0).normal(size=10)
  lo, hi = stats.t_interval(list(values), level=0.95)
  half = 2.2622 * values.std(ddof=1) / np.sqrt(10)
  assert (lo, hi) == (pytest.approx(values.mean() - half, abs=1e-4),
                      pytest.approx(values.mean() + half, abs=1e-4))
  assert all(np.isnan(stats.t_interval([1.0])))
  with pytest.raises(ValueError, match='level=1'):
    stats.t_interval([1.0, 2.0], level=1)


def test_markdown_table_aligns_and_checks_its_columns():
  table = stats.markdown_table(['run', 'acc'], [['a', 1.5], ['b', '-']])
  assert table.splitlines() == ['| run | acc |', '|:--|--:|', '| a | 1.5 |',
                                '| b | - |']
  with pytest.raises(ValueError, match='2 cells, the header 3'):
    stats.markdown_table(['a', 'b', 'c'], [[1, 2]])
  with pytest.raises(ValueError, match='align'):
    stats.markdown_table(['a', 'b'], [], align='l')


def test_markdown_table_plain_rule_and_bad_align():
  table = stats.markdown_table(['run', 'acc', 'n'], [['a', 1.5, 3]],
                               align='-r-')
  assert table == '| run | acc | n |\n|---|--:|---|\n| a | 1.5 | 3 |'
  with pytest.raises(ValueError, match="'l', 'r', 'c', '-'"):
    stats.markdown_table(['a', 'b'], [], align='lx')


def test_a_seed_count_is_refused_outside_what_a_study_can_run():
  assert stats.check_seed_count('--seeds', stats.MIN_SEEDS) == 1
  assert stats.check_seed_count('--seeds', '3') == 3
  assert stats.check_seed_count('--seeds', stats.MAX_SEEDS) == 1000
  for bad in (0, -1, 'x', '', None, 2.5, True):
    with pytest.raises(errors.UsageError,
                       match=r'^--seeds=.*: must be an integer >= 1: a study '
                       'needs at least 1 seed'):
      stats.check_seed_count('--seeds', bad)
  with pytest.raises(errors.UsageError,
                     match=r'^--seeds=1001: must be at most 1000 seeds'):
    stats.check_seed_count('--seeds', stats.MAX_SEEDS + 1)


def test_a_seed_list_must_be_distinct_seeds_and_not_empty():
  assert stats.check_seed_list('--lm_seeds', ['0', '2']) == [0, 2]
  assert stats.check_seed_list('--lm_seeds', ['5']) == [5]
  assert stats.check_seed_list('--lm_seeds', [str(2**32 - 1)]) == [2**32 - 1]
  at_most = [str(i) for i in range(stats.MAX_SEEDS)]
  assert len(stats.check_seed_list('--lm_seeds', at_most)) == 1000
  for bad, problem in ((['0', '0'], 'has a repeated value'),
                       (['1', '01'], 'has a repeated value'),
                       ([], 'give at least one seed'),
                       (['-1'], r'seeds are integers in \[0, 2\*\*32\)'),
                       ([str(2**32)], r'seeds are integers in \[0, 2\*\*32\)'),
                       ([*at_most, '1000'], 'must be at most 1000 seeds'),
                       (['x'], 'not a number')):
    with pytest.raises(errors.UsageError, match=f'^--lm_seeds=.*: {problem}'):
      stats.check_seed_list('--lm_seeds', bad)


def test_spearman_ranks_ties_and_constants():
  assert stats.spearman([1, 2, 3], [10, 20, 30]) == 1.0
  assert stats.spearman([1, 2, 3], [3, 2, 1]) == -1.0
  assert np.isclose(stats.spearman([1, 2, 2, 3], [1, 2, 3, 4]),
                    np.corrcoef([0, 1.5, 1.5, 3], [0, 1, 2, 3])[0, 1])
  assert math.isnan(stats.spearman([1, 1, 1], [1, 2, 3]))
  assert math.isnan(stats.spearman([1, float('nan')], [1, 2]))
