"""The RL runtime simulator against closed forms and the runtime's invariants.

Deterministic costs give exact periods (sync: L + T per slot; bound 1
with one actor: max(L, T); many actors: L / n when generation bounds,
T when the learner does); random (lognormal) costs are checked for the
rules every run must keep: a monotone clock, staleness within its bound,
every slot trained once, versions as the runtime would hand them out.
"""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from bench.rl import pod_simulation as sim
from geom import gas

K = 200


def _cal(latency=(3.0,), step=1.0, overhead=0.0, sigma=0.0, step_sigma=0.0,
         difficulties=None, rows=8):
  return sim.Calibration(
      difficulties=difficulties or tuple(range(1, len(latency) + 1)),
      latency_mean=latency, latency_sigma=(sigma,) * len(latency),
      step_seconds=step, step_sigma=step_sigma, overhead_seconds=overhead,
      rows_per_slot=rows)


def _period(result, tail=0.5):
  """Mean seconds between versions over the last `tail` of the run."""
  publish = result.trace.publish
  first = int(len(publish) * (1 - tail)) - 1
  return (publish[-1] - publish[first]) / (len(publish) - 1 - first)


@pytest.mark.parametrize('actors', [1, 3])
@pytest.mark.parametrize('overhead', [0.0, 0.5])
def test_sync_makespan_is_slots_times_latency_plus_step(actors, overhead):
  # s = 0: slot k starts at version k, so nothing overlaps.
  r = sim.simulate(_cal(overhead=overhead), sim.Policy('sync'), actors, K)
  assert r.makespan == pytest.approx(K * (3.0 + overhead + 1.0), rel=1e-12)
  assert r.samples_per_second == pytest.approx(8 / (4.0 + overhead))
  assert r.learner_busy_fraction == pytest.approx(1 / (4.0 + overhead))
  assert r.learner_stall_seconds == pytest.approx(K * 3.0)
  np.testing.assert_array_equal(r.trace.staleness, 0)


@pytest.mark.parametrize('latency,step', [(3.0, 1.0), (1.0, 3.0), (2.0, 2.0)])
def test_bound_one_with_one_actor_has_period_max_of_latency_and_step(
    latency, step):
  r = sim.simulate(_cal((latency,), step), sim.Policy('s1', bound=1), 1, K)
  assert _period(r) == pytest.approx(max(latency, step), rel=1e-9)
  assert set(r.trace.staleness[1:]) == {1}


def test_sync_is_slower_than_bound_one():
  # What a model that ignores the version gate would get wrong.
  sync = sim.simulate(_cal(), sim.Policy('sync'), 1, K)
  async_ = sim.simulate(_cal(), sim.Policy('s1', bound=1), 1, K)
  assert _period(sync) == pytest.approx(4.0)
  assert _period(async_) == pytest.approx(3.0)


@pytest.mark.parametrize('latency,expected', [(10.0, 2.5), (2.0, 1.0)])
def test_many_actors_generation_or_learner_bound(latency, expected):
  # 4 actors, T = 1: L > n T gives L / n; a small L gives T.
  r = sim.simulate(_cal((latency,)), sim.Policy('s16', bound=16), 4, 400)
  assert _period(r) == pytest.approx(expected, rel=1e-9)
  busy = r.learner_busy_fraction
  assert (busy < 0.5) if latency == 10.0 else busy == pytest.approx(1, 0.05)


def test_split_sync_divides_the_latency_among_the_actors():
  r = sim.simulate(_cal((3.0,)), sim.Policy('split', split=True), 3, K)
  assert r.makespan == pytest.approx(K * (1.0 + 1.0))


def test_shared_compute_adds_the_work_up():
  # One processor, never idle: the makespan is the total work K (L + T),
  # so asynchrony gains nothing (what the 2-core runs measured).
  cal = _cal((3.0,))
  shared = sim.simulate(cal, sim.Policy('s8', bound=8), 2, K,
                        shared_compute=True)
  assert shared.makespan == pytest.approx(K * 4.0, rel=1e-9)
  assert sim.simulate(cal, sim.Policy('s8', bound=8), 2, K).makespan < (
      0.4 * shared.makespan)  # L / 2 per slot.
  dedicated_sync = sim.simulate(cal, sim.Policy('sync'), 2, K)
  shared_sync = sim.simulate(cal, sim.Policy('sync'), 2, K,
                             shared_compute=True)
  assert shared_sync.makespan == pytest.approx(dedicated_sync.makespan)


