"""geom.gas: budgets and admission, the bandit, the execution-aware rule,
the curvature fit, diagnostics and argument errors (the estimators'
numerics are in test_curvature.py)."""

import dataclasses
import math

import numpy as np
import pytest

from geom import gas
from geom import validation

D5 = (1.0, 2.0, 3.0, 4.0, 5.0)


def _options(**fields):
  return gas.GasOptions(**{'difficulties': D5, **fields})


def _reference_budgets(s_base, alpha, difficulties, coupling=0.0,
                       probs=None):
  """The formula written out with Python floats."""
  lam = alpha / 2
  d0 = difficulties[0]
  scale = s_base
  if coupling:
    mean = sum(p * (d - d0) for p, d in zip(probs, difficulties))
    plain = sum(d - d0 for d in difficulties) / len(difficulties)
    scale *= math.exp(-coupling * lam * max(mean - plain, 0.0))
  return [int(math.floor(scale * math.exp(-lam * (d - d0)) + 1e-9))
          for d in difficulties]


def test_budgets_follow_the_formula_on_random_settings():
  rng = np.random.default_rng(0)
  for _ in range(300):
    n = int(rng.integers(1, 7))
    difficulties = tuple(np.sort(rng.choice(50, n, replace=False))
                         .astype(float) / rng.uniform(1, 10))
    s_base = int(rng.integers(0, 40))
    alpha = float(rng.exponential(1.0))
    options = gas.GasOptions(difficulties=difficulties, s_base=s_base,
                             alpha=alpha, coupling=0.0)
    got = gas.budgets(gas.init(options), options).tolist()
    assert got == _reference_budgets(s_base, alpha, difficulties)
    assert got[0] == s_base  # The easiest difficulty keeps s_base.
    assert got == sorted(got, reverse=True)


def test_coupling_tightens_budgets_only_when_the_curriculum_is_harder():
  options = _options(s_base=8, alpha=0.4, coupling=1.0)
  state = gas.init(options)
  uniform = np.full(5, 0.2)
  plain = gas.budgets(state, dataclasses.replace(options, coupling=0.0))
  assert gas.budgets(state, options, uniform).tolist() == plain.tolist()
  easy = np.array([1.0, 0, 0, 0, 0])
  assert gas.budgets(state, options, easy).tolist() == plain.tolist()
  hard = np.array([0, 0, 0, 0, 1.0])
  got = gas.budgets(state, options, hard).tolist()
  assert got == _reference_budgets(8, 0.4, D5, 1.0, hard)
  assert got[0] < plain[0]


def test_no_admitted_sample_is_over_its_budget():
  rng = np.random.default_rng(1)
  for _ in range(200):
    options = _options(s_base=int(rng.integers(0, 12)),
                       alpha=float(rng.uniform(0, 3)),
                       coupling=float(rng.uniform(0, 2)),
                       bandit=str(rng.choice(gas.BANDITS)))
    state = gas.init(options)
    for _ in range(int(rng.integers(0, 20))):
      state = gas.observe_signal(state, options, int(rng.integers(5)),
                                 float(rng.uniform()))
    limits = gas.budgets(state, options)
    for _ in range(20):
      b, lag = int(rng.integers(5)), int(rng.integers(0, 15))
      assert gas.admit(state, options, b, lag) == (lag <= limits[b])


def test_edges_zero_base_huge_alpha_and_one_bucket():
  options = _options(s_base=0, alpha=5.0)
  assert gas.budgets(gas.init(options), options).tolist() == [0] * 5
  options = _options(s_base=4, alpha=1e6)
  assert gas.budgets(gas.init(options), options).tolist() == [4, 0, 0, 0, 0]
  one = gas.GasOptions(difficulties=(3.0,), s_base=5)
  state = gas.init(one)
  assert gas.budgets(state, one).tolist() == [5]
  assert gas.dispatch(state, one, 0.99)[0] == 0
  assert gas.loss_weight(gas.init(options), options, 0) == 1.0
  assert gas.loss_weight(gas.init(options), options, 1) == 0.0


def test_loss_weight_is_exp_minus_lambda_d():
  options = _options(alpha=0.6)
  state = gas.init(options)
  for b, d in enumerate(D5):
    assert gas.loss_weight(state, options, b) == pytest.approx(
        math.exp(-0.3 * (d - 1)))


def test_learning_signal_closed_forms():
  rewards = [1, 1, 0, 0, 1, 1, 1, 1]  # Groups of 4: p = 0.5 and 1.
  assert gas.learning_signal(rewards, 4, 'learnability') == pytest.approx(
      (0.25 + 0.0) / 2)
  assert gas.learning_signal(rewards, 4, 'abs_advantage') == pytest.approx(
      (0.5 + 0.0) / 2)
  rng = np.random.default_rng(2)
  binary = rng.integers(0, 2, 64).astype(float)
  p = binary.reshape(-1, 8).mean(-1)
  # For binary rewards mean |r - p| = 2 p (1 - p) per group.
  assert gas.learning_signal(binary, 8, 'abs_advantage') == pytest.approx(
      np.mean(2 * p * (1 - p)))
  with pytest.raises(validation.ArgumentError, match='rewards'):
    gas.learning_signal(np.zeros(7), 4, 'learnability')
  with pytest.raises(validation.ArgumentError, match='learnability'):
    gas.learning_signal(np.zeros(8), 4, 'entropy')


