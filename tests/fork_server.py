"""`python -m <module>` processes forked from a process that has imported
jax, flax, optax, orbax and geom once, instead of started afresh.

The suite starts hundreds of launcher processes; each spent about 1.2 s of
CPU importing the same libraries before doing anything
(docs/lab/contributing.md, "Tests"). `install()` replaces `subprocess.Popen` in the test process
with `Popen`, a subclass that sends an eligible command to a server (one
per test process, started on first use) which forks a child for it: the
child is a real process with its own pid, stdio, cwd, environment, exit
status and signals, and `Popen`'s own pipes, `communicate`, timeouts,
`kill` and `send_signal` work unchanged; only waiting goes through the
server, whose child it is.

Eligible: `[sys.executable, '-m', module, ...]` with no interpreter
options, shell, preexec_fn, pass_fds, user or group changes, and an
environment that agrees with the server's on every variable read at
import time (`_IMPORT_TIME`). Anything else starts as before.
"""

import atexit
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Iterator

_ORIGINAL = subprocess.Popen
# Variables the pre-imported libraries (or the interpreter) read when they
# are imported: a child whose environment differs in one starts afresh.
_IMPORT_TIME = ('JAX_', 'PYTHON', 'LD_', 'OPENBLAS_', 'OMP_', 'MKL_',
                'TF_', 'TFDS_', 'XLA_PYTHON_')
_PRELOAD = ('jax', 'flax.linen', 'optax', 'orbax.checkpoint', 'numpy',
            'ml_collections', 'absl.app', 'geom')

_lock = threading.Lock()
_server: dict = {}
_fresh = threading.local()


@contextlib.contextmanager
def fresh() -> Iterator[None]:
  """Processes this thread starts inside start afresh (for tests of what a
  process does while it imports)."""
  before = getattr(_fresh, 'on', False)
  _fresh.on = True
  try:
    yield
  finally:
    _fresh.on = before


def _sensitive(env) -> dict:
  return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME)}


def _address() -> str | None:
  """The server's socket, started on first use (None: unavailable)."""
  with _lock:
    if _server.get('pid') != os.getpid():
      root = tempfile.mkdtemp(prefix='geom_forks_')
      path = os.path.join(root, 's')
      proc = _ORIGINAL([sys.executable, '-c', _SERVER, path,
                        json.dumps(_PRELOAD)], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       cwd=root)
      ready = proc.stdout.readline().strip() == b'ready'
      _server.update(pid=os.getpid(), proc=proc, path=path if ready else None,
                     env=_sensitive(os.environ))
      atexit.register(proc.stdin.close)  # The server exits on EOF.
    return _server['path']


def _eligible(args, kw) -> bool:
  if (getattr(_fresh, 'on', False) or isinstance(args, (str, bytes, os.PathLike)) or len(args) < 3
      or args[0] != sys.executable or args[1] != '-m'
      or not all(isinstance(a, str) for a in args)):
    return False
  if (kw.get('shell') or kw.get('preexec_fn') is not None
      or kw.get('pass_fds') or kw.get('executable') is not None
      or any(kw.get(k) is not None for k in ('user', 'group',
                                             'extra_groups'))
      or kw.get('umask', -1) != -1 or not kw.get('close_fds', True)):
    return False
  env = kw.get('env')
  return _sensitive(os.environ if env is None else env) == _server.get(
      'env', _sensitive(os.environ))


class Popen(_ORIGINAL):
  """`subprocess.Popen`, forking eligible commands from the server."""

  def __init__(self, args, *rest, **kw):
    self._conn = None
    self._status = None
    self._forked = not rest and _eligible(args, kw)
    super().__init__(args, *rest, **kw)

  def _execute_child(self, args, executable, preexec_fn, close_fds,
                     pass_fds, cwd, env, startupinfo, creationflags, shell,
                     p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                     restore_signals, gid, gids, uid, umask,
                     start_new_session, process_group):
    path = _address() if self._forked else None
    if path is None:
      self._forked = False
      return super()._execute_child(
          args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
          umask, start_new_session, process_group)
    try:
      fds = [p2cread if p2cread != -1 else 0,
             c2pwrite if c2pwrite != -1 else 1,
             errwrite if errwrite != -1 else 2]
      request = dict(
          module=args[2], argv=list(args[3:]),
          cwd=os.path.abspath(os.fspath(cwd)) if cwd else os.getcwd(),
          env=dict(os.environ if env is None else
                   {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}),
          session=bool(start_new_session),
          group=-1 if process_group is None else process_group)
      self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
      self._conn.connect(path)
      socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
      self.pid = struct.unpack('q', self._conn.recv(8))[0]
      self._child_created = True
    finally:
      self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread,
                           errwrite)

  def _server_waitpid(self, pid, flags):
    if self._status is None:
      self._conn.setblocking(not flags & os.WNOHANG)
      try:
        data = self._conn.recv(4)
      except BlockingIOError:
        return 0, 0
      self._status = struct.unpack('i', data)[0]
      self._conn.close()
    return pid, self._status

  def _try_wait(self, wait_flags):
    if not self._forked:
      return super()._try_wait(wait_flags)
    return self._server_waitpid(self.pid, wait_flags)

  def _internal_poll(self, _deadstate=None, **kw):
    if not getattr(self, '_forked', False):
      return super()._internal_poll(_deadstate, **kw)
    return super()._internal_poll(_deadstate, _waitpid=self._server_waitpid)


def install() -> None:
  """Routes eligible `subprocess.Popen` (and so `subprocess.run`) calls of
  this process through the server."""
  subprocess.Popen = Popen


# argv[1]: the socket's path; argv[2]: the modules to import (JSON). Says
# "ready" on stdout, then serves until its stdin closes. Single-threaded
# (a fork copies only the calling thread): a select loop over the socket,
# stdin and a self-pipe that SIGCHLD wakes.
_SERVER = r'''
import atexit, importlib, json, os, runpy, select, signal, socket, struct
import sys, threading, traceback
path, preload = sys.argv[1], json.loads(sys.argv[2])
for name in preload:
  importlib.import_module(name)
from jax._src import xla_bridge
assert not xla_bridge._backends, 'a backend started in the fork server'
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(path)
listener.listen(64)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
children = {}
sys.stdout.write('ready\n')
sys.stdout.flush()


def child(request, fds):
  signal.set_wakeup_fd(-1)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  if request['session']:
    os.setsid()
  elif request['group'] != -1:
    os.setpgid(0, request['group'])
  for target, fd in enumerate(fds):
    os.dup2(fd, target)
  os.closerange(3, os.sysconf('SC_OPEN_MAX'))
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  sys.path[0] = os.getcwd()
  sys.argv = ['-m', *request['argv']]
  code = 0
  try:
    runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
  except SystemExit as e:
    if e.code is None:
      code = 0
    elif isinstance(e.code, int):
      code = e.code
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except KeyboardInterrupt:
    traceback.print_exc()
    code = -signal.SIGINT
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  try:
    threading._shutdown()  # pylint: disable=protected-access
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    sys.stdout.flush()
    sys.stderr.flush()
  finally:
    if code == -signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)
      os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xff)


while True:
  ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
  if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
    break
  if listener in ready:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      child(request, fds)
    for fd in fds:
      os.close(fd)
    conn.sendall(struct.pack('q', pid))
    children[pid] = conn
  if wake_r in ready:
    os.read(wake_r, 4096)
  while children:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      break
    if pid == 0:
      break
    conn = children.pop(pid, None)
    if conn is not None:
      try:
        conn.sendall(struct.pack('i', status))
      except OSError:
        pass
      conn.close()
'''
