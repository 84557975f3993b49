"""tests/launch_zygote.py: a launcher served by the worker's zygote behaves as
one started the usual way (its output, its exit status, its signals, its
death), and a run the zygote cannot serve starts the usual way.

The signal and crash tests of test_workdir_faults, test_multihost and
test_rl_multihost run through the zygote as well; these check the zygote
itself, against the same runs with GEOM_NO_ZYGOTE=1.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import launch_runs
from train.run import workdir_lock

@pytest.fixture(autouse=True)
def _zygote_on():
  # Checked when a test runs: conftest's session fixture starts it.
  if 'GEOM_TEST_ZYGOTE' not in os.environ:
    pytest.skip('the zygote is off (GEOM_NO_ZYGOTE)')


def _log() -> str:
  with open(os.path.join(os.path.dirname(os.environ['GEOM_TEST_ZYGOTE']),
                         'log')) as f:
    return f.read()


def _served(pid_line_count: int) -> list[str]:
  """The zygote's 'served' lines after the first `pid_line_count`."""
  return [l for l in _log().splitlines()
          if l.startswith('zygote: served ')][pid_line_count:]


def _count() -> int:
  return len(_served(0))


def _wait_serving():
  deadline = time.monotonic() + 300
  while 'zygote: serving on' not in _log():
    assert time.monotonic() < deadline, _log()
    time.sleep(0.2)


# A one-line config error and a flag error (exit 2, on stderr), and
# --helpshort (absl exits 1 after it, on stdout).
ARGVS = {
    'config error': ['--config.model.name=vit'],
    'flag error': ['--no_such_flag=1'],
    'help': ['--helpshort'],
}


@pytest.mark.parametrize('case', sorted(ARGVS))
def test_a_served_run_exits_and_writes_as_its_own_process(case, tmp_path):
  _wait_serving()
  cmd = launch_runs.command(str(tmp_path / 'run'), *ARGVS[case])
  results = {}
  for zygote in (False, True):
    before = _count()
    results[zygote] = subprocess.run(
        cmd, cwd=launch_runs.REPO_ROOT, capture_output=True, text=True,
        timeout=120, env=None if zygote else launch_runs.without_zygote())
    assert len(_served(before)) == zygote, _log()[-2000:]
  own, served = results[False], results[True]
  assert (served.returncode, served.stdout, served.stderr) == (
      own.returncode, own.stdout, own.stderr)
  assert own.returncode == {'config error': 2, 'flag error': 2,
                            'help': 1}[case]
  assert (own.stdout if case == 'help' else own.stderr).strip()
  assert not os.path.exists(tmp_path / 'run')


@contextlib.contextmanager
def _long_run(workdir):
  """(the launcher process, the run's pid) of a run of 100,000 steps,
  once it holds its workdir; both killed at the end, whatever happened."""
  proc = launch_runs.start(workdir, '--config.num_steps=100000')
  child = None
  try:
    deadline = time.monotonic() + 300
    # The run takes the lock, then writes its pid into it: wait for both.
    while 'pid' not in (workdir_lock.holder(workdir) or {}):
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      assert time.monotonic() < deadline
      time.sleep(0.1)
    child = workdir_lock.holder(workdir)['pid']
    yield proc, child
  finally:
    for pid in {proc.pid, child} - {None}:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if proc.returncode is None:
      proc.communicate(timeout=60)


def test_kill_9_of_the_launcher_kills_the_run_it_stands_for(tmp_path):
  _wait_serving()
  workdir = str(tmp_path / 'run')
  with _long_run(workdir) as (proc, child):
    assert child != proc.pid  # The run is the zygote's child.
    proc.kill()
    # Its output ends when the run does: the run writes to the same pipes.
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while workdir_lock.holder(workdir) is not None:
      assert time.monotonic() < deadline, 'the run outlived its launcher'
      time.sleep(0.1)


def test_sigterm_reaches_the_run_and_its_status_comes_back(tmp_path):
  _wait_serving()
  workdir = str(tmp_path / 'run')
  with _long_run(workdir) as (proc, child):
    assert child != proc.pid
    deadline = time.monotonic() + 300
    while not os.path.isdir(os.path.join(workdir, 'checkpoints', '20')):
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
  # The trainer saves and exits 0 on SIGTERM (test_workdir_faults).
  assert proc.returncode == 0, err[-3000:]
  assert err.strip().splitlines()[-1].startswith('stopped by SIGTERM at step')


def test_a_run_the_zygote_cannot_serve_starts_the_usual_way(tmp_path):
  _wait_serving()
  before = _count()
  result = subprocess.run(
      launch_runs.command(str(tmp_path / 'run'), '--config.model.name=vit'),
      cwd=launch_runs.REPO_ROOT, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, GEOM_ZYGOTE_PROBE='another environment'))
  assert result.returncode == 2, result.stderr
  assert _served(before) == []
  assert "differs in ['GEOM_ZYGOTE_PROBE']" in _log()


def test_a_python_c_process_is_never_served():
  before = _count()
  result = subprocess.run([sys.executable, '-c', 'print(42)'],
                          capture_output=True, text=True, timeout=60)
  assert result.stdout == '42\n' and _served(before) == []
