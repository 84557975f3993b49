"""The core's workdir lock and stop signals, and a workdir held by a job
that does not resume (`train.run.job.open_job`): an evaluation or a
study's root."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import launch_runs
from train import errors
from train import fileio
from train.run import job
from train.run import preemption
from train.run import workdir_lock

EXIT_BUSY = 75

# A job run as a launcher runs it: `entry.run_job` maps its errors to exits.
_JOB = ('import sys\n'
        'from train.jobs import entry\n'
        'from train.run.job import open_job\n'
        'def work():\n'
        '  with open_job(sys.argv[1]):\n'
        '    print("ran", flush=True)\n'
        'entry.run_job(work)\n')


def test_a_held_workdir_ends_a_job_in_one_line_with_exit_75(tmp_path):
  workdir = str(tmp_path)
  holder = launch_runs.hold_workdir(workdir)
  try:
    assert job.holder(workdir)['pid'] == holder.pid
    result = subprocess.run([sys.executable, '-c', _JOB, workdir],
                            cwd=launch_runs.REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
  finally:
    holder.kill()
    holder.wait()
  assert result.returncode == EXIT_BUSY, result.stderr[-3000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1, lines
  assert lines[0].startswith(f'error: --workdir={workdir!r}: in use by '
                             f'another run (host ') and (
                                 f'pid {holder.pid}' in lines[0]), lines
  assert 'ran' not in result.stdout
  assert job.holder(workdir) is None


def test_a_job_holds_its_workdir_for_the_block(tmp_path):
  workdir = str(tmp_path)
  with job.open_job(workdir):
    assert job.holder(workdir)['pid'] == os.getpid()
    with pytest.raises(job.WorkdirBusy, match=f'pid {os.getpid()}'):
      with job.open_job(workdir):
        pass
  assert job.holder(workdir) is None


def test_a_special_file_is_refused_before_the_lock_is_taken(tmp_path):
  os.mkfifo(tmp_path / 'results.json')
  with pytest.raises(fileio.SpecialFile, match='results.json is a FIFO'):
    with job.open_job(str(tmp_path)):
      pass
  assert os.listdir(tmp_path) == ['results.json']


def test_a_stop_signal_ends_a_job_and_its_handler_is_restored(
    tmp_path, monkeypatch):
  monkeypatch.setattr(preemption, '_STOPPING', threading.Event())
  monkeypatch.setattr(preemption, '_PENDING', [])
  before = []
  previous = signal.signal(signal.SIGTERM, lambda *_: before.append(1))
  try:
    with pytest.raises(errors.Interrupted) as e:
      with job.open_job(str(tmp_path)):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # Python runs the handler between bytecodes.
          pass
    assert e.value.signum == signal.SIGTERM
    assert not before  # The job's handler took it, not the one before.
    os.kill(os.getpid(), signal.SIGTERM)
    assert before == [1]  # Restored on the way out.
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert job.holder(str(tmp_path)) is None


def test_the_lock_is_exclusive_and_released(tmp_path):
  workdir = str(tmp_path)
  with workdir_lock.hold(workdir):
    info = workdir_lock.holder(workdir)  # Another open file: flock conflicts.
    assert info['pid'] == os.getpid()
    with pytest.raises(workdir_lock.WorkdirBusy, match=f'pid {os.getpid()}'):
      with workdir_lock.hold(workdir):
        pass
  assert workdir_lock.holder(workdir) is None


def test_after_a_stop_signal_a_second_signal_does_not_cut_the_save_short(
    monkeypatch):
  # Ctrl-C reaches a sweep and its runs; the sweep then terminates them
  # while they save. The second signal must not raise in the saving run.
  monkeypatch.setattr(preemption, '_STOPPING', threading.Event())
  monkeypatch.setattr(preemption, '_PENDING', [])
  with preemption.raise_on_signals():
    stop = preemption.StopFlag()
    with stop.installed():
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.1)  # Handlers run between bytecodes of the main thread.
      assert stop.requested(1) and stop.signal_name == 'SIGINT'
    os.kill(os.getpid(), signal.SIGTERM)  # During the save, after the loop.
    time.sleep(0.1)
    preemption.raise_if_interrupted()  # Nothing pending either.
  monkeypatch.setattr(preemption, '_STOPPING', threading.Event())
  with pytest.raises(errors.Interrupted, match='SIGTERM'):
    with preemption.raise_on_signals():  # Without a stop: start-up.
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.1)
