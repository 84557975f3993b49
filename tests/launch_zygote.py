"""A zygote for the suite's launcher processes: imports once, forks per run.

The suite starts about 200 `python -m launch.<x>` and `python -m
studies.<x>` processes, and each spent 1.2-3 s of CPU importing jax, flax,
optax, orbax, TFDS, matplotlib and the project before its first line of
work: about a sixth of the suite's CPU time on 2 cores. Each xdist worker
starts one zygote (tests/conftest.py): a process that imports those once,
starts no JAX backend and no thread of its own, and serves a Unix socket.
A launcher process the tests start (a real `subprocess.Popen` of `python
-m ...`) finds the socket through tests/zygote_hook/sitecustomize.py,
sends its argv, working directory, environment and standard streams, and
the zygote forks a child that runs the module as `python -m` would
(runpy's `__main__`, sys.exit's status, an uncaught exception's
traceback, atexit handlers). The launcher process stays as the child's
stand-in: it passes its signals on and exits as the child did, and if it
is killed (kill -9 included) the zygote kills the child at once.

A run is refused (and then starts the usual way, in its own process) when
its environment differs from the zygote's in anything but the variables
read after start-up (_PER_PROCESS), when it starts from another directory,
or when the zygote could not fork cleanly (a JAX backend or a thread
running). Tests of start-up itself (signals while a launcher imports, its
peak memory) set GEOM_NO_ZYGOTE=1.

Usage: `python -m tests.launch_zygote SOCKET` (tests/conftest.py).
"""

import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
import types

# The variables a run may set differently: each is read after start-up
# (XLA_FLAGS when JAX starts its backend, PYTHONFAULTHANDLER here in the
# child, the others by tests), so the child sets them itself; and
# LD_LIBRARY_PATH, which the dynamic loader reads at exec only and OpenCV
# (imported by TFDS) prefixes with its own directory in every process
# that imports it, the tests' own included.
# COLUMNS and LINES are the terminal's size, as pytest sets them;
# PYTHONUNBUFFERED is applied to the child's standard streams (_stdio);
# libtpu, started by a compile for a TPU target in a test process, sets the
# CLOUD_TPU_*/TPU_* variables in its C environment (out of os.environ's
# reach), which JAX reads when a TPU backend starts.
_PER_PROCESS = ('XLA_FLAGS', 'PYTHONFAULTHANDLER', 'PYTEST_CURRENT_TEST',
                'GEOM_TEST_ZYGOTE', 'LD_LIBRARY_PATH', 'COLUMNS', 'LINES',
                'PYTHONUNBUFFERED', 'CLOUD_TPU_ACCELERATOR_TYPE',
                'CLOUD_TPU_TASK_ID', 'TPU_WORKER_ID')

# What the launchers and studies import before their first line of work
# (their own modules are not: each run executes its module as __main__,
# and absl flags cannot be defined twice). sklearn (the digits data's
# source) and tensorboardX (the metrics writer) set variables at import
# (KMP_INIT_AT_FORK, CRC32C_SW_MODE) that the tests' processes pass on.
PRELOAD = ('absl.app', 'absl.flags', 'numpy', 'jax', 'jax.numpy',
           'jax.experimental.pallas', 'flax.linen', 'optax',
           'orbax.checkpoint', 'ml_collections', 'tensorflow_datasets',
           'sklearn',
           'tensorboardX.crc32c', 'matplotlib.figure',
           'train.jobs.entry', 'train.jobs.multihost',
           'train.jobs.trainers', 'train.vision.trainer',
           'train.lm.trainer', 'train.rl.run', 'train.tta.adapt',
           'train.analysis.plots')