def _check_invariants(r, cal, capacity):
  t, k = r.trace, r.num_slots
  assert np.all(np.diff(t.publish) > 0)
  assert np.all(np.diff(t.claim) >= 0)
  for a, b in (('claim', 'start'), ('start', 'finish'), ('finish', 'put'),
               ('put', 'train_start'), ('train_start', 'publish')):
    assert np.all(getattr(t, a) <= getattr(t, b)), (a, b)
  assert np.all(t.train_start[1:] >= t.publish[:-1])
  assert r.makespan == t.publish[-1]
  # Slot k starts from the newest version then published.
  published = np.concatenate([[0.0], t.publish])  # Version v's time.
  assert np.all(published[t.version] <= t.start)
  newer = t.version < k
  assert np.all(published[t.version + 1][newer] > t.start[newer])
  stale = t.staleness
  assert np.all((0 <= stale) & (stale <= t.budget))
  assert r.staleness_histogram.sum() == k
  assert r.trained_mix.sum() == k
  # The learner is either training or stalled.
  trained = (t.publish - t.train_start).sum()
  assert r.learner_stall_seconds + trained == pytest.approx(r.makespan)
  assert r.learner_busy_seconds <= trained + 1e-9
  # The buffer: at each put, at most capacity slots wait besides one.
  for when in t.put:
    held = np.sum((t.put <= when) & (t.train_start > when))
    assert held <= capacity + 1
  assert 0 <= r.actor_idle_fraction <= 1 and 0 <= r.actor_blocked_fraction


@pytest.mark.parametrize('bound,actors,seed', [
    (0, 1, 0), (0, 3, 1), (1, 1, 2), (1, 4, 3), (3, 2, 4), (8, 5, 5)])
def test_random_latencies_keep_the_invariants(bound, actors, seed):
  cal = _cal((0.5, 1.0, 2.0), step=0.4, overhead=0.1, sigma=0.6,
             step_sigma=0.3)
  r = sim.simulate(cal, sim.Policy('s', bound=bound), actors, 150, seed)
  _check_invariants(r, cal, bound + actors)
  np.testing.assert_array_equal(r.trace.budget, bound)
  np.testing.assert_array_equal(r.drawn, r.trained_mix)
  again = sim.simulate(cal, sim.Policy('s', bound=bound), actors, 150, seed)
  assert again.makespan == r.makespan  # A function of the seed.


def test_deterministic_mode_uses_exactly_version_k_minus_s():
  cal = _cal((0.5, 2.0), step=0.4, sigma=0.6)
  r = sim.simulate(cal, sim.Policy('d', bound=3, deterministic=True), 3,
                   100, 7)
  np.testing.assert_array_equal(
      r.trace.version, np.maximum(0, np.arange(100) - 3))


def _gas_options(**kw):
  kw = {'difficulties': (0.0, 1.0), 's_base': 4, 'estimate_alpha': False,
        'bandit': 'uniform', 'coupling': 0.0, 'max_defer': 4, **kw}
  return gas.GasOptions(**kw)


@pytest.mark.parametrize('actors,seed', [(1, 0), (3, 1), (6, 2)])
def test_gas_staleness_within_the_budget_at_dispatch(actors, seed):
  options = gas.GasOptions(difficulties=(1, 2, 3, 4, 5), s_base=4,
                           alpha=0.5, estimate_alpha=False, bandit='uniform')
  cal = _cal((0.2, 0.5, 1.0, 1.5, 2.5), step=0.3, overhead=0.05, sigma=0.5,
             step_sigma=0.2)
  r = sim.simulate(cal, sim.Policy('gas', gas_options=options), actors, 150,
                   seed)
  budgets = gas.budgets(r.gas_state, options)
  np.testing.assert_array_equal(r.trace.budget, budgets[r.trace.bucket])
  _check_invariants(r, cal, int(budgets.max()) + actors)
  # GAS's own counters agree: every dispatch trained, once.
  np.testing.assert_array_equal(r.gas_state.counts[0], r.trained_mix)


