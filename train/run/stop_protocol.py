"""Stopping a run that one process of a job holds, on a signal to any of them.

The learner of a multi-process RL job holds the run alone
(`train.run.process_group.alone`); the job's other processes (rollout
processes, learners that follow it) hold nothing to save. A SIGTERM or
SIGINT to any process stops the whole job at one step, saved:

- Every other process records its signal under `Follower.installed()`
  (its own handler: jax.distributed's preemption notifier, which owns
  SIGTERM in a job of several processes, is asked only by a run that
  spans the job) and `Follower.forward()` tells it to the holder once,
  under `STOP` in the job's key-value store.
- The holder's `Watch.poll()` turns a told stop into its own
  (`resumable.Run.request_stop`): it saves at the end of the step and
  raises `Preempted`, as on a signal of its own, and `ended_by(error)`
  is what it tells the others of its end.
- Every other process learns that end and raises the same `Preempted`
  (`raise_if_stopped`): each process exits as the holder does, one line.

Before its loop, a process has nothing to stop: `before_loop()` turns
either signal into `errors.Interrupted` (one line, exit 128 + signal).
"""

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from train.errors import Preempted
from train.run import preemption
from train.run import process_group

# The key a stop is told under (its value: the signal's name).
STOP = 'stop'


class KeyValue(Protocol):
  """The job's key-value store (e.g. jax.distributed's, under a prefix)."""

  def set(self, key: str, value: Any) -> None:
    ...

  def try_get(self, key: str) -> Any | None:
    ...


def before_loop() -> contextlib.AbstractContextManager[None]:
  """Inside the block, SIGTERM and SIGINT raise `errors.Interrupted`."""
  return preemption.raise_on_signals()


class Follower:
  """A process that does not hold the run: its signals go to the holder."""

  def __init__(self, kv: KeyValue):
    self._kv = kv
    self._flag = preemption.StopFlag()
    self._forwarded = False

  @contextlib.contextmanager
  def installed(self) -> Iterator[None]:
    """Records SIGTERM and SIGINT inside the block (`forward` tells them)."""
    with process_group.alone(), self._flag.installed():
      yield

  def forward(self) -> None:
    """Tells the holder of a signal this process received (once)."""
    if self._flag.event.is_set() and not self._forwarded:
      self._kv.set(STOP, self._flag.signal_name)
      self._forwarded = True


class Watch:
  """On the holder: a stop another process told becomes the run's own."""

  def __init__(self, kv: KeyValue, request_stop):
    """`request_stop(signal_name)`: e.g. `resumable.Run.request_stop`."""
    self._kv = kv
    self._request_stop = request_stop
    self._seen = False

  def poll(self) -> None:
    if self._seen:
      return
    signal_name = self._kv.try_get(STOP)
    if signal_name is not None:
      self._seen = True
      self._request_stop(signal_name)


def is_stop(error: BaseException) -> bool:
  """Whether `error` ends a run saved, for a signal (`Preempted`): told
  as the run's end (`ended_by`), never as a failure."""
  return isinstance(error, Preempted)


def ended_by(error: Preempted) -> dict[str, Any]:
  """What the holder tells the others of a run it stopped and saved."""
  return {'stop': error.signal_name, 'step': error.step}


def raise_if_stopped(end: Mapping[str, Any]) -> None:
  """Raises the holder's `Preempted` if `end` (what it told) says it
  stopped for a signal."""
  if 'stop' in end:
    raise Preempted(end['step'], end['stop'])