@pytest.mark.parametrize('bandit', ['boltzmann', 'ucb'])
def test_the_bandit_tracks_the_best_arm_when_it_moves(bandit):
  """Four arms whose mean signal changes at t = 600: the best arm goes
  from 1 to 3. Both phases must end with the best arm chosen most."""
  options = gas.GasOptions(difficulties=(1.0, 2.0, 3.0, 4.0),
                           bandit=bandit, discount=0.97, temperature=0.03,
                           exploration=0.1, floor=0.08)
  state = gas.init(options)
  rng = np.random.default_rng(3)
  means = [np.array([0.05, 0.2, 0.1, 0.0]), np.array([0.05, 0.0, 0.1, 0.2])]
  chosen = []
  for t in range(1200):
    m = means[t >= 600]
    probs = gas.probabilities(state, options)
    assert probs.min() >= options.floor / 4 - 1e-12
    assert probs.sum() == pytest.approx(1.0)
    b = int(rng.choice(4, p=probs))
    chosen.append(b)
    state = gas.observe_signal(state, options, b,
                               float(np.clip(m[b] + rng.normal(0, 0.05),
                                             0, 1)))
  first, second = np.array(chosen[400:600]), np.array(chosen[1000:])
  assert np.mean(first == 1) > 0.6, np.bincount(first, minlength=4)
  assert np.mean(second == 3) > 0.6, np.bincount(second, minlength=4)


def test_uniform_bandit_ignores_the_signal():
  options = _options(bandit='uniform')
  state = gas.observe_signal(gas.init(options), options, 2, 1.0)
  assert gas.probabilities(state, options).tolist() == [0.2] * 5


def _with_lags(options, latency, step):
  state = gas.init(options)
  for b, seconds in enumerate(latency):
    state = gas.observe_latency(state, options, b, seconds)
  return gas.observe_latency(state, options, step_seconds=step)


def test_expected_lag_is_ceil_latency_over_step_time():
  options = _options(latency_decay=0.0)
  state = _with_lags(options, [0.5, 1.0, 2.5, 3.0, 7.1], 1.0)
  assert gas.expected_lag(state).tolist() == [1, 1, 3, 3, 8]
  assert gas.expected_lag(gas.init(options)).tolist() == [0] * 5


def test_a_bucket_that_cannot_arrive_in_budget_is_deferred_not_dropped():
  # Budgets 4, 2, 1, 0, 0 (alpha 1.2); lags 1, 1, 1, 3, 3: buckets 3 and 4
  # can never arrive within budget; 0-2 fit.
  options = _options(s_base=4, alpha=1.2, coupling=0.0, bandit='uniform',
                     max_defer=3, latency_decay=0.0)
  state = _with_lags(options, [1, 1, 1, 3, 3], 1.0)
  assert gas.budgets(state, options).tolist() == [4, 2, 1, 0, 0]
  hard = 0.9  # u = 0.9 draws bucket 4 from the uniform curriculum.
  b, state = gas.dispatch(state, options, hard)
  assert b in (0, 1, 2) and state.pending == (4,)
  assert state.counts[1].tolist() == [0, 0, 0, 0, 1]  # Deferred once.
  assert state.credit.tolist() == [int(i == b) for i in range(5)]
  # A deferred bucket waits at most max_defer dispatches, then goes.
  out = []
  for _ in range(4):
    b, state = gas.dispatch(state, options, 0.1)
    out.append(b)
  assert set(out[:2]) <= {0, 1, 2} and 4 in out[2:], out
  assert state.pending == ()
  # Without the rule the drawn bucket goes at once.
  plain = dataclasses.replace(options, execution_aware=False)
  assert gas.dispatch(_with_lags(plain, [1, 1, 1, 3, 3], 1.0), plain,
                      hard)[0] == 4


def test_a_deferred_bucket_goes_first_once_it_fits():
  options = _options(s_base=4, alpha=0.0, coupling=0.0, bandit='uniform',
                     latency_decay=0.0)
  state = _with_lags(options, [1, 1, 1, 1, 3], 1.0)
  # With lead 1 only lag-1 buckets fit: bucket 4 (lag 3) is deferred.
  b, state = gas.dispatch(state, options, 0.9, lead=1)
  assert b != 4 and state.pending == (4,)
  # With lead 3 it fits, and goes before a new draw.
  b, state = gas.dispatch(state, options, 0.1, lead=3)
  assert b == 4 and state.pending == ()
  # When nothing fits, the drawn bucket goes (deferring would not help).
  b, _ = gas.dispatch(state, options, 0.9, lead=0)
  assert b == 4


