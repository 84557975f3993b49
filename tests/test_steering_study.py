"""The steering study's statistics on constructed evaluations, against direct computations."""

import math

import numpy as np
import pytest

from studies.steering import intervals
from studies.steering import report

METHODS = ('addition', 'addition_gate', 'spherical', 'spherical_gate')


def _results(rng, kls, sets=2, items=12, accuracy=None, mc_seeds=(7, 8)):
  """An evaluation's results.json: `kls[method]` the sweep's KLs; item
  correctness drawn at `accuracy[method]` (default 0.5) per row."""
  accuracy = accuracy or {}
  rows = []
  for method, kl in [('none', [0.0])] + list(kls.items()):
    for a, k in enumerate(kl):
      p = accuracy.get(method, 0.5)
      row = {'method': method, 'alpha': 0.1 * a, 'kl': float(k)}
      for task in ('cloze', 'copa'):
        for score in ('sum', 'mean'):
          row[f'{task}_correct_{score}'] = (
              rng.random((sets, items)) < p).astype(int).tolist()
      row['positive_share'] = float(rng.random())
      row['gen_ce'] = float(1 + rng.random())
      rows.append(row)
  return {'meta': {'mc_seeds': list(mc_seeds), 'tasks': {'cloze': items}},
          'rows': rows}


def _sweeps(rng, top=0.8):
  return {m: np.sort(rng.uniform(0.01, top, 4)).tolist() for m in METHODS}


def test_item_scores_are_each_items_linear_interpolation_in_kl():
  rng = np.random.default_rng(0)
  res = _results(rng, _sweeps(rng))
  targets = (0.0, 0.05, 0.2, 0.33, 5.0)
  got = intervals.item_scores_at_kl(res, 'spherical_gate', 'cloze', targets)
  rows = [r for r in res['rows'] if r['method'] == 'spherical_gate']
  base = res['rows'][0]['cloze_correct_mean']
  kl = [0.0] + [r['kl'] for r in rows]
  for s in range(2):
    for n in range(12):
      ys = [base[s][n]] + [r['cloze_correct_mean'][s][n] for r in rows]
      for t, target in enumerate(targets):
        if target > kl[-1]:
          assert math.isnan(got[s][t, n])
        else:
          assert got[s][t, n] == pytest.approx(np.interp(target, kl, ys))


def test_matched_mean_is_the_nested_mean_and_unreached_kls_are_counted():
  rng = np.random.default_rng(1)
  runs = [_results(rng, _sweeps(rng, top)) for top in (0.9, 0.7, 0.25)]
  targets = (0.05, 0.2, 0.33)
  cells = intervals.matched(runs, 'addition', 'cloze', targets, num_samples=300)
  for t, target in enumerate(targets):
    per_lm = []
    for r in runs:
      rows = [x for x in r['rows'] if x['method'] == 'addition']
      kl = [0.0] + [x['kl'] for x in rows]
      if target > kl[-1]:
        per_lm = None
        break
      base = np.asarray(r['rows'][0]['cloze_correct_mean'], float)
      sets = [np.mean([np.interp(target, kl,
                                 [base[s][n]] + [x['cloze_correct_mean'][s][n]
                                                 for x in rows])
                       for n in range(12)]) for s in range(2)]
      per_lm.append(np.mean(sets))
    if per_lm is None:  # The third LM's sweep ends below this target.
      assert cells[t].reached == 2 and cells[t].of == 3
      assert math.isnan(cells[t].mean)
      assert 'not reached (2/3 LMs)' in cells[t].format()
    else:
      assert cells[t].mean == pytest.approx(np.mean(per_lm))
      assert cells[t].low <= cells[t].mean <= cells[t].high
      assert cells[t].high - cells[t].low > 0


def test_intervals_vanish_without_spread_and_paired_differences_of_a_method_with_itself():
  rng = np.random.default_rng(2)
  sweeps = _sweeps(rng)
  runs = [_results(rng, sweeps, accuracy={'spherical': 1.0, 'none': 1.0})
          for _ in range(3)]
  cell = intervals.matched(runs, 'spherical', 'copa', (0.1,),
                           num_samples=200)[0]
  assert (cell.mean, cell.low, cell.high) == (1.0, 1.0, 1.0)
  same = intervals.paired(runs, 'addition', 'addition', 'cloze', (0.1, 0.2),
                          num_samples=200)
  assert all((c.mean, c.low, c.high) == (0.0, 0.0, 0.0) for c in same)


def test_paired_difference_mean_is_the_difference_of_the_matched_means():
  rng = np.random.default_rng(3)
  runs = [_results(rng, _sweeps(rng)) for _ in range(3)]
  targets = (0.1, 0.2)
  a = intervals.matched(runs, 'spherical_gate', 'cloze', targets,
                        num_samples=50)
  b = intervals.matched(runs, 'addition', 'cloze', targets, num_samples=50)
  d = intervals.paired(runs, 'spherical_gate', 'addition', 'cloze', targets,
                       num_samples=400)
  for t in range(2):
    assert d[t].mean == pytest.approx(a[t].mean - b[t].mean)
    assert d[t].low < d[t].mean < d[t].high


