"""What every absl entry point in launch/ shares: one-line usage errors,
quiet library logs, and device settings that precede JAX's start."""

from collections.abc import Callable
import os
import re
import signal
import sys
import threading
from typing import NoReturn, TypeVar

from absl import flags
from absl import logging

EXIT_USAGE = 2
# The workdir is held by another run: try again later (sysexits' EX_TEMPFAIL).
EXIT_BUSY = 75


# Libraries whose routine lines (one per checkpoint file, per data set
# lookup, ...) would bury the progress line, with the highest level hidden.
_QUIET_LIBRARIES = {
    '/orbax/': logging.logging.INFO,
    '/jax/_src/': logging.logging.INFO,
    # TFDS warns about missing metadata of every variant folder it scans.
    '/tensorflow_datasets/': logging.logging.WARNING,
}


# Where a full disk is logged from background threads, with a traceback per
# array (orbax's save threads; asyncio's unretrieved tasks at exit). The run
# reports it in one line (`errors.DiskFull`).
_DISK_FULL_LOGGERS = ('/orbax/', '/asyncio/', '/tensorstore/')


class LibraryNoiseFilter(logging.logging.Filter):
  """Hides libraries' routine lines, and their error records of a full disk
  (from the first such record on, all of their errors: the follow-ups of a
  failed save name no cause)."""

  def __init__(self):
    super().__init__()
    from train.run import disk_space  # pylint: disable=g-import-not-at-top
    self._disk_full_text = disk_space.FULL_DISK_TEXT
    self._disk_full_seen = False

  def filter(self, record) -> bool:
    if any(lib in record.pathname and record.levelno <= level
           for lib, level in _QUIET_LIBRARIES.items()):
      return False
    if '/asyncio/' in record.pathname and 'never retrieved' in record.msg:
      # Orbax leaves the futures of a failed read or write unretrieved; the
      # failure itself reaches the run as an exception, which it reports.
      return False
    if (record.levelno >= logging.logging.ERROR
        and any(lib in record.pathname for lib in _DISK_FULL_LOGGERS)):
      if not self._disk_full_seen:
        text = record.getMessage()
        if record.exc_info:
          text += repr(record.exc_info[1])
        self._disk_full_seen = bool(self._disk_full_text.search(text))
      return not self._disk_full_seen
    return True


def _quiet_unraisable(previous):
  from train.errors import Interrupted  # pylint: disable=g-import-not-at-top

  def hook(unraisable):
    error = unraisable.exc_value
    # Tensorstore completing a read of a failed checkpoint restore after
    # orbax closed its event loop: a leftover, not a new error.
    if (isinstance(error, RuntimeError)
        and str(error) == 'Event loop is closed'):
      return
    # A signal's exception raised inside a callback that drops it (e.g. a
    # garbage-collection hook): the launcher raises it again and reports it.
    if isinstance(error, Interrupted):
      return
    previous(unraisable)
  return hook


def quiet_libraries() -> None:
  """Hides the libraries' routine log lines and their leftovers of a failure
  the run reports itself (`LibraryNoiseFilter`, closed-loop callbacks)."""
  logging.get_absl_handler().addFilter(LibraryNoiseFilter())
  sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


def exit_now(code: int) -> None:
  """Flushes the streams and logs, then ends the process with `code`.

  For a run that already reported why it ends: the interpreter's teardown
  would run the leftovers of a failed checkpoint read or write (tensorstore
  callbacks into a closed event loop), each printing a traceback after the
  one line that matters. The checkpoints' blocks have waited for their
  writes by then.
  """
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  for handler in logging.logging.getLogger().handlers:
    handler.flush()
  os._exit(code)  # pylint: disable=protected-access


def one_line(error: Exception, argv: list[str]) -> str:
  """The useful part of a flag-parsing error, on one line."""
  text = str(error.args[0] if error.args else error)
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  if isinstance(error, (KeyError, AttributeError)):
    # ConfigDict's message for an override of a field that does not exist.
    hint = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
    field = hint.group(2) if hint else lines[0].strip('\'"')
    flag = next((a.split('=')[0] for a in argv
                 if a.startswith('--config.') and field in a), '--config.*')
    return (f'{flag}: the config has no field {field!r}'
            + (f'; did you mean {hint.group(1)!r}?' if hint else ''))
  if isinstance(error, OSError):
    return f'--config: cannot load the config file: {lines[-1]}'
  if any(l.startswith('Traceback') for l in lines):
    # config_flags embeds the traceback of get_config(); its last line says it.
    return f'{lines[0]} {lines[-1]}'
  return ' '.join(lines)


