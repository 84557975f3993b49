"""Stopping a run cleanly: SIGTERM or SIGINT on one host, JAX's sync point on several.

A loop asks `requested(step)` after each step and, when it says so, saves
a checkpoint at that step and raises `errors.Preempted`. With one process
a handler records SIGTERM or SIGINT (Ctrl-C) (the defaults would kill the
run, or raise KeyboardInterrupt wherever it happens to be, before it
saves). With several, jax.distributed's preemption notifier owns SIGTERM
and every process must stop at one agreed step, so the question goes to
`multihost_utils.reached_preemption_sync_point`, which all processes
answer alike.

Outside the loop (start-up, compilation, the final evaluation) there is
no new state to save: `raise_on_signals` turns either signal into
`errors.Interrupted`, which the launcher reports in one line (and which
`raise_if_interrupted` raises again where its first raise was swallowed).
Once a stop was requested, later signals are ignored so that the save
completes.
"""

import contextlib
import signal
import threading
from collections.abc import Iterator

from jax.experimental import multihost_utils

from train.run import process_group
from train.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _handling(handler, *, with_jax_processes: bool) -> Iterator[None]:
  # Signals can only be handled on the main thread. With several processes,
  # jax.distributed's preemption notifier owns SIGTERM (a Python handler
  # would take it away) and `requested` asks it; `with_jax_processes` is
  # False where JAX must not be started yet.
  if (threading.current_thread() is not threading.main_thread()
      or (with_jax_processes and process_group.count() > 1)):
    yield
    return
  previous = {s: signal.signal(s, handler) for s in SIGNALS}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


# Set once a stop was requested: the run is saving and will exit, and a
# second signal (Ctrl-C reaches a sweep and its runs, and the sweep then
# terminates them) must not cut that save short.
_STOPPING = threading.Event()


# A signal whose exception was swallowed: raised where the handler runs, it
# lands in whatever Python code is running, which may be a callback that
# drops exceptions (a garbage-collection hook, a logging handler).
_PENDING: list[int] = []


def _raise_interrupted(signum, frame) -> None:
  del frame
  if not _STOPPING.is_set():
    _PENDING.append(signum)
    raise Interrupted(signum, signal.Signals(signum).name)


def raise_if_interrupted() -> None:
  """Raises `errors.Interrupted` if a signal arrived under `raise_on_signals`
  and its exception was lost on the way."""
  if _PENDING:
    signum = _PENDING[0]
    raise Interrupted(signum, signal.Signals(signum).name)


def raise_on_signals() -> contextlib.AbstractContextManager[None]:
  """Inside the block, SIGTERM and SIGINT raise `errors.Interrupted`.

  It does not start JAX's backend (device settings may follow it).
  """
  return _handling(_raise_interrupted, with_jax_processes=False)


class StopFlag:
  """Records SIGTERM or SIGINT instead of dying, so the loop can save first."""

  def __init__(self):
    self.event = threading.Event()
    self.signal_name = 'SIGTERM'

  def _record(self, signum, frame) -> None:
    del frame
    if not self.event.is_set():
      self.signal_name = signal.Signals(signum).name
    _STOPPING.set()
    self.event.set()

  def request(self, signal_name: str) -> None:
    """As if `signal_name` ('SIGTERM' or 'SIGINT') had arrived."""
    if not self.event.is_set():
      self.signal_name = signal_name
    _STOPPING.set()
    self.event.set()

  def installed(self) -> contextlib.AbstractContextManager[None]:
    """Handles SIGTERM and SIGINT inside the block (main thread, one process).

    Raises:
      Interrupted: a signal arrived before (under `raise_on_signals`) and
        its exception was lost.
    """
    raise_if_interrupted()
    return _handling(self._record, with_jax_processes=True)

  def requested(self, step: int) -> bool:
    """Whether to stop after `step` (every process gets one answer)."""
    if process_group.count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.event.is_set()
