"""The multi-process RL transport on loopback: real jax.distributed jobs.

Each job is 2 or 3 `python -m tests.transport_peer` processes meeting
through jax.distributed on 127.0.0.1; arrays cross between them by
`jax.device_put` (the CPU client's transfer server).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests import launch_runs


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _job(num_processes: int, *args: str, timeout: float = 180,
         only: int | None = None):
  """[(exit status, stdout, stderr)] of each process; with `only`, of that
  process alone (the others are killed once it ends)."""
  port, transfer = _free_port(), _free_port()
  env = dict(os.environ)
  env['XLA_FLAGS'] = ' '.join(
      f for f in env.get('XLA_FLAGS', '').split()
      if not f.startswith('--xla_force_host_platform_device_count'))
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'tests.transport_peer', f'--process={i}',
       f'--num_processes={num_processes}', f'--port={port}',
       f'--transfer_port={transfer}', *args],
      cwd=launch_runs.REPO_ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(num_processes)]
  return launch_runs.communicate_all(
      procs, timeout, None if only is None else [procs[only]])


def _report(out: str) -> dict:
  return json.loads(out.strip().splitlines()[-1])


# 3 processes (two rollout processes into one learner) is slow (`make
# test-all`): the same transport, each rollout process on its own
# entries, as 2 processes run it here.
@pytest.mark.parametrize('num_processes', [
    2, pytest.param(3, marks=pytest.mark.slow)])
def test_weights_and_batches_arrive_whole_and_in_version_order(
    num_processes):
  versions, batches = 5, 3
  results = _job(num_processes, f'--versions={versions}',
                 f'--batches={batches}')
  for code, out, err in results:
    assert code == 0, err[-3000:]
  reports = [_report(out) for _, out, _ in results]
  learner = num_processes - 1
  for r in reports:
    assert r['bad'] == [], r  # Every array equals its entry's stamp.
    assert r['keys_left'] == [], r  # Walked and acknowledged: removed.
  for p in range(learner):
    # Each rollout process received every version, oldest first.
    assert reports[p]['received'] == [['weights', v, learner]
                                      for v in range(versions)]
    assert reports[p]['sent'] == 2 * batches
  # The learner received every batch of every rollout process's threads.
  assert sorted(reports[learner]['received']) == sorted(
      ['batch', 1000 * p + 10 * t + b, p] for p in range(learner)
      for t in range(2) for b in range(batches))
  assert reports[learner]['sent'] == versions * learner


def test_a_transfer_that_never_arrives_times_out_in_one_line():
  # The rollout's first batch (entry 1, after the learner's first version)
  # is held back by its sender; the learner gives up after 3 s.
  [(code, out, _)] = _job(2, '--versions=1', '--batches=1',
                          '--stall_entry=1', only=1)
  assert code == 1
  assert _report(out) == {'error': 'transfer 1 (batch) from process 0 to '
                          'process 1 did not complete within 3 s '
                          '(runtime.transfer_timeout)'}


def test_a_job_ends_while_a_transfer_waits_for_a_sender_that_stopped():
  """`multihost.exit_job`, how launch.rl ends each process of a job: a
  process whose transport still waits for an entry whose sender stopped
  ends at once, and so does the sender. With the interpreter's teardown
  instead (`--end=teardown`) both hung until killed: the backend's
  transfer server waits for the transfer (seen as a stopped 3-process RL
  job that never exited)."""
  results = _job(2, '--versions=2', '--batches=1', '--unpulled', timeout=60)
  assert [code for code, _, _ in results] == [0, 0], [
      err[-2000:] for _, _, err in results]
  # The transfer the learner's end cut, after process 0 stopped its
  # transport, is no failure of it, and nothing is printed of it.
  (_, out, err), _ = results
  assert _report(out) == {'failure': None}
  assert 'transport failed' not in err, err[-2000:]
