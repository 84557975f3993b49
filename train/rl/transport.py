"""Arrays between the processes of a multi-process RL job: weights and batches.

`Transport` is the interface the runtime uses: `send(kind, meta, arrays,
dst)` hands arrays of this process to process `dst`, which receives them
(on its endpoint device) in a callback; `check()` raises what went wrong.
The default, `DevicePutTransport`, is JAX's cross-process `jax.device_put`
("Transferring data across processes", docs/multi_process.md); GPU and
TPU backends carry it natively, the CPU client through the transfer
server that `jax_cross_host_transfer_socket_address` starts. A transport
over `jax.experimental.transfer` could sit behind the same interface.

Why a log. A cross-process `device_put` has no name: its sender and its
receiver are paired by a transfer key that every process counts up, one
per call, in every process, whether it takes part or not. So every process
must make the same calls in the same order. Here each transfer is an
entry of one log in the control plane (`train.rl.control`), numbered by an
atomic counter; one thread per process walks the log in order and makes
each entry's call: the sender with its arrays, the receiver with
placeholders of their shapes (no local shards), the other processes with
placeholders as well (the call then only counts). A sender's call returns
at once; a receiver's waits only for its sender, which reaches the same
entry since every earlier one returns or waits only on earlier ones. The
sender keeps its arrays until the receiver acknowledges them: they must
stay alive (not donated) until pulled.

Each process sends from and receives onto one endpoint device (its first):
the arrays' shard shapes must be equal on both sides, which a single
device on each side makes true for any mesh the roles use; the receiver
then places them on its own mesh.

A receive that does not complete within `timeout` seconds is reported by
`check()` as `TransferTimeout`, one line naming the entry, its sender and
its receiver.
"""

import abc
import itertools
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from absl import logging
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from train.errors import RunError
from train.rl import control
from train.rl import runtime

# (kind, meta, source process, arrays on this process's endpoint device).
Receiver = Callable[[str, dict, int, list[jax.Array]], None]


class TransferTimeout(RunError):
  """A transfer did not arrive in time."""
  exit_code = 1

  def __init__(self, entry: int, kind: str, src: int, dst: int,
               seconds: float):
    super().__init__(
        f'transfer {entry} ({kind}) from process {src} to process {dst} did '
        f'not complete within {seconds:g} s (runtime.transfer_timeout)')


class TransferFailed(RunError):
  """A transfer raised."""
  exit_code = 1


class Transport(abc.ABC):
  """Arrays from this process to another; see the module docstring."""

  @abc.abstractmethod
  def send(self, kind: str, meta: dict, arrays: Sequence[Any],
           dst: int) -> None:
    """Hands `arrays` (host or device arrays of this process) to process
    `dst`; returns without waiting for it. `meta` (JSON) travels with them."""

  @abc.abstractmethod
  def start(self, receive: Receiver) -> None:
    """Starts delivering what other processes send here to `receive`."""

  @abc.abstractmethod
  def check(self) -> None:
    """Raises `TransferTimeout` or `TransferFailed` if a transfer failed."""

  @abc.abstractmethod
  def stop(self) -> None:
    """Stops delivering; arrays not yet acknowledged are let go."""


def endpoints(devices: Sequence[Any] | None = None) -> dict[int, NamedSharding]:
  """Each process's endpoint: its lowest-numbered device, as a sharding."""
  devices = jax.devices() if devices is None else devices
  first: dict[int, Any] = {}
  for d in sorted(devices, key=lambda d: d.id):
    first.setdefault(d.process_index, d)
  return {p: NamedSharding(Mesh(np.array([d]), ('endpoint',)), P())
          for p, d in first.items()}


