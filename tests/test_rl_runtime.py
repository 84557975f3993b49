"""The asynchronous runtime: staleness bounds under random delays, the
synchronous and deterministic modes, actor failures and shutdown."""

import random
import threading
import time

import jax
import pytest

from train.errors import ConfigError
from train.rl import runtime


def _drive(settings, batches, seed=0, max_delay=0.004, fail=lambda k, n: False,
           learner_delay=None, plan=None, learner_min_delay=0.0):
  """Runs `batches` through the runtime with a fake policy (its params are
  its version) and random delays; returns (version used per batch, the
  largest buffer occupancy seen, actor failures)."""
  rng = random.Random(seed)
  lock = threading.Lock()
  snaps = runtime.Snapshots(keep=settings.max_staleness + 1)
  buffer = runtime.Buffer(settings.capacity)
  attempts = {}

  def generate(k, version, params):
    assert params == version
    with lock:
      attempts[k] = attempts.get(k, 0) + 1
      n = attempts[k]
      delay = rng.uniform(0, max_delay)
    time.sleep(delay)
    if fail(k, n):
      raise ValueError(f'injected failure on batch {k}')
    return k, version

  actors = runtime.Actors(generate, snaps, buffer, settings, plan=plan)
  snaps.publish(0, 0)
  actors.start()
  used = []
  deadline = time.monotonic() + 20

  def poll():
    actors.check()
    if time.monotonic() > deadline:
      raise TimeoutError('the learner waited 20 s for a batch: deadlock')

  try:
    for k in range(batches):
      got_k, version = buffer.take(k, poll)
      assert got_k == k
      used.append(version)
      time.sleep(rng.uniform(learner_min_delay, learner_delay or max_delay))
      snaps.publish(k + 1, k + 1)  # The update that trains batch k.
  finally:
    actors.stop()
    actors.join(5.0)
  return used, buffer.peak, actors.failures


@pytest.mark.parametrize('staleness', [0, 1, 2, 4])
@pytest.mark.parametrize('actors', [1, 3])
@pytest.mark.parametrize('seed', range(3))
def test_every_trained_batch_is_within_the_bound(staleness, actors, seed):
  settings = runtime.RuntimeSettings(max_staleness=staleness,
                                     num_actors=actors)
  used, fullest, _ = _drive(settings, 30, seed=seed)
  lags = [k - v for k, v in enumerate(used)]
  assert all(0 <= lag <= staleness for lag in lags), lags
  assert fullest <= settings.capacity + 1  # + the batch being waited for.
  if staleness == 0:
    assert used == list(range(30))  # Synchronous: batch k on version k.


def test_the_buffer_holds_no_more_than_its_capacity():
  settings = runtime.RuntimeSettings(max_staleness=6, num_actors=3,
                                     buffer_capacity=2)
  # The learner sleeps at least 20 ms a batch, so that the actors (0.5 ms
  # a batch) fill the buffer however loaded the machine is.
  used, fullest, _ = _drive(settings, 30, max_delay=0.0005,
                            learner_delay=0.03, learner_min_delay=0.02)
  assert fullest == 3  # Reached: capacity, plus the batch awaited.
  assert all(0 <= k - v <= 6 for k, v in enumerate(used))


def test_a_slow_learner_lets_actors_run_ahead_to_the_bound():
  settings = runtime.RuntimeSettings(max_staleness=3, num_actors=2)
  used, _, _ = _drive(settings, 20, max_delay=0.0005, learner_delay=0.02)
  lags = [k - v for k, v in enumerate(used)]
  assert max(lags) == 3 and all(0 <= lag <= 3 for lag in lags), lags


@pytest.mark.parametrize('staleness,actors', [(0, 3), (2, 3), (4, 1)])
def test_deterministic_mode_uses_exactly_version_k_minus_s(staleness, actors):
  settings = runtime.RuntimeSettings(max_staleness=staleness,
                                     num_actors=actors, deterministic=True)
  for seed in range(3):
    used, _, _ = _drive(settings, 25, seed=seed)
    assert used == [max(0, k - staleness) for k in range(25)]


@pytest.mark.parametrize('deterministic', [False, True])
def test_a_planned_batch_waits_for_its_own_oldest_version(deterministic):
  # Per-batch budgets (as a scheduler plans them), within the global 4.
  budgets = [random.Random(k).choice([0, 1, 2, 4]) for k in range(100)]
  calls = []

  def plan(k, latest):
    calls.append(k)
    assert 0 <= latest <= k
    return max(0, k - budgets[k])

  settings = runtime.RuntimeSettings(max_staleness=4, num_actors=3,
                                     deterministic=deterministic)
  for seed in range(3):
    calls.clear()
    used, _, _ = _drive(settings, 40, seed=seed, plan=plan,
                        learner_delay=0.006)
    lags = [k - v for k, v in enumerate(used)]
    assert all(0 <= lag <= budgets[k] for k, lag in enumerate(lags)), lags
    if deterministic:
      assert lags == [min(k, budgets[k]) for k in range(40)]
    assert set(range(40)) <= set(calls)  # Each claimed batch was planned.


