"""The asynchronous runtime: versioned snapshots, a bounded buffer, actor threads.

One JAX program. Its devices are split into a rollout mesh and a learner
mesh (`split_devices`); actor threads generate on the rollout mesh while
the learner (the caller's thread) trains on the learner mesh, and each
new policy version reaches the actors by resharding its weights onto the
rollout mesh (`jax.device_put`), published here with its version.

Batches are numbered k = 0, 1, 2, ... and the learner consumes them in
that order, one version per batch: batch k is trained by the update that
makes version k + 1, so its staleness is k - v when version v generated
it. The global bound s (`max_staleness`) admits batch k for generation
only with a version v >= k - s (AReaL's rule, per batch): s = 0 is
synchronous GRPO (batch k waits for version k), on the same code. A
scheduler (`train.rl.scheduler`, e.g. GAS's per-difficulty budgets) may
plan each batch's oldest version instead (`Actors(plan=...)`), within s. An
actor takes the newest version available; in `deterministic` mode it
takes exactly version max(0, k - s), so the whole run is a function of
the seed whatever the threads' timing (the snapshots of the last s + 1
versions are kept for that). What batch k holds (its prompts, its
sampling key) is a function of k alone.

Failure: an actor that raises gives its batch back (another takes it)
and is restarted, at most `max_actor_restarts` times over the run; one
more failure stops the run with `ActorFailed`, one line naming the
error. `stop()` wakes every wait; `join` bounds the shutdown.
"""

import dataclasses
import heapq
import threading
import time
import traceback
from typing import Any, Callable, Protocol

from absl import logging
import jax
import numpy as np
from jax.sharding import Mesh

from train.training import sharding as sharding_lib
from train.errors import ConfigError, RunError

_POLL = 0.05  # Seconds between checks of the stop flag in every wait.


class ActorFailed(RunError):
  """Actors failed more often than the restart budget allows."""
  exit_code = 1

  def __init__(self, failures: int, last: str):
    super().__init__(f'actors failed {failures} times (more than '
                     f'max_actor_restarts allows); last: {last}')


class Stopped(Exception):
  """A wait was ended by `stop()`."""


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
  """Attributes:
    max_staleness: s, the most versions a trained batch may lag (0: sync).
    num_actors: generation threads.
    deterministic: each batch k uses exactly version max(0, k - s).
    max_actor_restarts: actor failures tolerated over the run.
    buffer_capacity: finished batches held at most (besides the one the
      learner waits for); None: s + num_actors.
  """
  max_staleness: int = 0
  num_actors: int = 1
  deterministic: bool = False
  max_actor_restarts: int = 3
  buffer_capacity: int | None = None

  def check(self, field: str = 'runtime') -> None:
    if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
      raise ConfigError(f'{field}.max_staleness', self.max_staleness,
                        'must be an integer >= 0 (0: synchronous)')
    if not isinstance(self.num_actors, int) or self.num_actors < 1:
      raise ConfigError(f'{field}.num_actors', self.num_actors,
                        'must be an integer >= 1')
    if (not isinstance(self.max_actor_restarts, int)
        or self.max_actor_restarts < 0):
      raise ConfigError(f'{field}.max_actor_restarts',
                        self.max_actor_restarts, 'must be an integer >= 0')
    if self.buffer_capacity is not None and (
        not isinstance(self.buffer_capacity, int) or self.buffer_capacity < 1):
      raise ConfigError(f'{field}.buffer_capacity', self.buffer_capacity,
                        'must be an integer >= 1 (or None)')

  @property
  def capacity(self) -> int:
    return (self.buffer_capacity if self.buffer_capacity is not None
            else self.max_staleness + self.num_actors)


def split_devices(num_rollout: int, devices: list | None = None,
                  learner_axes: tuple[str, ...] = ('data',),
                  learner_shape: tuple[int, ...] = (-1,)
                  ) -> tuple[Mesh, Mesh]:
  """(rollout mesh, learner mesh), disjoint: the first `num_rollout`
  devices, 1-D over axis 'data'; the rest, over `learner_axes` in
  `learner_shape` (errors name config.learner_mesh)."""
  devices = list(jax.devices() if devices is None else devices)
  if not isinstance(num_rollout, int) or not 1 <= num_rollout < len(devices):
    raise ConfigError('rollout_devices', num_rollout,
                      f'must be in 1..{len(devices) - 1} (of {len(devices)} '
                      'devices: the rest train)')
  return (Mesh(np.array(devices[:num_rollout]), ('data',)),
          sharding_lib.make_mesh(learner_shape, learner_axes,
                                 devices[num_rollout:],
                                 field='learner_mesh'))


