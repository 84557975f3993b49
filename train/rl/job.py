"""A multi-process RL job's control plane, on each of its processes.

`Job` holds what the processes of one `launch.rl --multihost` job share
(`train.rl.processes`): the key-value channel, the heartbeats, the
transport, and the end of the run the lead learner tells (`done`: ok, an
error's line and code, or a stop, `train.run.stop_protocol`).
"""

import math
import threading
import time
from typing import Any

from absl import logging

from train.rl import control
from train.rl import processes as processes_lib
from train.rl import runtime as runtime_lib
from train.rl import settings as settings_lib
from train.rl import transport as transport_lib


class Job:
  """A multi-process run's control plane: channel, liveness, transport."""

  def __init__(self, config, roles: processes_lib.Roles):
    self.roles = roles
    self.halt = threading.Event()
    # The defaults stand in for values check_config (run under the job,
    # so that a refusal reaches the others) has still to refuse.
    self.timeout = _seconds(config.runtime.get('transfer_timeout'),
                            settings_lib.TRANSFER_TIMEOUT)
    self.channel = processes_lib.channel(self.timeout, self.halt.is_set)
    self.peer_timeout = _seconds(config.runtime.get('peer_timeout'),
                                 settings_lib.PEER_TIMEOUT)
    self._closed = False
    self.liveness = control.Liveness(
        self.channel, roles.process, roles.names,
        dead_after=self.peer_timeout)
    self.liveness.start()
    self.transport = transport_lib.DevicePutTransport(
        self.channel, roles.process, self.timeout)

  def ended(self) -> dict[str, Any] | None:
    """The learner's end of the run (None while it goes on).

    Raises:
      control.PeerStopped: the learner refused or failed (its exit status
        and line).
    """
    done = self.channel.try_get('done')
    if done is not None and 'error' in done:
      raise control.PeerStopped(self.roles.learner, 'learner',
                                done.get('code', 1), done['error'])
    return done

  def wait_admitted(self) -> None:
    """Waits until the learner holds the workdir and found it fit to
    resume: a refusal of it (busy, another kind of run, another config)
    then ends every process before it read or printed anything.

    Raises:
      control.PeerStopped: the learner refused.
      control.ProcessDied: the learner stopped beating.
    """
    while self.channel.try_get('admitted') is None:
      self.ended()
      self.liveness.check()
      if self.halt.wait(0.05):
        raise runtime_lib.Stopped()

  def tell(self, key: str, value: Any) -> None:
    """Sets `key` if the control plane is still there (a failure to tell
    must not hide the error that ends the run)."""
    try:
      self.channel.set(key, value)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('could not tell the other processes %s: %s', key, e)

  def close(self, error: bool = False, dead: int | None = None) -> None:
    """Stops this process's side. Process 0 hosts jax.distributed's
    service, whose end aborts every other process: after an error it waits
    (up to `peer_timeout`) for the others, except a `dead` one, to end
    theirs, so that each reports its own one line."""
    if self._closed:
      return
    self._closed = True
    self.halt.set()
    self.transport.stop()
    self.liveness.stop()
    self.tell(f'exited/{self.roles.process}', 1)
    if self.roles.process != 0 or not error:
      return
    others = [p for p in range(self.roles.num_processes)
              if p not in (0, dead)]
    deadline = time.monotonic() + self.peer_timeout
    while time.monotonic() < deadline and any(
        self.channel.try_get(f'exited/{p}') is None for p in others):
      time.sleep(0.05)
    time.sleep(0.5)  # Their last line is being printed.


def _seconds(value: Any, default: float) -> float:
  """`value` if it is a finite number of seconds > 0, else `default`."""
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
        and 0 < value < math.inf)
  return value if ok else default
