"""Run `python -m launch.train` in a subprocess, as a user would."""

import os
import signal
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(workdir: str, *overrides: str,
            config: str = 'configs/digits.py:runlocal') -> list[str]:
  return [sys.executable, '-m', 'launch.train', f'--config={config}',
          f'--workdir={workdir}', *overrides]


def start(workdir: str, *overrides: str, zygote: bool = True,
          **kw) -> subprocess.Popen:
  """The launcher, started; `zygote=False` for a test of its start-up
  (its imports, its signal handlers as they are installed), which a
  process forked from the worker's zygote has already behind it
  (tests/launch_zygote.py)."""
  return subprocess.Popen(command(workdir, *overrides, **kw), cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=None if zygote else without_zygote())


def without_zygote(env: dict | None = None) -> dict:
  """`env` (default: this process's) for a process that must start the
  usual way, not forked from the worker's zygote."""
  return dict(os.environ if env is None else env, GEOM_NO_ZYGOTE='1')


def run(workdir: str, *overrides: str, timeout: float = 300,
        **kw) -> subprocess.CompletedProcess:
  return subprocess.run(command(workdir, *overrides, **kw), cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=timeout)


_HOLD = ('import sys, time\n'
         'from train.run import workdir_lock\n'
         'with workdir_lock.hold(sys.argv[1]):\n'
         '  print("held", flush=True)\n'
         '  time.sleep(600)\n')


def hold_workdir(workdir: str) -> subprocess.Popen:
  """Another process holding `workdir`'s lock (as a live run would), once
  it says so; kill it to release the lock."""
  proc = subprocess.Popen([sys.executable, '-c', _HOLD, workdir],
                          cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'held'
  return proc


def run_module(module: str, *args: str, timeout: float = 120
               ) -> subprocess.CompletedProcess:
  """`python -m <module> <args>` from the repository root."""
  return subprocess.run([sys.executable, '-m', module, *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=timeout)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
  """The non-blank lines a run wrote to stderr."""
  return [l for l in result.stderr.splitlines() if l.strip()]


def run_while_held(workdir: str, run) -> subprocess.CompletedProcess:
  """`run()` while another process holds `workdir`'s lock."""
  holder = hold_workdir(workdir)
  try:
    return run()
  finally:
    holder.kill()
    holder.wait()


def communicate_all(procs: list[subprocess.Popen], timeout: float,
                    wait_for: list[subprocess.Popen] | None = None
                    ) -> list[tuple[int, str, str]]:
  """(exit code, stdout, stderr) of each of `wait_for` (default: all of
  `procs`), each given `timeout` s; every process of `procs` still
  running afterwards is killed.

  Raises:
    AssertionError: a process outlived its `timeout`. Every process still
      running is then sent SIGABRT first, which makes one started with
      PYTHONFAULTHANDLER=1 print each thread's stack, and the message
      gives every process's exit code and the end of its stderr: where
      a job hung, not only that it did.
  """
  wait_for = procs if wait_for is None else wait_for
  outs = []
  try:
    for p in wait_for:
      outs.append(p.communicate(timeout=timeout))
  except subprocess.TimeoutExpired as e:
    hung = e.cmd
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGABRT)
    ends = []
    for i, p in enumerate(procs):
      if i < len(outs) and p is wait_for[i]:
        err = outs[i][1]
      else:
        try:
          _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
          p.kill()
          _, err = p.communicate()
      ends.append(f'--- process {i} (exit {p.returncode}), the end of its '
                  f'stderr:\n{(err or "")[-6000:]}')
    raise AssertionError(
        f'{hung} still ran after {timeout} s; every process still running '
        'was sent SIGABRT:\n' + '\n'.join(ends)) from None
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  return [(p.returncode, out, err) for p, (out, err) in zip(wait_for, outs)]


def run_measured(args: list[str], timeout: float = 120, **popen_kw
                 ) -> tuple[subprocess.CompletedProcess, int]:
  """`args` run from the repository root: (its result, its peak resident
  memory in bytes; that of its largest process where it started others).

  The peak is the kernel's (wait4's rusage of this child and its waited-for
  descendants, not of the test process's other children). A run past
  `timeout` s is killed and raises subprocess.TimeoutExpired.
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile(
      'w+') as err, tempfile.NamedTemporaryFile('r') as peak:
    # Started by a small process (_MEASURE), not by this one: a child's
    # peak counts its parent's resident memory at the fork (1.2 GB after
    # the Gemma tests in one worker).
    # Its own process, not one forked from the zygote: the peak is what a
    # user's run reaches, imports included.
    popen_kw['env'] = without_zygote(popen_kw.get('env'))
    proc = subprocess.Popen([sys.executable, '-c', _MEASURE, peak.name,
                             *args], cwd=REPO_ROOT, stdout=out, stderr=err,
                            text=True, start_new_session=True, **popen_kw)
    killed = threading.Event()

    def kill():
      killed.set()
      os.killpg(proc.pid, signal.SIGKILL)
    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
      _, status, _ = os.wait4(proc.pid, 0)
    finally:
      timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    if killed.is_set():
      raise subprocess.TimeoutExpired(args, timeout, out.read(), err.read())
    result = subprocess.CompletedProcess(args, proc.returncode, out.read(),
                                         err.read())
    peak_kb = int(peak.read() or 0)
  return result, peak_kb * 1024


# Runs argv[2:] as its child and writes the child's peak resident memory
# (KB, wait4's) to the file argv[1]; exits as the child did.
_MEASURE = """
import os, signal, sys
pid = os.fork()
if pid == 0:
  os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], 'w') as f:
  f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