def start(path: str, log: str) -> subprocess.Popen:
  """Starts a zygote on the Unix socket `path` (its own output to `log`),
  with this process's environment; returns at once (a run that comes
  before the zygote listens starts the usual way)."""
  env = {k: v for k, v in os.environ.items() if k not in _PER_PROCESS}
  with open(log, 'w') as out:
    return subprocess.Popen(
        [sys.executable, '-m', 'tests.launch_zygote', path], env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def _fork_blockers() -> str | None:
  """Why forking now would not give a clean process, or None."""
  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge
  # pylint: enable=g-import-not-at-top
  if xla_bridge._backends:  # pylint: disable=protected-access
    return 'a JAX backend is running'
  if threading.active_count() != 1:
    return f'{threading.active_count()} Python threads'
  return None


def _refusal(request: dict, started: dict, loaded: dict) -> str | None:
  """Why the zygote cannot run `request` as its own process would, or
  None. Its environment must be the one the zygote started with, but for
  _PER_PROCESS and for what the zygote's imports set to the same value
  (libraries set variables at import: KMP_INIT_AT_FORK, CRC32C_SW_MODE; a
  test process that imported them passes them on)."""
  if request['cwd'] != os.getcwd():
    return f'started in {request["cwd"]}, not {os.getcwd()}'
  env = request['env']
  keys = sorted(k for k in (set(env) | set(started)) - set(_PER_PROCESS)
                if env.get(k) != started.get(k)
                and env.get(k) != loaded.get(k))
  if keys:
    return f'its environment differs in {keys}'
  return _fork_blockers()


def _exit_status(e: SystemExit) -> int:
  """The status `python` exits with on this SystemExit."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code & 0xFF
  print(e.code, file=sys.stderr)
  return 1


def _stdio(unbuffered: bool) -> None:
  """sys.stdout and sys.stderr over the child's descriptors, buffered as
  Python buffers them at start-up with (or without) PYTHONUNBUFFERED."""
  import io  # pylint: disable=g-import-not-at-top
  for name, fd in (('stdout', 1), ('stderr', 2)):
    old = getattr(sys, name)
    raw = io.FileIO(fd, 'w', closefd=False)
    stream = io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding=old.encoding, errors=old.errors,
        line_buffering=old.line_buffering or os.isatty(fd),
        write_through=unbuffered)
    setattr(sys, name, stream)
    setattr(sys, f'__{name}__', stream)


def _run(request: dict) -> None:
  """In the forked child: runs the request's module as `python -m` does,
  then exits as it would. Never returns."""
  argv = request['argv']
  os.environ.update(request['env'])
  for key in _PER_PROCESS:
    if key not in request['env']:
      os.environ.pop(key, None)
  _stdio(bool(os.environ.get('PYTHONUNBUFFERED')))
  if os.environ.get('PYTHONFAULTHANDLER'):
    import faulthandler  # pylint: disable=g-import-not-at-top
    faulthandler.enable()
  if 'numpy' in sys.modules:
    sys.modules['numpy'].random.seed()  # A fresh process's own entropy.
  sys.orig_argv = list(argv)
  sys.argv = ['-m', *argv[3:]]
  sys.modules['__main__'] = types.ModuleType('__main__')
  import runpy  # pylint: disable=g-import-not-at-top
  status, interrupted = 0, False
  try:
    runpy._run_module_as_main(argv[2])  # pylint: disable=protected-access
  except SystemExit as e:
    status = _exit_status(e)
  except KeyboardInterrupt:
    traceback.print_exc()
    interrupted = True
  except BaseException:  # pylint: disable=broad-except
    sys.excepthook(*sys.exc_info())
    status = 1
  threading._shutdown()  # pylint: disable=protected-access
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  if interrupted:  # As Python does: die by the signal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  os._exit(status)  # pylint: disable=protected-access


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
  data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
  size = struct.unpack('!Q', data[:8])[0]
  data = data[8:]
  while len(data) < size:
    more = conn.recv(size - len(data))
    if not more:
      raise ConnectionError('the launcher closed its request early')
    data += more
  return json.loads(data), fds


class _Zygote:
  """The serving loop: one connection per running child."""

  def __init__(self, listener: socket.socket, started: dict[str, str]):
    self.listener = listener
    # A child's exit wakes the loop (SIGCHLD through a pipe): no polling.
    self.wakeup, wakeup_w = os.pipe()
    for fd in (self.wakeup, wakeup_w):
      os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    self.started = started  # The environment before the imports.
    self.loaded = dict(os.environ)  # After them.
    self.children: dict[int, socket.socket] = {}  # pid -> its launcher.
    self.orphans: set[int] = set()  # Killed with their launcher, not reaped.

  def accept(self) -> None:
    conn, _ = self.listener.accept()
    try:
      request, fds = _receive(conn)
    except (OSError, ValueError) as e:
      print(f'zygote: a bad request ({e})', flush=True)
      conn.close()
      return
    reason = _refusal(request, self.started, self.loaded)
    if reason is not None:
      print(f'zygote: refused {request["argv"][2:4]}: {reason}', flush=True)
      conn.sendall(f'no {reason}\n'.encode())
      conn.close()
      for fd in fds:
        os.close(fd)
      return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.listener.close()
        for other in self.children.values():
          other.close()
        conn.close()
        for target, fd in enumerate(fds):
          os.dup2(fd, target)
          if fd > 2:
            os.close(fd)
        os.chdir(request['cwd'])
      except BaseException:  # pylint: disable=broad-except
        os._exit(70)  # pylint: disable=protected-access
      _run(request)
    for fd in fds:
      os.close(fd)
    self.children[pid] = conn
    print(f'zygote: served {request["argv"][2]} as pid {pid}', flush=True)
    conn.sendall(f'ok {pid}\n'.encode())

  def reap(self) -> None:
    while self.children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        return
      self.orphans.discard(pid)
      conn = self.children.pop(pid, None)
      if conn is not None:
        try:
          conn.sendall(f'exit {status}\n'.encode())
        except OSError:
          pass
        conn.close()

  def launcher_gone(self, conn: socket.socket) -> None:
    """A launcher closed its end (it died): its child dies with it."""
    for pid, other in self.children.items():
      if other is conn:
        self.orphans.add(pid)
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass

  def serve(self) -> None:
    parent = os.getppid()
    while True:
      self.reap()
      conns = [c for p, c in self.children.items() if p not in self.orphans]
      # The timeout only checks on the worker (below).
      ready, _, _ = select.select([self.listener, self.wakeup, *conns], [],
                                  [], 1.0)
      for r in ready:
        if r == self.wakeup:
          while True:
            try:
              os.read(self.wakeup, 4096)
            except BlockingIOError:
              break
        elif r is self.listener:
          self.accept()
        elif not r.recv(1, socket.MSG_PEEK):
          self.launcher_gone(r)
      if os.getppid() != parent:  # The worker that started it is gone.
        return


def _cache_from_every_process() -> None:
  """Lets the children of a multi-process job write the persistent
  compilation cache from any process, not process 0 alone.

  JAX skips the write in processes other than 0 (jax/_src/compiler.py
  `_cache_write`, against write contention on shared filesystems such as
  GCS): a multi-process RL job's learner (its last process, or a group of
  two) compiled its programs afresh in every job of a test file, though
  the key and the suite's local cache directory are the same each time.
  Only the process-id test is lifted: the other conditions (host
  callbacks, the minimum compile time) stay JAX's, and a failed or torn
  write costs a compile, as for process 0. Tests only: the launchers
  themselves keep JAX's rule."""
  try:
    # pylint: disable=g-import-not-at-top
    from jax._src import compilation_cache
    from jax._src import compiler
    from jax._src import config
    from jax._src import distributed
    # pylint: enable=g-import-not-at-top
    write = compiler._cache_write  # pylint: disable=protected-access
  except (ImportError, AttributeError):  # Another JAX: leave it as it is.
    return

  def cache_write(cache_key, compile_time_secs, module_name, backend,
                  executable, host_callbacks):
    if (distributed.global_state.process_id == 0 or host_callbacks or
        compile_time_secs
        < config.persistent_cache_min_compile_time_secs.value):
      return write(cache_key, compile_time_secs, module_name, backend,
                   executable, host_callbacks)
    try:
      compilation_cache.put_executable_and_time(
          cache_key, module_name, executable, backend,
          int(compile_time_secs))
    except Exception as e:  # pylint: disable=broad-except
      # As JAX's own write (its _should_raise_persistent_cache_error
      # aside): a warning, and the next run compiles.
      import warnings  # pylint: disable=g-import-not-at-top
      warnings.warn('Error writing persistent compilation cache entry for '
                    f"'{module_name}': {type(e).__name__}: {e}")
    return None

  compiler._cache_write = cache_write  # pylint: disable=protected-access


def main(path: str) -> None:
  listener = socket.socket(socket.AF_UNIX)
  listener.bind(path)
  listener.listen(64)
  env = dict(os.environ)  # As started: imports below may change it.
  import importlib  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  # A library that logs through absl at import, before absl's handler is
  # in place (app.run installs it), gets logging.basicConfig's handler on
  # the root logger (orbax does): a launcher imports it in main, after
  # app.run, and the children wrote every line twice.
  handlers = list(logging.root.handlers)
  for name in PRELOAD:
    try:
      importlib.import_module(name)
    except ImportError as e:  # Not in a Bazel test's runfiles: not needed.
      print(f'zygote: not preloaded: {name} ({e})', flush=True)
  logging.root.handlers[:] = handlers
  _cache_from_every_process()
  reason = _fork_blockers()
  if reason is not None:
    print(f'zygote: not serving: {reason}', flush=True)
    return
  print(f'zygote: serving on {path}', flush=True)
  _Zygote(listener, env).serve()


if __name__ == '__main__':
  main(sys.argv[1])
