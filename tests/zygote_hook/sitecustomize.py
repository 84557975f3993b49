"""The suite's launcher processes, forked from its zygote (tests/launch_zygote.py).

Python imports this file at start-up where tests/zygote_hook is on
PYTHONPATH, which tests/conftest.py puts there for the processes the tests
start. It does nothing unless the process is `python -m launch.<x>`,
`python -m studies.<x>` or `python -m tests.transport_peer` and
GEOM_TEST_ZYGOTE names a zygote's socket: then
this process hands its argv, working directory, environment and standard
streams to the zygote, which forks a child that runs the module; this
process passes its signals on, and exits as the child did (its status, or
its signal). Anything else (no zygote, GEOM_NO_ZYGOTE set, a refusal)
leaves the process to start the module itself, as it would without this
file.
"""

import os


def _served() -> None:
  path = os.environ.get('GEOM_TEST_ZYGOTE')
  if not path or os.environ.get('GEOM_NO_ZYGOTE'):
    return
  import sys  # pylint: disable=g-import-not-at-top
  argv = sys.orig_argv
  # tests.transport_peer: test_rl_transport's jax.distributed jobs, whose
  # processes spent as long importing jax as the transfers they test.
  if len(argv) < 3 or argv[1] != '-m' or not argv[2].startswith(
      ('launch.', 'studies.', 'tests.transport_peer')):
    return
  # pylint: disable=g-import-not-at-top
  import json
  import signal
  import socket
  import struct
  # pylint: enable=g-import-not-at-top
  sock = socket.socket(socket.AF_UNIX)
  try:
    sock.connect(path)
    request = json.dumps({'argv': argv, 'cwd': os.getcwd(),
                          'env': dict(os.environ)}).encode()
    socket.send_fds(sock, [struct.pack('!Q', len(request)) + request],
                    [0, 1, 2])
    reply = sock.makefile('rb')
    line = reply.readline()
  except OSError:
    return
  if not line.startswith(b'ok '):
    return
  child = int(line.split()[1])

  def forward(signum, frame):
    del frame
    try:
      os.kill(child, signum)
    except ProcessLookupError:
      pass
  for name in ('SIGTERM', 'SIGINT', 'SIGHUP', 'SIGQUIT', 'SIGABRT',
               'SIGUSR1', 'SIGUSR2', 'SIGALRM'):
    signal.signal(getattr(signal, name), forward)
  line = reply.readline()
  if not line.startswith(b'exit '):
    sys.stderr.write('error: the test zygote ended before this launcher '
                     f'(pid {child})\n')
    os._exit(1)  # pylint: disable=protected-access
  status = int(line.split()[1])
  if os.WIFSIGNALED(status):
    signum = os.WTERMSIG(status)
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
  os._exit(os.waitstatus_to_exitcode(status))  # pylint: disable=protected-access


def _chain() -> None:
  """Runs the sitecustomize this file hides, if the interpreter has one."""
  # pylint: disable=g-import-not-at-top
  import importlib.machinery
  import importlib.util
  import sys
  # pylint: enable=g-import-not-at-top
  here = os.path.dirname(os.path.abspath(__file__))
  spec = importlib.machinery.PathFinder.find_spec('sitecustomize', [
      p for p in sys.path if os.path.abspath(p or '.') != here])
  if spec is not None:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_served()
_chain()
del _served, _chain