if code < 0:
  signal.signal(-code, signal.SIG_DFL)
  os.kill(os.getpid(), -code)
sys.exit(code)
"""


def run_module_each(module: str, argvs: list[list[str]], timeout: float = 120
                    ) -> list[subprocess.CompletedProcess]:
  """`python -m <module> <argv>` from the repository root for each of
  `argvs`: each its own process, with its own exit status, stdout and
  stderr, forked from one that imported `<module>.__main__` once (what a
  process spends importing jax and the project, 1.5 s of CPU, is spent once
  for all of them). For runs that end before any computation (bad flags):
  the forks happen before jax starts a backend."""
  import json  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.NamedTemporaryFile('r') as results:
    proc = subprocess.run(
        [sys.executable, '-c', _EACH, module, json.dumps(argvs),
         results.name], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [subprocess.CompletedProcess([sys.executable, '-m', module, *argv],
                                        code, out, err)
            for argv, (code, out, err) in zip(argvs, json.load(results))]


def run_study_each(tmp_path_factory, module: str, flag_lists, common=()
                   ) -> list[tuple[subprocess.CompletedProcess, object]]:
  """(result, workdir) of `python -m <module> --workdir=<new> *common
  *flags` for each of `flag_lists`, through `run_module_each`: one fresh
  workdir (not created) per run, for runs that must fail before any work."""
  workdirs = [tmp_path_factory.mktemp('bad') / 'study' for _ in flag_lists]
  results = run_module_each(module, [
      [f'--workdir={workdir}', *common, *flags]
      for workdir, flags in zip(workdirs, flag_lists)])
  return list(zip(results, workdirs))


# argv[1]: the module; argv[2]: its argument lists (JSON); argv[3]: where
# to write [exit status, stdout, stderr] of each. A child exits as
# `python -m` would (app.run's sys.exit, atexit handlers, an uncaught
# exception's traceback).
_EACH = """
import importlib, json, os, sys, tempfile
from absl import app
module, argvs, results = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
main_module = importlib.import_module(module + '.__main__')
from jax._src import xla_bridge
assert not xla_bridge._backends, 'a backend started before the forks'
outs = []
for argv in argvs:
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      os.dup2(out.fileno(), 1)
      os.dup2(err.fileno(), 2)
      sys.argv = [main_module.__file__, *argv]
      app.run(main_module.main)
      sys.exit(0)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    outs.append((os.waitstatus_to_exitcode(status), out.read(), err.read()))
with open(results, 'w') as f:
  json.dump(outs, f)
"""