class DevicePutTransport(Transport):
  """Cross-process `jax.device_put`, ordered by a log (module docstring)."""

  def __init__(self, channel: control.Channel, process: int,
               timeout: float, devices: Sequence[Any] | None = None):
    self._channel = channel
    self._process = process
    self._timeout = timeout
    self._endpoints = endpoints(devices)
    self._pending: dict[int, list[jax.Array]] = {}
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._failure: BaseException | None = None
    self._busy: tuple[int, str, int, float] | None = None
    self._thread: threading.Thread | None = None
    self._receive: Receiver | None = None
    self.sent = self.received = 0

  def send(self, kind: str, meta: dict, arrays: Sequence[Any],
           dst: int) -> None:
    if dst == self._process or dst not in self._endpoints:
      raise ValueError(f'cannot send to process {dst} from {self._process} '
                       f'(processes: {sorted(self._endpoints)})')
    here = self._endpoints[self._process]
    placed = [jax.device_put(np.asarray(a) if not isinstance(a, jax.Array)
                             else a, here) for a in arrays]
    specs = [[list(a.shape), np.dtype(a.dtype).name] for a in placed]
    n = self._channel.increment('xfer/seq') - 1
    with self._lock:
      self._pending[n] = placed
    self._channel.set(f'xfer/{n}', {'kind': kind, 'meta': meta,
                                    'src': self._process, 'dst': dst,
                                    'specs': specs})

  def start(self, receive: Receiver) -> None:
    self._receive = receive
    self._thread = threading.Thread(target=self._walk, daemon=True,
                                    name='transport')
    self._thread.start()

  def _walk(self) -> None:
    unacked: list[int] = []
    try:
      for n in itertools.count():
        entry = self._next_entry(n, unacked)
        if entry is None:
          return
        self._call(n, entry)
        # The last process past an entry removes it: the store holds only
        # the entries some process has still to walk.
        if self._channel.increment(f'xfer/walked/{n}') == len(
            self._endpoints):
          self._channel.delete(f'xfer/{n}')
          self._channel.delete(f'xfer/walked/{n}')
        if entry['src'] == self._process:
          unacked.append(n)
    except runtime.Stopped:
      return
    except Exception as e:  # pylint: disable=broad-except
      if self._stop.is_set():
        # Stopped with a transfer under way: the job is ending, and a peer
        # that ended first cut it ("SocketServer: Connection closed").
        return
      # `check()` reports it in one line; the traceback (most often the
      # echo of a peer that ended) goes to the log.
      logging.info('transport failed: %s\n%s', e, traceback.format_exc())
      self._failure = e

  def _collect_acks(self, unacked: list[int]) -> None:
    """Lets go of the arrays of acknowledged entries (and their keys)."""
    for m in list(unacked):
      if self._channel.try_get(f'xfer/ack/{m}') is not None:
        with self._lock:
          self._pending.pop(m, None)
        unacked.remove(m)
        self._channel.delete(f'xfer/ack/{m}')

  def _next_entry(self, n: int, unacked: list[int]) -> dict | None:
    while not self._stop.is_set():
      self._collect_acks(unacked)
      entry = self._channel.try_get(f'xfer/{n}')
      if entry is not None:
        return entry
      self._stop.wait(0.01)
    return None

  def _call(self, n: int, entry: dict) -> None:
    src, dst = entry['src'], entry['dst']
    src_sharding, dst_sharding = self._endpoints[src], self._endpoints[dst]
    if src == self._process:
      with self._lock:
        arrays = self._pending[n]
    else:
      arrays = [jax.make_array_from_single_device_arrays(
          tuple(shape), src_sharding, [], dtype=np.dtype(dtype))
                for shape, dtype in entry['specs']]
    if not arrays:
      out = []
    else:
      out = jax.device_put(arrays, [dst_sharding] * len(arrays))
    if src == self._process:
      self.sent += 1
    if dst != self._process:
      return
    self._busy = (n, entry['kind'], src, time.monotonic())
    jax.block_until_ready(out)
    self._busy = None
    self.received += 1
    self._receive(entry['kind'], entry['meta'], src, list(out))
    self._channel.set(f'xfer/ack/{n}', 1)

  def check(self) -> None:
    if self._failure is not None:
      if isinstance(self._failure, RunError):
        raise self._failure
      raise TransferFailed(f'a transfer failed: '
                           f'{type(self._failure).__name__}: '
                           f'{str(self._failure).splitlines()[0]}')
    busy = self._busy
    if busy is not None and time.monotonic() - busy[3] > self._timeout:
      raise TransferTimeout(busy[0], busy[1], busy[2], self._process,
                            self._timeout)

  @property
  def unacknowledged(self) -> int:
    with self._lock:
      return len(self._pending)

  def stop(self) -> None:
    self._stop.set()