def test_free_mode_takes_the_newest_version_instead():
  # One actor, s = 4: it claims batch k as soon as k - 1 is done, when the
  # learner already holds a newer version than k - 4.
  settings = runtime.RuntimeSettings(max_staleness=4, num_actors=1)
  used, _, _ = _drive(settings, 25)
  assert used != [max(0, k - 4) for k in range(25)]
  assert all(0 <= k - v <= 4 for k, v in enumerate(used))


def test_a_failed_actor_is_restarted_and_its_batch_redone():
  settings = runtime.RuntimeSettings(max_staleness=1, num_actors=2,
                                     max_actor_restarts=2)
  used, _, failures = _drive(
      settings, 12, fail=lambda k, n: k in (3, 7) and n == 1)
  assert failures == 2 and len(used) == 12
  assert all(0 <= k - v <= 1 for k, v in enumerate(used))


def test_failures_beyond_the_budget_stop_the_run_in_one_line():
  settings = runtime.RuntimeSettings(max_staleness=1, num_actors=2,
                                     max_actor_restarts=2)
  start = time.monotonic()
  with pytest.raises(runtime.ActorFailed,
                     match=r'failed 3 times.*ValueError: injected failure '
                           'on batch 5') as info:
    _drive(settings, 12, fail=lambda k, n: k == 5)
  assert '\n' not in str(info.value)
  assert time.monotonic() - start < 10


def test_stop_wakes_every_wait_and_join_is_bounded():
  settings = runtime.RuntimeSettings(max_staleness=2, num_actors=3)
  snaps = runtime.Snapshots(keep=3)
  buffer = runtime.Buffer(settings.capacity)
  actors = runtime.Actors(lambda k, v, p: (k, v), snaps, buffer, settings)
  actors.start()  # No version published: every actor waits for one.
  taken = []

  def learner():
    try:
      buffer.take(0, actors.check)
    except runtime.Stopped:
      taken.append('stopped')

  thread = threading.Thread(target=learner)
  thread.start()
  time.sleep(0.2)
  start = time.monotonic()
  actors.stop()
  actors.join(2.0)
  thread.join(2.0)
  assert not thread.is_alive() and taken == ['stopped']
  assert time.monotonic() - start < 1.0


def test_join_reports_an_actor_stuck_in_generation():
  settings = runtime.RuntimeSettings(num_actors=1)
  snaps = runtime.Snapshots(keep=1)
  buffer = runtime.Buffer(1)
  release = threading.Event()
  actors = runtime.Actors(lambda k, v, p: release.wait(5), snaps, buffer,
                          settings)
  snaps.publish(0, 0)
  actors.start()
  time.sleep(0.1)
  actors.stop()
  with pytest.raises(RuntimeError, match=r'did not stop within 0.2 s'):
    actors.join(0.2)
  release.set()
  actors.join(2.0)


def test_snapshots_are_monotone_and_keep_the_last_versions():
  snaps = runtime.Snapshots(keep=2)
  for v in range(4):
    snaps.publish(v, f'p{v}')
  assert snaps.held() == {2: 'p2', 3: 'p3'}
  with pytest.raises(ValueError, match='not newer'):
    snaps.publish(3, 'again')
  assert snaps.wait(1, exact=False) == (3, 'p3')
  assert snaps.wait(2, exact=True) == (2, 'p2')
  with pytest.raises(RuntimeError, match='no longer held'):
    snaps.wait(1, exact=True)


def test_split_devices_gives_disjoint_meshes():
  rollout, learner = runtime.split_devices(3)
  assert rollout.devices.size == 3 and learner.devices.size == 5
  assert not set(rollout.devices.flat) & set(learner.devices.flat)
  assert len(jax.devices()) == 8
  for bad in (0, 8, 2.5):
    with pytest.raises(ConfigError, match='rollout_devices'):
      runtime.split_devices(bad)


@pytest.mark.parametrize('field,value', [
    ('max_staleness', -1), ('num_actors', 0), ('max_actor_restarts', -2),
    ('buffer_capacity', 0)])
def test_bad_runtime_settings_name_the_field(field, value):
  with pytest.raises(ConfigError, match=f'runtime.{field}'):
    runtime.RuntimeSettings(**{field: value}).check()
