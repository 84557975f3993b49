"""`launch.compile`'s work off the main thread: a budget per step, and
SIGTERM/SIGINT that end it within a second.

XLA's compile is C++ that keeps the thread calling it until it returns
(minutes for a model of a few hundred layers), and Python runs signal
handlers on the main thread only, between bytecodes: a compile on the main
thread ignored SIGTERM for as long as it ran. `run` does the work off the
main thread (`train.jobs.entry.off_main_thread`), whose wait the launcher's
handlers can interrupt, and checks the step in progress against its
budget. Either end is an exception that the launcher
(`train.jobs.entry.run_job`) reports in one line before `exit_now`, which does
not wait for the thread.
"""

from collections.abc import Callable
import threading
import time
from typing import TypeVar

from train.jobs import entry
from train.errors import Interrupted, RunError

# The budget of one step (building the job's programs; tracing and
# compiling one of them), in seconds. The largest program this repository
# compiles, Llama 8B's train step for v5e:16x16 (`configs/lm.py:size=8b`),
# took 415 s of CPU time to build and compile on a 2-core host (libtpu
# 0.0.42); 1200 s is about three times that, room for a host shared with
# other work. Each step prints a line as it begins and SIGTERM/SIGINT end
# it at any time: the budget is for runs nobody watches.
DEFAULT_TIMEOUT_S = 1200
# The most `--compile_timeout` may ask for: a day, as the launchers' other
# waits (`train.jobs.multihost.MAX_WAIT_SECONDS`).
MAX_TIMEOUT_S = 86400
# How often the main thread looks at the step's clock: a signal handler
# runs at once anyway (the wait is interruptible).
_POLL_S = 0.2

_T = TypeVar('_T')


class CompileTimeout(RunError):
  """A step of the compile ran past its budget (exit status 1, as a program
  that does not compile)."""
  exit_code = 1

  def __init__(self, what: str, target: str, timeout_s: float):
    """`what`: the step, e.g. 'compiling train_step'."""
    super().__init__(
        f'{what} for {target} exceeded --compile_timeout={timeout_s:g} s; '
        'the compile stopped and nothing was written. Raise '
        '--compile_timeout, or make the model smaller (fewer layers compile '
        'faster)')


class CompileInterrupted(Interrupted):
  """SIGTERM or SIGINT during a compile: exit status 128 + its number."""

  def __init__(self, signum: int, signal_name: str, what: str, target: str,
               seconds: float):
    super().__init__(signum, signal_name)
    self.args = (
        f'stopped by {signal_name} while {what} for {target} ({seconds:.0f} '
        's in); the compile stopped and nothing was written (a compile has '
        'nothing to resume: run the command again to start it over).',)


class Progress:
  """The step the worker is in, and when it began (read by the waiter)."""

  def __init__(self, what: str):
    self._lock = threading.Lock()
    self.step(what)

  def step(self, what: str) -> None:
    """Starts step `what` ('compiling train_step'): its budget starts now.
    Printed (stdout), so that a long compile says what it is doing."""
    with self._lock:
      self._what = what
      self._since = time.monotonic()
    print(f'{what} ...', flush=True)

  def current(self) -> tuple[str, float]:
    """(the step, seconds since it began)."""
    with self._lock:
      return self._what, time.monotonic() - self._since


def check_timeout(timeout_s: float) -> None:
  """ValueError naming the valid range unless 1 <= timeout_s <= a day."""
  if not 1 <= timeout_s <= MAX_TIMEOUT_S:
    raise ValueError(f'must be in [1, {MAX_TIMEOUT_S}] seconds')


def run(work: Callable[[Progress], _T], target: str, timeout_s: float,
        first_step: str) -> _T:
  """`work(progress)` in a daemon thread; returns its result or raises its
  exception. Call on the main thread, under the launcher's signal handlers.

  Args:
    work: the compile; it calls `progress.step(what)` as each step begins.
    target: the target's name, for the messages.
    timeout_s: each step's budget.
    first_step: what `work` does before its first `step` ('building the
      programs').

  Raises:
    CompileTimeout: a step ran past `timeout_s`.
    CompileInterrupted: SIGTERM or SIGINT arrived.
  """
  progress = Progress(first_step)

  def check() -> None:
    what, seconds = progress.current()
    if seconds > timeout_s:
      raise CompileTimeout(what, target, timeout_s)

  try:
    return entry.off_main_thread(lambda: work(progress), check,
                                 name='compile', poll_s=_POLL_S)
  except Interrupted as e:
    what, seconds = progress.current()
    raise CompileInterrupted(e.signum, e.signal_name, what, target,
                             seconds) from None
