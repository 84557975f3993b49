"""The start of a multi-process job (train.jobs.multihost): flags checked before
the processes meet, a deadline on meeting, signals that end the wait, a
coordinator port that is taken.

The checks and the wait run in-process; the launcher runs only where its
one line and exit status are the point (a few processes at once, each a
jax import).
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags
from absl.testing import flagsaver
import pytest

from train.jobs import multihost
from tests import launch_runs
from train.run import preemption
from train.errors import Interrupted, RunError, UsageError


@pytest.fixture(autouse=True)
def _parsed_flags():
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _check(**values):
  with flagsaver.flagsaver(**values):
    multihost.check_flags()


@pytest.mark.parametrize('values', [
    dict(num_processes=1, process_id=0),
    dict(num_processes=multihost.MAX_PROCESSES,
         process_id=multihost.MAX_PROCESSES - 1),
    dict(num_processes=3, process_id=2,
         coordinator_address='127.0.0.1:65535'),
    dict(coordinator_address='[::1]:1', transfer_address='host:8477'),
    dict(heartbeat_timeout_seconds=1, multihost_start_timeout=86400),
])
def test_flags_at_their_limits_pass(values):
  _check(**values)


@pytest.mark.parametrize('values,line', [
    (dict(num_processes=0), '--num_processes=0: must be in [1, 65536]'),
    (dict(num_processes=multihost.MAX_PROCESSES + 1),
     '--num_processes=65537: must be in [1, 65536]'),
    (dict(num_processes=3, process_id=3),
     '--process_id=3: must be in [0, 2] (--num_processes=3'),
    (dict(num_processes=3, process_id=-1),
     '--process_id=-1: must be in [0, 2]'),
    (dict(process_id=-1), '--process_id=-1: must be in [0]'),
    (dict(coordinator_address='127.0.0.1'),
     "--coordinator_address='127.0.0.1': must be host:port"),
    (dict(coordinator_address='127.0.0.1:65536'),
     "--coordinator_address='127.0.0.1:65536': must be host:port with a "
     'port in [1, 65535]'),
    (dict(transfer_address=':8477'), "--transfer_address=':8477': must be"),
    (dict(heartbeat_timeout_seconds=0),
     '--heartbeat_timeout_seconds=0: must be in [1, 86400] seconds'),
    (dict(multihost_start_timeout=86401.0),
     '--multihost_start_timeout=86401.0: must be in [1, 86400] seconds'),
])
def test_a_wrong_flag_is_refused_in_one_line(values, line):
  with pytest.raises(UsageError) as e:
    _check(**values)
  assert str(e.value).startswith(line), str(e.value)


def test_rollout_processes_are_checked_against_num_processes_before_jax():
  # pylint: disable=g-import-not-at-top
  from configs import rl
  from train.errors import ConfigError
  from train.rl import run
  # pylint: enable=g-import-not-at-top
  config = rl.get_config('runlocal')
  config.rollout_processes = 2
  run.check_config(config, require_sft=False, processes=3)  # At the limit.
  config.rollout_processes = 3
  with pytest.raises(ConfigError, match=r'^config.rollout_processes=3: must '
                     r'be in \[1, 2\] with 3 processes'):
    run.check_config(config, require_sft=False, processes=3)
  config.rollout_processes = None
  with pytest.raises(ConfigError, match='required with 3 processes'):
    run.check_config(config, require_sft=False, processes=3)


def _waited(timeout):
  return f'waited {timeout:g} s'


def test_a_start_that_does_not_return_stops_at_its_deadline():
  never = threading.Event()
  begin = time.monotonic()
  with pytest.raises(multihost.StartTimeout, match='^waited 0.3 s$'):
    multihost.wait_for_start(never.wait, 0.3, _waited)
  assert 0.3 <= time.monotonic() - begin < 2
  multihost.wait_for_start(lambda: None, 0.3, _waited)


def test_signals_end_a_start_blocked_outside_python():
  # jax.distributed's start blocks in C++; here a thread's wait stands in.
  never = threading.Event()
  timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
  begin = time.monotonic()
  with preemption.raise_on_signals():
    timer.start()
    with pytest.raises(Interrupted) as e:
      multihost.wait_for_start(never.wait, 60, _waited)
  assert e.value.signum == signal.SIGTERM
  assert time.monotonic() - begin < 5
  preemption._PENDING.clear()  # pylint: disable=protected-access


def test_a_start_past_its_deadline_names_what_it_waited_for():
  port = _free_port()  # Nothing listens there.
  hint = ('; start every process of the job (with the same --num_processes)'
          ', or raise --multihost_start_timeout')
  with flagsaver.flagsaver(num_processes=2, process_id=1,
                           coordinator_address=f'127.0.0.1:{port}'):
    assert multihost._waited_for(60) == (  # pylint: disable=protected-access
        f'process 1 of 2: the coordinator 127.0.0.1:{port} (process 0) did '
        f'not answer within 60 s{hint}')
  with flagsaver.flagsaver(num_processes=4, process_id=2,
                           coordinator_address=f'127.0.0.1:{port}'):
    with socket.socket() as listener:
      listener.bind(('127.0.0.1', port))
      listener.listen()
      assert multihost._waited_for(7.5) == (  # pylint: disable=protected-access
          f'process 2 of 4: peers 0, 1, 3 did not all join within 7.5 s '
          f'(coordinator 127.0.0.1:{port}){hint}')


class _JaxRuntimeError(RuntimeError):
  pass


@pytest.mark.parametrize('error,kind,line', [
    (_JaxRuntimeError('UNKNOWN: Failed to start RPC server'), UsageError,
     "--coordinator_address='127.0.0.1:9': process 0 cannot serve there"),
    (ValueError('coordinator_address should be defined.'), UsageError,
     '--multihost=True: jax.distributed cannot start: coordinator_address '
     'should be defined.; pass --coordinator_address'),
    (_JaxRuntimeError('INTERNAL: boom\nmore'), RunError,
     'jax.distributed did not start: _JaxRuntimeError: INTERNAL: boom'),
])
def test_a_start_that_raises_is_one_line(error, kind, line):
  def start():
    raise error
  with flagsaver.flagsaver(coordinator_address='127.0.0.1:9'):
    with pytest.raises(kind) as e:
      multihost.wait_for_start(start, 5, _waited)
  assert str(e.value) == line or str(e.value).startswith(line), str(e.value)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _rl(workdir, port, process, processes, *extra):
  return subprocess.Popen(
      [sys.executable, '-m', 'launch.rl', '--config=configs/rl.py:runlocal',
       f'--config.sft_workdir={workdir}-sft', f'--workdir={workdir}',
       f'--config.rollout_processes={processes - 1}', '--multihost',
       f'--coordinator_address=127.0.0.1:{port}',
       f'--num_processes={processes}', f'--process_id={process}', *extra],
      cwd=launch_runs.REPO_ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def _one_line(code, err):
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1, err[-3000:]
  return lines[0]


def test_a_taken_coordinator_port_is_refused_before_jax_starts():
  with socket.socket() as busy:
    busy.bind(('127.0.0.1', 0))
    busy.listen()
    port = busy.getsockname()[1]
    with pytest.raises(UsageError) as e:
      multihost._check_port_free(f'127.0.0.1:{port}')  # pylint: disable=protected-access
  assert str(e.value) == (
      f"--coordinator_address='127.0.0.1:{port}': port {port} is in use on "
      'this host (process 0 serves the job there); pick a free port for '
      'every process of the job')
  multihost._check_port_free(f'127.0.0.1:{port}')  # pylint: disable=protected-access


def test_a_job_that_cannot_start_ends_in_one_line_on_every_process(tmp_path):
  """Two launchers at once (one jax import each): a lone process 0 of 3
  past a 2 s deadline; a process 1 whose coordinator port is held by
  another program, waiting there until SIGTERM ends it."""
  os.makedirs(tmp_path / 'w-sft' / 'checkpoints' / '1')
  workdir = str(tmp_path / 'w')
  with socket.socket() as busy:
    busy.bind(('127.0.0.1', 0))
    busy.listen()
    busy.settimeout(120)
    busy_port, lone_port = busy.getsockname()[1], _free_port()
    begin = time.monotonic()
    procs = [_rl(workdir, lone_port, 0, 3, '--multihost_start_timeout=2'),
             _rl(workdir, busy_port, 1, 2)]
    # Process 1 knocks at the coordinator's port once it waits to join.
    busy.accept()[0].close()
    procs[1].send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    procs[1].wait(timeout=30)
    stopped_after = time.monotonic() - signalled
    ends = launch_runs.communicate_all(procs, timeout=120)
  elapsed = time.monotonic() - begin
  lone, peer = [_one_line(c, e) for c, _, e in ends]
  assert [c for c, _, _ in ends] == [1, 128 + signal.SIGTERM], ends
  assert lone == (
      f'error: process 0 of 3: peers 1, 2 did not all join within 2 s '
      f'(coordinator 127.0.0.1:{lone_port}); start every process of the job '
      '(with the same --num_processes), or raise --multihost_start_timeout')
  assert stopped_after < 5, stopped_after
  assert peer.startswith('stopped by SIGTERM'), peer
  assert elapsed < 90, elapsed
  assert not os.path.exists(workdir)


def test_a_wrong_process_id_is_one_line_before_jax_starts(tmp_path):
  workdir = tmp_path / 'w'
  result = launch_runs.run_module(
      'launch.rl', '--config=configs/rl.py:runlocal',
      f'--config.sft_workdir={tmp_path}', f'--workdir={workdir}',
      '--multihost', '--coordinator_address=127.0.0.1:9',
      '--num_processes=3', '--process_id=5', timeout=60)
  assert result.returncode == 2, result.stderr[-3000:]
  assert launch_runs.error_lines(result) == [
      'error: --process_id=5: must be in [0, 2] (--num_processes=3: '
      'processes are numbered from 0)']
  assert not workdir.exists()


def test_a_training_config_mistake_is_one_line_before_the_processes_meet(
    tmp_path):
  # Process 1 of 2, alone: before the check it waited out the start
  # deadline for a coordinator that never comes, then ended with exit 1.
  workdir = tmp_path / 'w'
  begin = time.monotonic()
  result = launch_runs.run(
      str(workdir), '--config.num_steps=0', '--multihost',
      '--coordinator_address=127.0.0.1:9', '--num_processes=2',
      '--process_id=1', '--multihost_start_timeout=20', timeout=60)
  assert result.returncode == 2, result.stderr[-3000:]
  assert launch_runs.error_lines(result) == [
      'error: config.num_steps=0: must be a positive integer']
  assert time.monotonic() - begin < 15
  assert not workdir.exists()
