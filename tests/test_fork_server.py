"""tests/fork_server.py: a `python -m` process forked from the server
behaves as one started afresh (output, exit status, signals, cwd,
environment, sessions, timeouts), and what is not eligible starts afresh."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import fork_server

_MODULE = textwrap.dedent('''
    import atexit, os, sys, threading, time
    what = sys.argv[1]
    atexit.register(lambda: print('atexit', flush=True))
    if what == 'echo':
      print(sys.stdin.read().upper(), os.getcwd(), os.environ['GEOM_PROBE'],
            sys.argv[0].endswith('probe.py'), sys.path[0] == os.getcwd())
    elif what == 'sleep':
      print('ready', flush=True)
      time.sleep(60)
    elif what == 'thread':
      threading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()
    elif what == 'session':
      print(os.getsid(0) == os.getpid())
    elif what == 'fail':
      raise ValueError('planted')
    elif what == 'interrupt':
      raise KeyboardInterrupt
    sys.exit({'code': 3, 'text': 'bad flag', 'none': None}.get(what, 0))
''')


@pytest.fixture
def probe(tmp_path):
  (tmp_path / 'probe.py').write_text(_MODULE)
  return tmp_path


def _both(probe, what, stdin_text=None, **kw):
  """(forked, fresh) results of `python -m probe <what>` in `probe`."""
  out = []
  for cls in (fork_server.Popen, fork_server._ORIGINAL):  # pylint: disable=protected-access
    with cls([sys.executable, '-m', 'probe', what], cwd=probe,
             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
             env=dict(os.environ, GEOM_PROBE='p'), **kw) as proc:
      stdout, stderr = proc.communicate(stdin_text, timeout=60)
      out.append((proc, proc.returncode, stdout, stderr))
  assert out[0][0]._forked  # pylint: disable=protected-access
  return out


@pytest.mark.parametrize('what, code', [
    ('echo', 0), ('code', 3), ('text', 1), ('none', 0), ('thread', 0),
    ('fail', 1), ('interrupt', -signal.SIGINT)])
def test_a_forked_module_ends_as_a_fresh_process_does(probe, what, code):
  forked, fresh = _both(probe, what, 'in', stdin=subprocess.PIPE)
  assert forked[1] == fresh[1] == code
  assert forked[2] == fresh[2]
  # Tracebacks name the caller's frames: compare their last lines.
  assert forked[3].splitlines()[-1:] == fresh[3].splitlines()[-1:]
  if what == 'echo':
    assert forked[2] == f'IN {probe} p True True\natexit\n'
  if what == 'thread':
    assert forked[2] == 'joined\natexit\n'


def test_signals_kill_and_timeouts_reach_the_forked_child(probe):
  for send, code in ((lambda p: p.kill(), -9),
                     (lambda p: p.terminate(), -15),
                     (lambda p: p.send_signal(signal.SIGINT), -2)):
    proc = fork_server.Popen([sys.executable, '-m', 'probe', 'sleep'],
                             cwd=probe, stdout=subprocess.PIPE, text=True)
    assert proc._forked  # pylint: disable=protected-access
    assert proc.stdout.readline() == 'ready\n'
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
      proc.wait(timeout=0.2)
    send(proc)
    assert proc.wait(timeout=30) == code
    proc.stdout.close()
  fork_server.install()
  try:
    with pytest.raises(subprocess.TimeoutExpired):
      subprocess.run([sys.executable, '-m', 'probe', 'sleep'], cwd=probe,
                     capture_output=True, timeout=1)
  finally:
    subprocess.Popen = fork_server._ORIGINAL  # pylint: disable=protected-access


def test_a_new_session_is_its_own(probe):
  forked, fresh = _both(probe, 'session', start_new_session=True)
  assert forked[2] == fresh[2] == 'True\natexit\n'


@pytest.mark.parametrize('change', [
    dict(env=dict(os.environ, JAX_ENABLE_X64='1')),  # Read at import.
    dict(args=[sys.executable, '-X', 'dev', '-m', 'probe', 'code']),
    dict(args=[sys.executable, '-c', 'import sys; sys.exit(3)']),
    dict(executable=sys.executable)])
def test_what_is_not_eligible_starts_afresh(probe, change):
  args = change.pop('args', [sys.executable, '-m', 'probe', 'code'])
  with fork_server.Popen(args, cwd=probe, **change) as proc:
    assert proc.wait(timeout=60) == 3
  assert not proc._forked  # pylint: disable=protected-access