class Snapshots:
  """Policy versions published by the learner, read by actors."""

  def __init__(self, keep: int):
    self._keep = keep
    self._cond = threading.Condition()
    self._versions: dict[int, Any] = {}
    self._stopped = False

  def publish(self, version: int, params: Any) -> None:
    with self._cond:
      if self._versions and version <= max(self._versions):
        raise ValueError(f'version {version} is not newer than '
                         f'{max(self._versions)}')
      self._versions[version] = params
      for old in sorted(self._versions)[:-self._keep]:
        del self._versions[old]
      self._cond.notify_all()

  @property
  def latest(self) -> int:
    with self._cond:
      return max(self._versions, default=-1)

  def held(self) -> dict[int, Any]:
    with self._cond:
      return dict(self._versions)

  def wait(self, minimum: int, exact: bool) -> tuple[int, Any]:
    """(version, params) with version >= minimum (== if `exact`)."""
    with self._cond:
      while True:
        if self._stopped:
          raise Stopped()
        if self._versions and max(self._versions) >= minimum:
          if exact:
            if minimum not in self._versions:
              raise RuntimeError(f'version {minimum} is no longer held')
            return minimum, self._versions[minimum]
          newest = max(self._versions)
          return newest, self._versions[newest]
        self._cond.wait(_POLL)

  def stop(self) -> None:
    with self._cond:
      self._stopped = True
      self._cond.notify_all()


class Buffer:
  """Finished batches by number; the learner takes them in order."""

  def __init__(self, capacity: int, next_needed: int = 0):
    self._capacity = capacity
    self._cond = threading.Condition()
    self._items: dict[int, Any] = {}
    self._next = next_needed
    self._stopped = False
    self.peak = 0  # The most batches held at once.

  def put(self, k: int, item: Any) -> None:
    """Blocks while full, unless k is the batch the learner waits for."""
    with self._cond:
      while len(self._items) >= self._capacity and k != self._next:
        if self._stopped:
          raise Stopped()
        self._cond.wait(_POLL)
      if self._stopped:
        raise Stopped()
      self._items[k] = item
      self.peak = max(self.peak, len(self._items))
      self._cond.notify_all()

  def deliver(self, k: int, item: Any) -> None:
    """Adds batch k without waiting: for batches that other processes
    generated, which bound how far ahead they run themselves."""
    with self._cond:
      self._items[k] = item
      self.peak = max(self.peak, len(self._items))
      self._cond.notify_all()

  def take(self, k: int, poll: Callable[[], None] = lambda: None) -> Any:
    """Batch k, waiting for it; `poll` runs between waits (and may raise)."""
    with self._cond:
      self._next = k
      self._cond.notify_all()
      while k not in self._items:
        if self._stopped:
          raise Stopped()
        self._cond.wait(_POLL)
        self._cond.release()
        try:
          poll()
        finally:
          self._cond.acquire()
      self._next = k + 1
      item = self._items.pop(k)
      self._cond.notify_all()
      return item

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)

  def stop(self) -> None:
    with self._cond:
      self._stopped = True
      self._cond.notify_all()


# (k, version, params) -> the batch's item (its rollout).
Generate = Callable[[int, int, Any], Any]
# (k, latest published version) -> the oldest version batch k may use.
Plan = Callable[[int, int], int]


