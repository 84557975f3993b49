"""The learner's weight server (train.rl.processes) on an in-memory store.

The loopback jobs (test_rl_multihost) run it for real; here its order of
answers is pinned down where a live job would only hang now and then.
"""

import inspect
import json
import signal
import threading
import time

import numpy as np
import pytest

from train import errors
from train.rl import control
from train.rl import processes
from train.rl import runtime


class _Store:
  """The key-value calls `control.Channel` makes, in a dict."""

  def __init__(self):
    self.data, self.lock = {}, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    del allow_overwrite
    with self.lock:
      self.data[key] = value

  def key_value_try_get(self, key):
    with self.lock:
      if key not in self.data:
        raise KeyError(key)
      return self.data[key]

  def key_value_delete(self, key):
    with self.lock:
      self.data.pop(key, None)


class _Snapshots:

  def __init__(self, versions):
    self.versions = dict(versions)

  def held(self):
    return dict(self.versions)


class _Transport:

  def __init__(self):
    self.sent = []

  def send(self, kind, meta, arrays, dst):
    self.sent.append((kind, meta['version'], dst, len(arrays)))


def _services(store, snapshots, transport):
  channel = control.Channel(store, 'job', timeout=5)
  return channel, processes.LearnerServices(
      roles_=processes.Roles(1, 2, 1), channel_=channel, transport=transport,
      liveness=None, snapshots=snapshots, plan=None, window=4,
      leaves=lambda params: [params], deliver=None, request_stop=None)


def _wait_for(channel, key, seconds=5.0):
  deadline = time.monotonic() + seconds
  while (value := channel.try_get(key)) is None:
    assert time.monotonic() < deadline, f'no {key}'
    time.sleep(0.01)
  return value


def test_a_published_version_is_not_held_back_by_an_earlier_request():
  # Deterministic s = 2, one rollout process with two actors: actor 1 asks
  # first, for version 1 (its batch 3), which needs the learner to train
  # batch 0; actor 0 then asks for version 0 to generate batch 0. Served in
  # order of asking, batch 0 never comes: the job hangs.
  store, snapshots, transport = _Store(), _Snapshots({0: np.zeros(3)}), (
      _Transport())
  channel, services = _services(store, snapshots, transport)
  channel.set('req/0/0', {'min': 1, 'exact': True, 'held': []})
  channel.set('req/0/1', {'min': 0, 'exact': True, 'held': []})
  serve = services._weights  # pylint: disable=protected-access
  thread = threading.Thread(target=serve, args=(0,), daemon=True)
  thread.start()
  try:
    assert _wait_for(channel, 'resp/0/1') == 0
    assert channel.try_get('resp/0/0') is None
    assert transport.sent == [('weights', 0, 0, 1)]
    snapshots.versions[1] = np.ones(3)  # The learner trained batch 0.
    assert _wait_for(channel, 'resp/0/0') == 1
    # A free request takes the newest; one that holds it gets no transfer.
    channel.set('req/0/2', {'min': 0, 'exact': False, 'held': [1]})
    assert _wait_for(channel, 'resp/0/2') == 1
    assert transport.sent == [('weights', 0, 0, 1), ('weights', 1, 0, 1)]
  finally:
    services._halt.set()  # pylint: disable=protected-access
    thread.join(5)
  assert not thread.is_alive()
  assert json.loads(store.data['job/resp/0/0']) == 1


class _FailedTransport:

  def check(self):
    raise processes.transport_lib.TransferFailed(
        'a transfer failed: JaxRuntimeError: recv() failed')


class _Liveness:
  """Declares process 1 dead at its `dies_at`-th check (never if None)."""

  dead_after = 0.2

  def __init__(self, dies_at):
    self.dies_at, self.checks = dies_at, 0

  def check(self):
    self.checks += 1
    if self.dies_at is not None and self.checks >= self.dies_at:
      raise control.ProcessDied(1, 'learner', 5.0)


def test_a_transfer_broken_by_a_dead_process_names_the_process():
  # kill -9 of a peer breaks its socket before its heartbeats go stale.
  with pytest.raises(control.ProcessDied, match=r'process 1 \(learner\)'):
    processes.check_peers(_FailedTransport(), _Liveness(dies_at=3))
  begin = time.monotonic()
  with pytest.raises(processes.transport_lib.TransferFailed):
    processes.check_peers(_FailedTransport(), _Liveness(dies_at=None))
  assert time.monotonic() - begin >= 0.2  # It waited for the watch first.


def _workdir_busy():
  from train.run.workdir_lock import WorkdirBusy  # pylint: disable=g-import-not-at-top
  return WorkdirBusy('/w', {'host': 'h', 'pid': '7', 'started': 't'})


@pytest.mark.parametrize('error,code,line', [
    (_workdir_busy(), 75, "--workdir='/w': in use by another run (host h"),
    (errors.ConfigError('num_versions', 0, 'must be > 0'), 2,
     'config.num_versions=0: must be > 0'),
    (errors.DiskFull('/w/checkpoints', None, 0, 3), 5, 'disk full writing'),
    (errors.Interrupted(signal.SIGTERM, 'SIGTERM'), 143, 'stopped by SIGTERM'),
    (ValueError('bad\nsecond line'), 1, 'ValueError: bad'),
])
def test_a_refusal_is_told_with_its_exit_status_and_line(error, code, line):
  told = control.told(error)
  assert told['code'] == code and told['line'].startswith(line), told
  assert '\n' not in told['line']


def test_the_learners_refusal_comes_before_its_echo():
  # The learner told its refusal and ended: the broken transfer and the
  # silent heartbeat that follow are not what the rollout process reports.
  def ended():
    raise control.PeerStopped(1, 'learner', 75, 'workdir busy')
  with pytest.raises(control.PeerStopped) as e:
    processes.check_peers(_FailedTransport(), _Liveness(dies_at=1), ended)
  assert e.value.exit_code == 75
  assert str(e.value) == 'process 1 (learner) stopped the job: workdir busy'


def test_the_learner_ends_with_a_rollout_process_refusal_code():
  store = _Store()
  channel, services = _services(store, _Snapshots({}), _Transport())
  services._transport = _OkTransport()  # pylint: disable=protected-access
  services._liveness = _Liveness(dies_at=None)  # pylint: disable=protected-access
  channel.set('failed/0', control.told(errors.DamagedDataFile(
      'the SFT policy', ['/s/1'], OSError('truncated'))))
  with pytest.raises(processes.RolloutFailed) as e:
    services.check()
  assert e.value.exit_code == 6
  assert str(e.value).startswith('rollout process 0 stopped: cannot read '
                                 'the SFT policy')


class _OkTransport:

  def check(self):
    pass


@pytest.mark.parametrize('implementation', [runtime.Actors,
                                            processes.LearnerServices])
def test_both_sources_of_batches_have_the_learners_one_interface(
    implementation):
  # The learner calls only runtime.Generation's methods, the same way
  # whether its batches come from threads or from rollout processes.
  for name, member in inspect.getmembers(runtime.Generation):
    if name.startswith('_'):
      continue
    mine = getattr(implementation, name, None)
    assert mine is not None, (implementation.__name__, name)
    if isinstance(member, property):
      assert isinstance(mine, property), (implementation.__name__, name)
    else:
      assert (list(inspect.signature(mine).parameters)
              == list(inspect.signature(member).parameters)), (
                  implementation.__name__, name)