@pytest.mark.parametrize('accuracy,expected', [
    # Only the gate helps: +1 on both geometries.
    (dict(addition=0.0, spherical=0.0, addition_gate=1.0, spherical_gate=1.0),
     dict(gate=1.0, rotation=0.0, interaction=0.0)),
    # Only the rotation helps.
    (dict(addition=0.0, addition_gate=0.0, spherical=1.0, spherical_gate=1.0),
     dict(gate=0.0, rotation=1.0, interaction=0.0)),
    # Only gate and rotation together help.
    (dict(addition=0.0, addition_gate=0.0, spherical=0.0, spherical_gate=1.0),
     dict(gate=0.5, rotation=0.5, interaction=1.0)),
])
def test_ablation_effects_on_constructed_two_by_two(accuracy, expected):
  rng = np.random.default_rng(4)
  sweeps = {m: [0.2, 0.4, 0.6] for m in METHODS}
  runs = [_results(rng, sweeps, accuracy=accuracy) for _ in range(3)]
  # At KL 0.4 and 0.6 every item sits on a swept point (no unsteered share).
  effects = intervals.ablation(runs, 'cloze', (0.4, 0.6), num_samples=100)
  for name, value in expected.items():
    for cell in effects[name]:
      assert (cell.mean, cell.low, cell.high) == pytest.approx(
          (value, value, value)), name


def test_scalar_at_kl_and_intervals_over_lms():
  rng = np.random.default_rng(5)
  runs = [_results(rng, _sweeps(rng, top)) for top in (0.9, 0.8, 0.15)]
  targets = (0.1, 0.3)
  vals = intervals.scalar_at_kl(runs, 'spherical', 'gen_ce', targets)
  for l, r in enumerate(runs):
    rows = [x for x in r['rows'] if x['method'] == 'spherical']
    kl = [0.0] + [x['kl'] for x in rows]
    ys = [r['rows'][0]['gen_ce']] + [x['gen_ce'] for x in rows]
    for t, target in enumerate(targets):
      if target > kl[-1]:
        assert math.isnan(vals[l, t])
      else:
        assert vals[l, t] == pytest.approx(np.interp(target, kl, ys))
  cells = intervals.over_lms(vals, num_samples=300)
  assert cells[0].mean == pytest.approx(vals[:, 0].mean())
  assert vals[:, 0].min() - 1e-12 <= cells[0].low <= cells[0].high <= (
      vals[:, 0].max() + 1e-12)
  assert cells[1].reached == 2  # The third LM stops at KL < 0.3.
  none = intervals.scalar_at_kl(runs, 'none', 'gen_ce', targets)
  np.testing.assert_array_equal(
      none, [[r['rows'][0]['gen_ce']] * 2 for r in runs])


def test_check_runs_refuses_unpaired_evaluations():
  rng = np.random.default_rng(6)
  sweeps = _sweeps(rng)
  runs = [_results(rng, sweeps), _results(rng, sweeps, mc_seeds=(7, 9))]
  with pytest.raises(ValueError, match=r'run 1: mc_seeds=\[7, 9\] differs'):
    intervals.check_runs(runs, METHODS)
  with pytest.raises(ValueError, match="method='iti': not in the evaluation"):
    intervals.check_runs(runs[:1], ('iti',))


def test_report_gain_over_unsteered_is_the_paired_difference_with_none():
  rng = np.random.default_rng(7)
  sweeps = {m: [0.2, 0.4, 0.6] for m in METHODS}
  # The unsteered model never picks the positive choice; the gated rotation
  # always does; the others at chance.
  runs = [_results(rng, sweeps, accuracy={'none': 0.0, 'spherical_gate': 1.0})
          for _ in range(3)]
  for r in runs:
    r['meta']['beta'] = 0.0
    for row in r['rows']:
      row.update(trigger_rate=0.5, distinct_2=0.4, repetition_3=0.0)
  targets = (0.1, 0.4)
  summary = report.build(runs, {}, targets, num_samples=200)
  gain = summary['gain']['cloze']
  assert set(gain) == set(METHODS)
  # At KL 0.4 (a swept point) the gated rotation gains exactly 100 points;
  # at KL 0.1, half-way from the unsteered row to the first swept point, 50.
  assert [c['mean'] for c in gain['spherical_gate']] == pytest.approx(
      [0.5, 1.0])
  assert (gain['spherical_gate'][1]['low'], gain['spherical_gate'][1]['high']
          ) == pytest.approx((1.0, 1.0))
  for m in METHODS:
    direct = intervals.paired(runs, m, 'none', 'cloze', targets,
                              num_samples=200)
    matched = intervals.matched(runs, m, 'cloze', targets, num_samples=50)
    for t in range(2):
      assert gain[m][t]['mean'] == pytest.approx(direct[t].mean)
      assert gain[m][t]['mean'] == pytest.approx(matched[t].mean)  # none = 0
  text = report.markdown(summary)
  assert '**cloze: gain over the unsteered model (points, items paired)**' in text
  assert '| spherical_gate - none | 50.0 [50.0, 50.0] | 100.0 [100.0, 100.0] |' in text


def test_report_of_a_choices_only_evaluation_has_no_generation_tables():
  # Generation off (e.g. the gate x geometry ablation): rows carry no
  # generation measures, and the report still builds, with the ablation.
  rng = np.random.default_rng(8)
  runs = [_results(rng, _sweeps(rng)) for _ in range(2)]
  for r in runs:
    r['meta']['beta'] = -0.9
    for row in r['rows']:
      del row['positive_share'], row['gen_ce']
      row['trigger_rate'] = 0.3
  summary = report.build(runs, {}, (0.1, 0.2), num_samples=100)
  assert summary['generation'] == {}
  assert set(summary['ablation']['cloze']) == {'gate', 'rotation',
                                               'interaction'}
  text = report.markdown(summary)
  assert 'Generations' not in text
  assert '**cloze: gate x geometry (points)**' in text
