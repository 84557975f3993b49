"""The control plane of a multi-process RL job: jax.distributed's key-value store.

Rollout and learner processes of one `launch.rl --multihost` job share
nothing but the coordination service that `jax.distributed.initialize`
starts. Everything they tell each other besides arrays goes through its
key-value store, under one prefix per job: the learner's start version,
the plans of batches, weight requests and their answers, the learner's
next batch, the transfers' log and acknowledgements, stop requests and
the end of the run. No global collective is used (`process_allgather`,
`sync_global_devices` and `broadcast_one_to_all` hang when only one
group calls them).

Every wait has a timeout; one that runs out raises `ControlTimeout`, one
line naming what was waited for. Each process also beats a heart here
(`Liveness`): a process that stops beating for `dead_after` seconds is
named, with its role, by the others before jax.distributed's own, slower
detection aborts them.
"""

import json
import threading
import time
from typing import Any, Callable

from train.errors import RunError
from train.rl import runtime

_POLL_MS = 50


class ControlTimeout(RunError):
  """A wait on another process ran out of time."""
  exit_code = 1

  def __init__(self, what: str, seconds: float):
    super().__init__(f'timed out after {seconds:g} s waiting for {what}')


class ProcessDied(RunError):
  """Another process of the job stopped beating."""
  exit_code = 1

  def __init__(self, process: int, role: str, seconds: float):
    self.process = process
    super().__init__(
        f'process {process} ({role}) stopped responding {seconds:.0f} s ago; '
        'stopping the job. The checkpoints written so far are intact: run '
        'the same command on every process to resume.')


class PeerStopped(RunError):
  """Another process of the job refused or failed: this one ends as that
  one did, with its exit status and a line naming it and its cause."""

  def __init__(self, process: int, role: str, code: int, line: str):
    self.process = process
    self.exit_code = code
    super().__init__(f'process {process} ({role}) stopped the job: {line}')


def exit_code(error: BaseException) -> int:
  """The exit status `train.jobs.entry.run_job` gives `error`, which the job's
  other processes then exit with too."""
  # pylint: disable=g-import-not-at-top
  from train.errors import Interrupted, UsageError
  from train.run.job import WorkdirBusy
  # pylint: enable=g-import-not-at-top
  if isinstance(error, WorkdirBusy):
    return 75
  if isinstance(error, UsageError):
    return 2
  if isinstance(error, Interrupted):
    return 128 + error.signum
  return getattr(error, 'exit_code', 1) if isinstance(error, RunError) else 1


def told(error: BaseException) -> dict[str, Any]:
  """What the other processes are told of `error`: its line and exit
  status (a library's exception by its type, as a traceback would)."""
  # pylint: disable-next=g-import-not-at-top
  from train.errors import Interrupted, UsageError
  plain = isinstance(error, (RunError, UsageError, Interrupted))
  line = str(error) if plain else f'{type(error).__name__}: {error}'
  return {'line': line.strip().splitlines()[0] if line.strip() else line,
          'code': exit_code(error)}


def client():
  """jax.distributed's client of the coordination service (None without it)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


class Channel:
  """Keys of one job in the coordination service's key-value store.

  Values are JSON. `get` blocks (polling `stopped` between short waits) up
  to `timeout` seconds; `try_get` does not block.
  """

  def __init__(self, kv, prefix: str, timeout: float,
               stopped: Callable[[], bool] = lambda: False):
    self._kv = kv
    self._prefix = prefix.rstrip('/') + '/'
    self.timeout = timeout
    self._stopped = stopped

  def _key(self, key: str) -> str:
    return self._prefix + key

  def set(self, key: str, value: Any) -> None:
    self._kv.key_value_set(self._key(key), json.dumps(value),
                           allow_overwrite=True)

  def try_get(self, key: str) -> Any | None:
    try:
      text = self._kv.key_value_try_get(self._key(key))
    except Exception:  # pylint: disable=broad-except
      return None  # NOT_FOUND (the client raises for a missing key).
    return json.loads(text)

  def get(self, key: str, timeout: float | None = None,
          what: str | None = None) -> Any:
    """The value of `key`, waiting for it.

    Raises:
      ControlTimeout: it did not appear within `timeout` (default: the
        channel's) seconds.
      Stopped: `stopped()` became true while waiting (a stop or the run's
        end).
    """
    timeout = self.timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
      value = self.try_get(key)
      if value is not None:
        return value
      if self._stopped():
        raise runtime.Stopped()
      if time.monotonic() > deadline:
        raise ControlTimeout(what or f'{key!r}', timeout)
      time.sleep(_POLL_MS / 1000)

  def increment(self, key: str, by: int = 1) -> int:
    """Atomically adds `by` to the counter `key`; returns the new value."""
    return int(self._kv.key_value_increment(self._key(key), by))

  def keys(self, prefix: str = '') -> list[str]:
    """The keys under `prefix` (relative to the channel's)."""
    try:
      entries = self._kv.key_value_dir_get(self._key(prefix))
    except Exception:  # pylint: disable=broad-except
      return []
    return sorted(k[len(self._prefix):] for k, _ in entries)

  def delete(self, key: str) -> None:
    try:
      self._kv.key_value_delete(self._key(key))
    except Exception:  # pylint: disable=broad-except
      pass


class Liveness:
  """A heartbeat per process in the channel, and a watch on the others'.

  `check()` raises `ProcessDied` for the first process (in `roles`) whose
  beat is older than `dead_after` seconds; a process that has not beaten
  yet counts from when the watch started.
  """

  def __init__(self, channel: Channel, process: int, roles: dict[int, str],
               dead_after: float, every: float = 1.0):
    self._channel = channel
    self._process = process
    self._roles = roles
    self._dead_after = dead_after
    self._every = every
    self._seen: dict[int, tuple[int, float]] = {}
    self._started = time.monotonic()
    self._stop = threading.Event()
    self._beats = 0
    self._thread = threading.Thread(target=self._beat, daemon=True,
                                    name='heartbeat')

  @property
  def dead_after(self) -> float:
    return self._dead_after

  def start(self) -> None:
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.is_set():
      self._beats += 1
      try:
        self._channel.set(f'alive/{self._process}', self._beats)
      except Exception:  # pylint: disable=broad-except
        return  # The service is gone: the watch of the others reports it.
      self._stop.wait(self._every)

  def check(self) -> None:
    now = time.monotonic()
    for p, role in self._roles.items():
      if p == self._process:
        continue
      beat = self._channel.try_get(f'alive/{p}')
      last, since = self._seen.get(p, (None, self._started))
      if beat is not None and beat != last:
        self._seen[p] = (beat, now)
        continue
      if now - since > self._dead_after:
        raise ProcessDied(p, role, now - since)

  def stop(self) -> None:
    self._stop.set()