def test_dispatch_never_starves_a_bucket():
  """Random lags, leads and draws: every drawn bucket is dispatched within
  max_defer + 1 dispatches, so the dispatched mix is the drawn one."""
  rng = np.random.default_rng(4)
  options = _options(s_base=3, alpha=0.8, bandit='uniform', max_defer=5,
                     latency_decay=0.0)
  state = _with_lags(options, rng.uniform(0.1, 4, 5), 1.0)
  for _ in range(2000):
    before = state.counts.copy()
    b, state = gas.dispatch(state, options, float(rng.random()),
                            lead=int(rng.integers(0, 5)))
    assert state.counts[0].sum() == before[0].sum() + 1
    assert max(state.pending_age, default=0) <= options.max_defer
    assert len(state.pending) <= options.max_defer + 1
  drawn = state.counts[0] + np.bincount(state.pending, minlength=5)
  assert drawn.min() > 0.15 * drawn.sum()


def test_a_bucket_that_never_fits_still_trains_its_share():
  # Bucket 4 can never arrive within budget (lag 3 > budget 0): it is
  # always deferred, forced after max_defer, and its substitutes go on
  # credit, so every bucket trains its curriculum share (0.2) rather than
  # bucket 4 training p / (1 + p) = 1/6.
  options = _options(s_base=4, alpha=1.2, coupling=0.0, bandit='uniform',
                     max_defer=4, latency_decay=0.0)
  state = _with_lags(options, [1, 1, 1, 1, 3], 1.0)
  rng = np.random.default_rng(6)
  for _ in range(6000):
    _, state = gas.dispatch(state, options, float(rng.random()))
    assert state.credit.max() <= options.max_defer + 1
  share = state.counts[0] / state.counts[0].sum()
  assert np.all(np.abs(share - 0.2) < 0.015), share
  assert state.counts[1, 4] > 1000  # Deferred nearly every time.


def test_fit_alpha_and_the_clamp_on_a_falling_curvature():
  options = _options(alpha=0.0, alpha_decay=0.0, curvature_decay=0.0)
  state = gas.init(options)
  for b, d in enumerate(D5):
    state = gas.observe_curvature(state, options, b, math.exp(2 + 0.7 * d))
  assert state.slope == pytest.approx(0.7)
  assert state.alpha == pytest.approx(0.7)
  falling = gas.init(options)
  for b, d in enumerate(D5):
    falling = gas.observe_curvature(falling, options, b, math.exp(-0.3 * d))
  assert falling.slope == pytest.approx(-0.3) and falling.alpha == 0.0
  fixed = dataclasses.replace(options, estimate_alpha=False, alpha=0.25)
  kept = gas.init(fixed)
  for b, d in enumerate(D5):
    kept = gas.observe_curvature(kept, fixed, b, math.exp(d))
  assert kept.alpha == 0.25 and kept.slope == pytest.approx(1.0)


def test_diagnostics_name_every_bucket_and_counter():
  options = _options()
  state = gas.record_admission(gas.init(options), 2, False, samples=64)
  out = gas.diagnostics(state, options)
  for name in ('budget', 'probability', 'latency', 'expected_lag',
               'log_curvature', *gas.COUNTS):
    assert all(f'{name}/d{d:g}' in out for d in D5)
  assert out['dropped/d3'] == 64 and out['admitted/d3'] == 0
  assert out['alpha'] == options.alpha and out['lambda'] == options.alpha / 2


@pytest.mark.parametrize('field,value', [
    ('difficulties', ()), ('difficulties', (2.0, 1.0)), ('s_base', -1),
    ('s_base', 1.5), ('alpha', -0.1), ('alpha', float('inf')),
    ('bandit', 'thompson'), ('signal', 'loss'), ('discount', 0.0),
    ('temperature', 0.0), ('floor', 1.5), ('coupling', -1.0),
    ('max_defer', -1), ('latency_decay', 1.0),
])
def test_bad_options_are_refused_when_built_naming_the_field(field, value):
  with pytest.raises(validation.ArgumentError, match=field):
    _options(**{field: value})


def test_fit_alpha_recovers_the_slope():
  d = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
  for c, alpha in ((0.3, 0.7), (-2.0, -0.25), (1.0, 0.0)):
    assert gas.fit_alpha(d, c + alpha * d) == pytest.approx(alpha, abs=1e-12)
  # Unmeasured (NaN) buckets are left out of the fit.
  y = -1.0 + 0.9 * d
  y[[1, 3]] = np.nan
  assert gas.fit_alpha(d, y) == pytest.approx(0.9, abs=1e-12)
  # Unequal spacing: the least-squares slope, not an endpoint difference.
  d2 = np.array([1.0, 2.0, 4.0])
  y2 = np.array([0.0, 1.0, 1.0])
  dc = d2 - d2.mean()
  assert gas.fit_alpha(d2, y2) == pytest.approx(
      float(dc @ (y2 - y2.mean()) / (dc @ dc)), abs=1e-12)


@pytest.mark.parametrize('log_curvature', [
    [np.nan] * 5, [np.nan, 2.0, np.nan, np.nan, np.nan], [1.0], []])
def test_fit_alpha_is_nan_with_fewer_than_two_buckets(log_curvature):
  d = np.arange(1.0, len(log_curvature) + 1)
  assert np.isnan(gas.fit_alpha(d, log_curvature))