def parse_flags(argv: list[str], config_flag) -> list[str]:
  """absl's flag parsing, with a mistake reported as one line (exit status 2).

  `config_flag` is the job's `config_flags.DEFINE_config_file` holder (or
  None for jobs whose --config is a plain path).
  """
  try:
    rest = flags.FLAGS(argv)
    if config_flag is not None:
      config_flag.value.keys()  # A config file that failed to load raises here.
    return rest
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError,
          OSError) as e:
    print(f'error: {one_line(e, argv)}', file=sys.stderr)
    sys.exit(EXIT_USAGE)


def configure_devices(config) -> None:
  """Simulated CPU devices (`config.cpu_devices`), before JAX starts its backend."""
  from train.training import host_devices  # pylint: disable=g-import-not-at-top
  if config.get('cpu_devices') is not None:
    host_devices.configure_cpu_devices(config.cpu_devices)


_T = TypeVar('_T')


def off_main_thread(work: Callable[[], _T], check: Callable[[], None], *,
                    name: str, poll_s: float = 0.1) -> _T:
  """`work()` on a daemon thread while the calling (main) thread waits for
  it, calling `check()` every `poll_s` seconds; returns its result.

  For waits that block in C++ (jax.distributed's start, XLA's compile):
  on the main thread they would hold SIGTERM and SIGINT until they
  return, since Python runs signal handlers there only, between
  bytecodes. Here the launcher's handlers (`run_job`) raise in the wait,
  and `check` can end it (a deadline); `exit_now` then ends the process,
  thread and all.

  Raises:
    whatever `work` or `check` raised; `errors.Interrupted` from a signal.
  """
  outcome = {}
  done = threading.Event()

  def worker() -> None:
    try:
      outcome['result'] = work()
    except BaseException as e:  # pylint: disable=broad-except
      outcome['error'] = e
    finally:
      done.set()

  threading.Thread(target=worker, name=name, daemon=True).start()
  while not done.wait(poll_s):
    check()
  if 'error' in outcome:
    raise outcome['error']
  return outcome['result']


def run_job(job: Callable[[], _T],
            end: Callable[[int], NoReturn] = sys.exit) -> _T:
  """`job()` under the launchers' signal and exit policy; returns its result.

  Each end is one line on stderr and an exit status: a workdir held by
  another run 75; a usage error 2; a run error its own code (no usable
  checkpoint 4, non-finite loss 3, full disk 5, damaged data 6); a signal
  before the job's loop 128 + its number; SIGTERM during the loop (a
  checkpoint saved) 0, SIGINT 130. `end(code)` ends the process after a
  stop saved (default `sys.exit`; a job of several processes passes its
  own, `train.jobs.multihost.exit_job`); the other ends are `exit_now`'s.
  """
  # pylint: disable=g-import-not-at-top
  from train.run import preemption
  from train.errors import Interrupted, Preempted, RunError, UsageError
  from train.run.job import WorkdirBusy
  # pylint: enable=g-import-not-at-top
  with preemption.raise_on_signals():
    try:
      result = job()
      preemption.raise_if_interrupted()
      return result
    except WorkdirBusy as e:
      print(f'error: {e}', file=sys.stderr)
      exit_now(EXIT_BUSY)
    except UsageError as e:
      print(f'error: {e}', file=sys.stderr)
      exit_now(EXIT_USAGE)
    except RunError as e:
      print(f'error: {e}', file=sys.stderr)
      exit_now(e.exit_code)
    except Interrupted as e:
      # The signal may have cut a library's start-up short: teardown could
      # crash on the half-made backend.
      print(str(e), file=sys.stderr)
      exit_now(128 + e.signum)
    except Preempted as e:
      logging.info('%s', e)
      print(str(e), file=sys.stderr)
      # SIGTERM is how schedulers preempt: a clean stop (0). Ctrl-C keeps
      # the shell's convention for an interrupted command.
      end(0 if e.signal_name == 'SIGTERM' else 128 + signal.SIGINT)
