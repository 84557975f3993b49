"""The tests' own helper for waiting on a job's processes (launch_runs)."""

import os
import subprocess
import sys

import pytest

from tests import launch_runs


def _start(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, '-c', code],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True,
                          env=dict(os.environ, PYTHONFAULTHANDLER='1'))


def test_each_process_ends_with_its_code_and_streams():
  procs = [_start('print("a")'),
           _start('import sys; sys.stderr.write("b"); sys.exit(3)')]
  assert launch_runs.communicate_all(procs, 60) == [(0, 'a\n', ''),
                                                    (3, '', 'b')]


def test_a_hung_process_is_reported_with_its_stack_and_the_others_ends():
  """A job that hangs fails the test with where each process was (the
  hung one's Python stack, from SIGABRT), not only a timeout."""
  done = _start('import sys; sys.stderr.write("finished"); sys.exit(2)')
  hung = _start('import time\n'
                'def waits_for_a_peer():\n'
                '  time.sleep(120)\n'
                'waits_for_a_peer()\n')
  with pytest.raises(AssertionError) as caught:
    launch_runs.communicate_all([done, hung], 1)
  text = str(caught.value)
  assert 'still ran after 1 s' in text
  assert '--- process 0 (exit 2)' in text and 'finished' in text
  assert '--- process 1 (exit -6)' in text, text
  assert 'line 3 in waits_for_a_peer' in text, text
  assert hung.poll() is not None