def test_gas_defers_a_hard_bucket_that_cannot_arrive_but_trains_it():
  # Budgets (4, 1): alpha 2.2 gives floor(4 exp(-1.1)) = 1 for d = 1. The
  # hard bucket lags ceil(4 / 1) = 4 versions > 1: it never fits.
  cal = _cal((0.5, 4.0), step=1.0, difficulties=(0.0, 1.0), rows=1)
  options = _gas_options(alpha=2.2)
  assert gas.budgets(gas.init(options), options).tolist() == [4, 1]
  aware = sim.simulate(cal, sim.Policy('gas', gas_options=options), 2, 400)
  blind_options = dataclasses.replace(options, execution_aware=False)
  blind = sim.simulate(cal, sim.Policy('gas', gas_options=blind_options), 2,
                       400)
  hard = 1
  assert aware.gas_state.counts[1, hard] > 50  # Deferred, often.
  # Deferred, not dropped: each draw trains, at most max_defer + 1
  # dispatches later, unless it is still pending at the end.
  still = aware.pending.count(hard)
  assert aware.trained_mix[hard] == aware.drawn[hard] - still
  assert still <= options.max_defer + 1
  assert 0 < aware.deferral_mean and aware.deferral_max <= 5
  assert blind.deferral_max == 0
  assert aware.learner_stall_seconds < blind.learner_stall_seconds
  # The substitutes go on credit: the hard bucket keeps its share p = 1/2
  # (without the credit it fell to p / (1 + p) = 1/3).
  assert aware.trained_mix[hard] / 400 == pytest.approx(1 / 2, abs=0.05)
  assert blind.trained_mix[hard] / 400 == pytest.approx(1 / 2, abs=0.07)


def test_gas_moves_a_hard_batch_to_a_slot_with_enough_lead():
  # Budgets (4, 2); the hard bucket lags 2 versions: it fits its budget
  # but not a slot claimed 1 version before it is needed. Deferring it
  # there cuts the stall per hard batch, not only their number.
  cal = _cal((0.5, 1.8), step=1.0, difficulties=(0.0, 1.0), rows=1)
  options = _gas_options(alpha=1.2)
  aware = sim.simulate(cal, sim.Policy('gas', gas_options=options), 1, 400)
  blind_options = dataclasses.replace(options, execution_aware=False)
  blind = sim.simulate(cal, sim.Policy('gas', gas_options=blind_options), 1,
                       400)
  per_hard = [r.learner_stall_seconds / r.trained_mix[1]
              for r in (aware, blind)]
  # (Measured 0.39 against 0.46 s per hard batch; 0.26 before substitutes
  # went on credit, when the hard share fell.)
  assert per_hard[0] < 0.9 * per_hard[1]
  assert aware.samples_per_second > 1.02 * blind.samples_per_second
  assert abs(aware.trained_mix[1] - blind.trained_mix[1]) < 20


def _write_sync_run(workdir, eval_seconds=0.5):
  """A synchronous run whose costs are known: see test_calibrate."""
  os.makedirs(os.path.join(workdir, 'checkpoints', '6', 'meta'))
  buckets = [1, 2, 1, 2, 1, 2]
  gen = [1.0, 1.0, 0.1, 0.2, 0.3, 0.2]  # Steps 1, 2: compilation.
  step = [2.0, 0.05, 0.05, 0.05, 0.05, 0.05]
  elapsed = busy = 0.0
  lines = []
  for i in range(6):
    extra = eval_seconds if i == 3 else 0.0  # After step 3's evaluation.
    elapsed += extra + gen[i] + 0.01 + step[i]
    busy += step[i]
    record = {'step': i + 1, 'difficulty': float(buckets[i]),
              'generation_seconds': gen[i], 'staleness': 0.0,
              'samples_per_second': 64 * (i + 1) / elapsed,
              'learner_busy_fraction': busy / elapsed}
    if i == 2:
      record['eval/pass_at_1'] = 0.5
    lines.append(json.dumps(record))
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  wall = elapsed + 0.3
  results = {'versions': 6, 'samples': 384, 'wall_seconds': wall,
             'learner_busy_fraction': busy / wall,
             'samples_per_second': 384 / wall,
             'staleness_histogram': {'0': 6},
             'difficulty_mix': {'1': 3, '2': 3}}
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f)
  meta = {'config': json.dumps({'runtime': {
      'max_staleness': 0, 'num_actors': 1, 'deterministic': False,
      'buffer_capacity': None}})}
  with open(os.path.join(workdir, 'checkpoints', '6', 'meta', 'metadata'),
            'w') as f:
    json.dump(meta, f)
  return wall


