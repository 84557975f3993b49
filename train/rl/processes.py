"""Rollout and learner processes of one multi-controller JAX job.

`launch.rl --multihost` with `config.rollout_processes = R` runs N JAX
processes: processes 0..R-1 generate, each with its own actor threads on a
mesh of its own devices; processes R..N-1 are the learner group. Its
first process, the lead, is the learner of a one-process-learner job: it
holds the workdir (alone: `train.run.process_group`), decides every step,
serves the weights and writes the checkpoints. With more than one learner
process, each step's update runs as one SPMD program over the group's
devices, the policy replicated on each (data parallel); the others follow
the lead step by step (`train.rl.learner_group`).

What crosses between them:

- weights, learner -> rollout: a rollout process asks for a version
  (`req/<p>/<i>`: the oldest it may use, exactly or at least, and the
  versions it holds); the learner's weight server answers with a version
  (`resp/<p>/<i>`) and, unless the process holds it, transfers it
  (`train.rl.transport`). The learner never waits for a rollout process:
  its server thread answers, its transport thread sends and keeps the
  published copy until acknowledged;
- batches, rollout -> learner, by the same transport, with their
  number, version, difficulty and generation time;
- control, in the key-value store (`train.rl.control`): batch numbers are
  claimed from one counter (`claims`), each batch's plan (difficulty,
  oldest version) is decided by the learner's scheduler in batch order
  and published (`plan/<k>`), the learner's next batch (`next`) bounds
  how far ahead rollout processes generate, a stop request (`stop`) from
  any process reaches the learner, which saves and publishes the run's
  end (`done`), and each process beats a heart.

Every wait is bounded (`runtime.transfer_timeout`), and a process that
stops beating is named by the others in one line.
"""

import dataclasses
import itertools
import threading
import time
from typing import Any, Callable

from absl import logging
import jax

from train.errors import ConfigError, RunError
from train.rl import control
from train.rl import runtime
from train.rl import transport as transport_lib
from train.run import stop_protocol

PREFIX = 'geom_rl'


@dataclasses.dataclass(frozen=True)
class Roles:
  """This process's place in the job."""
  process: int
  num_processes: int
  rollout_processes: int

  @property
  def learner(self) -> int:
    """The lead learner process (the first of the learner group)."""
    return self.rollout_processes

  @property
  def learners(self) -> range:
    """The learner group: the lead, then the processes that follow it."""
    return range(self.rollout_processes, self.num_processes)

  @property
  def followers(self) -> range:
    """The learner processes that follow the lead."""
    return range(self.rollout_processes + 1, self.num_processes)

  @property
  def is_learner(self) -> bool:
    return self.process == self.learner

  @property
  def is_follower(self) -> bool:
    return self.process > self.learner

  def role(self, process: int) -> str:
    return 'learner' if process >= self.learner else 'rollout'

  @property
  def names(self) -> dict[int, str]:
    return {p: self.role(p) for p in range(self.num_processes)}


def roles(config) -> Roles | None:
  """This process's roles, or None for a one-process run.

  Raises:
    ConfigError: `rollout_processes` does not fit the job.
  """
  count = jax.process_count()
  r = config.get('rollout_processes')
  check_roles(r, count)
  return None if r is None else Roles(jax.process_index(), count, r)


def check_roles(r: Any, count: int) -> None:
  """ConfigError unless `rollout_processes = r` fits a job of `count`
  processes (known before JAX starts: `--num_processes`)."""
  if r is None:
    if count > 1:
      raise ConfigError('rollout_processes', r,
                        f'required with {count} processes: how many of them '
                        'generate (the others learn)')
    return
  if count == 1:
    raise ConfigError('rollout_processes', r,
                      'needs launch.rl --multihost with several processes '
                      '(unset for one process)')
  check_rollout_processes(r, count)


def check_rollout_processes(r: Any, count: int) -> None:
  """ConfigError unless `r` processes of `count` can generate (at least
  one, and at least one left to learn)."""
  if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r < count:
    raise ConfigError('rollout_processes', r,
                      f'must be in [1, {count - 1}] with {count} processes: '
                      'processes 0..R-1 generate, the others learn')


def learner_group_size(rollout_processes: int | None, count: int) -> int:
  """How many processes the learner spans (1 for a one-process job)."""
  if rollout_processes is None or count <= 1:
    return 1
  return max(1, count - rollout_processes)


def channel(settings_timeout: float, stopped: Callable[[], bool]
            ) -> control.Channel:
  return control.Channel(control.client(), PREFIX, settings_timeout,
                         stopped=stopped)


