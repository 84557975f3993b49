"""Stopping a run cleanly: SIGTERM on one host, JAX's sync point on several.

A loop asks `requested(step)` after each step and, when it says so, saves
a checkpoint at that step and raises `errors.Preempted`. With one process
a SIGTERM handler records the signal (the default would kill the run
before it saves). With several, jax.distributed's preemption notifier owns
SIGTERM and every process must stop at one agreed step, so the question goes
to `multihost_utils.reached_preemption_sync_point`, which all processes
answer alike.
"""

import contextlib
import signal
import threading
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils


class SigtermFlag:
  """Records SIGTERM instead of dying, so the loop can save first."""

  def __init__(self):
    self.event = threading.Event()

  @contextlib.contextmanager
  def installed(self) -> Iterator['SigtermFlag']:
    """Handles SIGTERM inside the block (main thread, one process only)."""
    if (threading.current_thread() is not threading.main_thread()
        or jax.process_count() > 1):
      # Signals can only be handled on the main thread. With several
      # processes, jax.distributed's preemption notifier owns SIGTERM (a
      # Python handler would take it away) and `requested` asks it.
      yield self
      return
    previous = signal.signal(signal.SIGTERM, lambda *_: self.event.set())
    try:
      yield self
    finally:
      signal.signal(signal.SIGTERM, previous)

  def requested(self, step: int) -> bool:
    """Whether to stop after `step` (every process gets one answer)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.event.is_set()