def test_calibrate_recovers_the_costs_of_a_known_run(tmp_path):
  wall = _write_sync_run(str(tmp_path / 'run'))
  cal = sim.calibrate([str(tmp_path / 'run')])
  assert cal.difficulties == (1.0, 2.0)
  np.testing.assert_allclose(cal.latency_mean, [0.2, 0.2])
  np.testing.assert_allclose(cal.latency_sigma, [math.log(3) / 2, 0],
                             atol=1e-12)
  assert cal.step_seconds == pytest.approx(0.05)  # Compilation left out.
  assert cal.step_sigma == pytest.approx(0, abs=1e-6)
  assert cal.overhead_seconds == pytest.approx(0.01)
  assert cal.fixed_seconds == pytest.approx(wall - 6 * (0.2 + 0.05 + 0.01))
  assert cal.rows_per_slot == 64
  path = str(tmp_path / 'cal.json')
  cal.to_json(path)
  assert sim.Calibration.from_json(path) == cal


def test_calibrate_refuses_an_asynchronous_run(tmp_path):
  _write_sync_run(str(tmp_path / 'run'))
  path = tmp_path / 'run' / 'results.json'
  results = json.loads(path.read_text())
  results['staleness_histogram'] = {'0': 1, '1': 5}
  path.write_text(json.dumps(results))
  with pytest.raises(ValueError, match='not synchronous'):
    sim.calibrate([str(tmp_path / 'run')])


def test_weak_scaling():
  cal = _cal((0.01, 0.02), step=0.02)
  cal = dataclasses.replace(cal, rows_per_slot=64)
  dep = sim.Deployment.split(64)
  assert (dep.rollout_chips, dep.learner_chips, dep.num_actors) == (32, 32, 8)
  at = sim.scale(cal, dep, t_comm=0.001)
  assert at.rows_per_slot == 512  # 16 rows per learner chip.
  np.testing.assert_allclose(at.latency_mean, [0.08, 0.16])  # 128 rows/chip.
  assert at.step_seconds == pytest.approx(0.02 + 0.001 * 3)
  with pytest.raises(ValueError):
    sim.Deployment.split(4)  # 2 rollout chips: no actor group of 4.


def test_predict_writes_one_row_per_policy_and_scale():
  cal = _cal((0.01, 0.02), step=0.02, sigma=0.2)
  cal = dataclasses.replace(cal, rows_per_slot=64)
  table = sim.predict(cal, [8, 32], sim.gas_options(cal), bounds=(1, 2),
                      num_slots=60)
  rows = [line for line in table.splitlines()[2:]]
  assert len(rows) == 2 * 5  # sync, split, best fixed, s=s_base, GAS.
  assert all(line.count('|') == table.splitlines()[0].count('|')
             for line in rows)
  assert '| sync | ' in rows[0] and '| 1.00x |' in rows[0]


def test_check_compares_a_real_run(tmp_path):
  _write_sync_run(str(tmp_path / 'run'))
  cal = sim.calibrate([str(tmp_path / 'run')])
  table = sim.check(cal, [str(tmp_path / 'run')], bound=5, num_actors=7)
  row = table.splitlines()[2]
  assert row.startswith('| run | 0 | 1 |')  # From the checkpoint's meta.
  assert '| 1.000 | 1.000 | 0.000 |' in row


# Across processes: weight and batch transfers (launch.rl --multihost).


@pytest.mark.parametrize('weights,batch', [(0.5, 0.0), (2.0, 0.25)])
def test_sync_across_processes_adds_both_transfers_to_every_slot(
    weights, batch):
  # s = 0: every slot needs the version just published, which the actor's
  # process does not hold, and nothing overlaps.
  r = sim.simulate(_cal(overhead=0.5), sim.Policy('sync'), 1, K,
                   weights_seconds=weights, batch_seconds=batch)
  assert r.makespan == pytest.approx(
      K * (weights + 3.0 + batch + 0.5 + 1.0), rel=1e-12)