class Generation(Protocol):
  """Where the learner's batches come from and where its weights go.

  Batches arrive in the learner's `Buffer`; the weights it publishes in
  its `Snapshots` reach the generators. Implemented by `Actors` (threads
  of this process) and `train.rl.processes.LearnerServices` (rollout
  processes of a job), so that the learner runs the same whichever it
  has. It calls `start` once, `advance(k)` before it waits for batch k,
  `check` while it waits, then `stop` and `join`.
  """

  def start(self) -> None:
    """Starts generating from the learner's current version."""

  def advance(self, k: int) -> None:
    """The learner now waits for batch k."""

  def check(self) -> None:
    """Raises what stopped the generators (or a stop they asked for)."""

  def stop(self) -> None:
    """Ends every wait."""

  def join(self, timeout: float) -> None:
    """Waits up to `timeout` s for the generators to end."""

  @property
  def failures(self) -> int:
    """Generator failures so far (restarted within their budget)."""


class Actors:
  """Actor threads generating batches start, start + 1, ... into `buffer`."""

  def __init__(self, generate: Generate, snapshots: Snapshots,
               buffer: Buffer, settings: RuntimeSettings, start: int = 0,
               plan: Plan | None = None,
               claim: Callable[[], int] | None = None):
    """`plan` (a scheduler's dispatch; called once per batch claimed, in
    claim order) defaults to the global bound: max(0, k - s). `claim`
    gives the next new batch number (default: start, start + 1, ... in
    this process; another process's counter when several generate)."""
    self._claim_new = claim
    self._generate = generate
    self._plan = plan or (
        lambda k, latest: max(0, k - settings.max_staleness))
    self._snapshots = snapshots
    self._buffer = buffer
    self._settings = settings
    self._lock = threading.Lock()
    self._next = start
    self._returned: list[int] = []  # Batches of failed actors (a heap).
    self._threads: dict[int, threading.Thread] = {}
    self._failures: list[str] = []
    self._stop = threading.Event()
    self._spawned = 0

  def start(self) -> None:
    for _ in range(self._settings.num_actors):
      self._spawn()

  def advance(self, k: int) -> None:
    """Nothing to do: the actors run ahead within the buffer's room."""
    del k

  def _spawn(self) -> None:
    actor = self._spawned
    self._spawned += 1
    thread = threading.Thread(target=self._run, args=(actor,),
                              name=f'actor-{actor}', daemon=True)
    self._threads[actor] = thread
    thread.start()

  def _claim(self) -> int:
    with self._lock:
      if self._returned:
        return heapq.heappop(self._returned)
      if self._claim_new is None:
        k = self._next
        self._next += 1
        return k
    return self._claim_new()  # It may wait: outside the lock.

  def _run(self, actor: int) -> None:
    k = None
    try:
      while not self._stop.is_set():
        k = self._claim()
        minimum = self._plan(k, self._snapshots.latest)
        version, params = self._snapshots.wait(minimum,
                                               self._settings.deterministic)
        item = self._generate(k, version, params)
        self._buffer.put(k, item)
        k = None
    except Stopped:
      pass
    except Exception as e:  # pylint: disable=broad-except
      line = f'{type(e).__name__}: {e}'
      logging.warning('actor %d failed on batch %s: %s\n%s', actor, k, line,
                      traceback.format_exc())
      with self._lock:
        self._failures.append(line)
        if k is not None:
          heapq.heappush(self._returned, k)

  def check(self) -> None:
    """Restarts dead actors within the budget; raises ActorFailed beyond it."""
    if self._stop.is_set():
      return
    with self._lock:
      failures = len(self._failures)
      last = self._failures[-1] if self._failures else ''
    if failures > self._settings.max_actor_restarts:
      raise ActorFailed(failures, last)
    for actor, thread in list(self._threads.items()):
      if not thread.is_alive():
        del self._threads[actor]
        logging.info('restarting a failed actor (%d of %d restarts used)',
                     failures, self._settings.max_actor_restarts)
        self._spawn()

  @property
  def failures(self) -> int:
    with self._lock:
      return len(self._failures)

  def stop(self) -> None:
    self._stop.set()
    self._snapshots.stop()
    self._buffer.stop()

  def join(self, timeout: float) -> None:
    """Waits up to `timeout` seconds in all; RuntimeError if one still runs
    (a generation call cannot be interrupted: it ends its batch first)."""
    deadline = time.monotonic() + timeout
    for thread in list(self._threads.values()):
      thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in self._threads.values() if t.is_alive()]
    if alive:
      raise RuntimeError(f'actors {alive} did not stop within {timeout:g} s')