class _Versions:
  """The versions a rollout process holds, in any arrival order."""

  def __init__(self, keep: int):
    self._keep = keep
    self._cond = threading.Condition()
    self._versions: dict[int, Any] = {}
    self._stopped = False

  def add(self, version: int, params: Any) -> None:
    with self._cond:
      self._versions[version] = params
      for old in sorted(self._versions)[:-self._keep]:
        del self._versions[old]
      self._cond.notify_all()

  def held(self) -> list[int]:
    with self._cond:
      return sorted(self._versions)

  def wait(self, version: int, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    with self._cond:
      while version not in self._versions:
        if self._stopped:
          raise runtime.Stopped()
        if time.monotonic() > deadline:
          raise control.ControlTimeout(f'weights of version {version}',
                                       timeout)
        self._cond.wait(0.05)
      return self._versions[version]

  def stop(self) -> None:
    with self._cond:
      self._stopped = True
      self._cond.notify_all()


class RemoteSnapshots:
  """`runtime.Snapshots` on a rollout process: versions asked of the
  learner (request -> version -> transfer -> acknowledgement)."""

  def __init__(self, channel_: control.Channel, process: int, keep: int,
               timeout: float):
    self._channel = channel_
    self._process = process
    self._timeout = timeout
    self.versions = _Versions(keep)
    self._seq = itertools.count()
    self._lock = threading.Lock()

  @property
  def latest(self) -> int:
    held = self.versions.held()
    return held[-1] if held else -1

  def wait(self, minimum: int, exact: bool) -> tuple[int, Any]:
    with self._lock:
      i = next(self._seq)
    self._channel.set(f'req/{self._process}/{i}',
                      {'min': minimum, 'exact': exact,
                       'held': self.versions.held()})
    # The learner answers once it has the version: no bound on this wait
    # but the stop (a slow learner is not an error).
    v = self._channel.get(f'resp/{self._process}/{i}', timeout=float('inf'))
    # Answered: the learner reads neither again.
    self._channel.delete(f'req/{self._process}/{i}')
    self._channel.delete(f'resp/{self._process}/{i}')
    return v, self.versions.wait(v, self._timeout)

  def stop(self) -> None:
    self.versions.stop()


class RemoteBuffer:
  """`runtime.Buffer` on a rollout process: each finished batch goes to the
  learner (`remote_claim` keeps them within the learner's window)."""

  def __init__(self, send: Callable[[int, Any], None]):
    self._send = send
    self._stopped = threading.Event()

  def put(self, k: int, item: Any) -> None:
    if self._stopped.is_set():
      raise runtime.Stopped()
    self._send(k, item)

  def stop(self) -> None:
    self._stopped.set()


def remote_claim(channel_: control.Channel, start: int, window: int,
                 stopped: Callable[[], bool], total: int
                 ) -> Callable[[], int]:
  """Batch numbers from the job's one counter, each held back until it is
  within `window` of the learner's next batch; none from `total` on (the
  actor then ends)."""

  def claim() -> int:
    k = start + channel_.increment('claims') - 1
    while k >= total:  # Nothing left: wait for the run's end.
      if stopped():
        raise runtime.Stopped()
      time.sleep(0.05)
    while True:
      if stopped():
        raise runtime.Stopped()
      nxt = channel_.try_get('next')
      if k < (start if nxt is None else nxt) + window:
        return k
      time.sleep(0.02)
  return claim


def check_peers(transport: transport_lib.Transport,
                liveness: control.Liveness,
                ended: Callable[[], Any] = lambda: None) -> None:
  """Raises `ProcessDied` for a process that stopped, else what the
  transport found.

  A process killed in the middle of a transfer breaks its connection at
  once, while its heartbeats take `liveness.dead_after` s to go stale: a
  failed transfer waits that long for the watch to name the process.
  `ended()` raises the refusal the learner told before it went (e.g.
  `control.PeerStopped`): the cause, where a broken transfer or a silent
  heartbeat would only be its echo.
  """
  try:
    transport.check()
  except transport_lib.TransferFailed:
    deadline = time.monotonic() + liveness.dead_after + 2
    while time.monotonic() < deadline:
      ended()
      liveness.check()
      time.sleep(0.1)
    raise
  ended()
  liveness.check()


class LearnerServices:
  """The learner's side of the job: plans, weights, batches, liveness (a
  `runtime.Generation`: its batches come from the rollout processes)."""

  def __init__(self, *, roles_: Roles, channel_: control.Channel,
               transport: transport_lib.Transport,
               liveness: control.Liveness, snapshots: runtime.Snapshots,
               plan: Callable[[int, int], Any], window: int,
               leaves: Callable[[Any], list[Any]],
               deliver: Callable[[dict, list[jax.Array]], None],
               request_stop: Callable[[str], None], start: int = 0):
    """`request_stop(signal_name)` stops the run for a signal another
    process received (`train.run.stop_protocol`); `start`: the version
    the learner starts from."""
    self._roles = roles_
    self._channel = channel_
    self._transport = transport
    self._liveness = liveness
    self._snapshots = snapshots
    self._plan = plan
    self._window = window
    self._leaves = leaves
    self._deliver = deliver
    self._stop_watch = stop_protocol.Watch(channel_, request_stop)
    self._start = start
    self._halt = threading.Event()
    self._failure: BaseException | None = None
    self._threads: list[threading.Thread] = []
    self._next = 0

  def start(self) -> None:
    """Publishes the start version and starts serving from it."""
    version = self._start
    self._next = version
    self._channel.set('next', version)
    self._transport.start(self._receive)
    for target, name in ((self._planner, 'planner'),
                         (self._weights, 'weight-server')):
      thread = threading.Thread(target=self._guard(target), daemon=True,
                                name=name, args=(version,))
      thread.start()
      self._threads.append(thread)
    self._channel.set('start', version)

  def _guard(self, fn):
    def run(*args):
      try:
        fn(*args)
      except runtime.Stopped:
        pass
      except Exception as e:  # pylint: disable=broad-except
        logging.exception('learner service failed')
        self._failure = e
    return run

  def _receive(self, kind: str, meta: dict, src: int,
               arrays: list[jax.Array]) -> None:
    if kind != 'batch':
      raise ValueError(f'the learner received {kind!r} from process {src}')
    self._deliver(meta, arrays)

  def advance(self, k: int) -> None:
    """The learner now waits for batch k."""
    self._next = k
    self._channel.set('next', k)

  def _planner(self, start: int) -> None:
    for k in itertools.count(start):
      while k >= self._next + self._window:
        if self._halt.wait(0.02):
          return
      plan = self._plan(k, self._snapshots.latest)
      self._channel.set(f'plan/{k}', [plan.difficulty, plan.min_version])

  def _weights(self, start: int) -> None:
    del start
    seq = {p: 0 for p in range(self._roles.rollout_processes)}
    # Every open request, answered as soon as its version exists: one that
    # waits for an unpublished version must not hold back a later one of
    # the same process (in deterministic mode the batch the learner needs
    # next may be behind it).
    waiting: dict[tuple[int, int], dict] = {}
    while not self._halt.is_set():
      busy = False
      for p in seq:
        while (req := self._channel.try_get(f'req/{p}/{seq[p]}')) is not None:
          waiting[p, seq[p]] = req
          seq[p] += 1
      for (p, i), req in sorted(waiting.items()):
        held = self._snapshots.held()
        newest = max(held, default=-1)
        v = req['min'] if req['exact'] else newest
        if v not in held or v < req['min']:
          continue  # Not published yet: looked at again next round.
        if v not in req['held']:
          self._transport.send('weights', {'version': v},
                               self._leaves(held[v]), p)
        self._channel.set(f'resp/{p}/{i}', v)
        del waiting[p, i]
        busy = True
      if not busy:
        self._halt.wait(0.01)

  def check(self) -> None:
    """Raises what stopped the job's other side; forwards a stop request."""
    if self._failure is not None:
      raise self._failure
    check_peers(self._transport, self._liveness)
    for p in range(self._roles.num_processes):
      failed = (None if p == self._roles.learner
                else self._channel.try_get(f'failed/{p}'))
      if failed is not None:
        raise RolloutFailed(p, failed['line'], self._roles.role(p),
                            failed['code'])
    self._stop_watch.poll()

  def stop(self) -> None:
    self._halt.set()
    self._transport.stop()

  def join(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in self._threads:
      thread.join(max(0.0, deadline - time.monotonic()))

  @property
  def failures(self) -> int:
    """Actor failures on this process (the rollout processes count theirs)."""
    return 0


class RolloutFailed(RunError):
  """A rollout (or following learner) process stopped with an error; the
  learner ends with its exit status `code`."""
  exit_code = 1

  def __init__(self, process: int, line: str, role: str = 'rollout',
               code: int = 1):
    self.exit_code = code
    super().__init__(f'{role} process {process} stopped: {line}')