def test_a_version_the_process_holds_is_not_transferred_again():
  # Deterministic s = 3: slots 0-3 all come from version 0.
  r = sim.simulate(_cal((1.0,), step=0.5), sim.Policy(
      'd3', bound=3, deterministic=True), 1, 12, weights_seconds=5.0)
  np.testing.assert_array_equal(r.trace.version[:4], 0)
  np.testing.assert_allclose(r.trace.finish[:4], 5.0 + np.arange(1, 5))
  # Slot 4 needs version 1: one transfer more.
  assert r.trace.finish[4] - r.trace.start[4] == pytest.approx(6.0)


@pytest.mark.parametrize('weights,expected', [(0.0, 1.0), (2.0, 1.0),
                                              (6.0, 2.0)])
def test_actors_keep_the_learner_fed_up_to_the_transfer_budget(
    weights, expected):
  # 4 actor groups, L = 2, T = 1, a loose bound: a slot per
  # max(T, (x + L) / n); the budget n T - L is 2 s.
  cal = _cal((2.0,))
  r = sim.simulate(cal, sim.Policy('s16', bound=16), 4, 400,
                   weights_seconds=weights)
  assert _period(r) == pytest.approx(expected, rel=1e-9)
  assert sim._feed_limit(cal, 4, np.ones(1)) == pytest.approx(2.0)


def test_gas_sees_generation_alone_not_the_transfer():
  cal = _cal((1.0, 3.0), step=0.5)
  r = sim.simulate(cal, sim.Policy('gas', gas_options=sim.gas_options(cal)),
                   3, 200, weights_seconds=4.0, batch_seconds=0.5)
  np.testing.assert_allclose(r.gas_state.latency, [1.0, 3.0])
  assert r.gas_state.step_time == pytest.approx(0.5)


def test_transfer_fit_recovers_a_line_and_refuses_one_size():
  rng = np.random.default_rng(0)
  mb = np.repeat([1.0, 16.0, 64.0], 5)
  seconds = 0.012 + mb / 900 + rng.normal(0, 1e-4, mb.shape)
  t = sim.Transfer.fit(mb, seconds, 'test')
  assert t.latency_seconds == pytest.approx(0.012, abs=3e-4)
  assert 1 / t.seconds_per_mb == pytest.approx(900, rel=0.01)
  assert t.seconds(100) == pytest.approx(0.012 + 100 / 900, rel=0.01)
  with pytest.raises(ValueError, match='>= 2 sizes'):
    sim.Transfer.fit([4.0, 4.0], [0.1, 0.2])
  with pytest.raises(ValueError, match='>= 0'):
    sim.Transfer(-1.0, 0.0)
  with pytest.raises(ValueError, match='>= 0'):
    sim.simulate(_cal(), sim.Policy('sync'), 1, 5, weights_seconds=-1.0)


def test_transfer_json_round_trips(tmp_path):
  t = sim.Transfer(0.013, 0.0011, 'bench.rl_transfer')
  t.to_json(str(tmp_path / 't.json'))
  assert sim.Transfer.from_json(str(tmp_path / 't.json')) == t


def test_across_processes_prices_the_transfers_against_one_process():
  cal = dataclasses.replace(_cal((0.01, 0.02), step=0.02, sigma=0.2),
                            rows_per_slot=64)
  opts = sim.gas_options(cal)

  def rows(transfer):
    table = sim.across_processes(cal, [8, 32], opts, transfer, 0.5, 0.05,
                                 bounds=(1, 2), num_slots=60)
    return [line.split(' | ') for line in table.splitlines()[2:]]

  free = rows(sim.Transfer())
  assert len(free) == 2 * 3  # sync split, best fixed, GAS per scale.
  assert all(r[-2] == '1.00x' for r in free)  # Same seeds, no cost.
  costly = rows(sim.Transfer(0.05, 0.01))
  assert all(float(r[-2].rstrip('x')) < 1 for r in costly)
  assert all(r[4] == '55.0' for r in costly)  # 50 ms + 0.5 MB x 10 ms.
