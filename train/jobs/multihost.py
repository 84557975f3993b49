"""The `--multihost` flags of the launchers that run one job over several
processes (`launch.train`, `launch.rl`), and `jax.distributed`'s start.

`--multihost` calls `jax.distributed.initialize()`, which finds the
coordinator by itself on Cloud TPU; elsewhere pass `--coordinator_address`,
`--num_processes` and `--process_id`. On CPU hosts the processes exchange
collectives through gloo, and arrays between processes (`launch.rl`'s
weights and batches) through the transfer server at `--transfer_address`
(default: this host's address, port = the coordinator's + 1 + process id).

Before anything starts, the flags are checked (`check_flags`: one line,
exit 2). The start itself waits for every process at most
`--multihost_start_timeout` seconds, then ends in one line naming the
processes waited for (exit 1); SIGTERM and SIGINT end the wait at once
(128 + the signal's number); a coordinator port that is taken on process
0's host is a usage error (2).
"""

from collections.abc import Callable
import errno
import math
import socket
import time
from typing import NoReturn

from absl import flags
from absl import logging

from train.jobs import entry
from train.errors import RunError, UsageError

MULTIHOST = flags.DEFINE_bool(
    'multihost', False, 'Call jax.distributed.initialize() before training.')
COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0 (multihost only).')
NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, 'Number of processes (multihost only).')
PROCESS_ID = flags.DEFINE_integer(
    'process_id', None, 'This process (multihost only).')
HEARTBEAT = flags.DEFINE_integer(
    'heartbeat_timeout_seconds', 100,
    'Multihost: a process silent this long is declared dead and the others '
    'stop with an error instead of waiting for it.')
TRANSFER_ADDRESS = flags.DEFINE_string(
    'transfer_address', None,
    'Multihost on CPU: host:port of this process\'s transfer server for '
    'arrays sent between processes (default: this host, the coordinator\'s '
    'port + 1 + process id).')
START_TIMEOUT = flags.DEFINE_float(
    'multihost_start_timeout', 60.0,
    'Multihost: seconds to wait for every process to join jax.distributed; '
    'then the process stops in one line naming the processes it waited '
    'for.')

# A typo's billion processes would size jax.distributed's and the job's
# per-process tables; the largest TPU pods and GPU clusters JAX runs on
# have a few thousand hosts.
MAX_PROCESSES = 65536
# The longest start or heartbeat wait a flag may ask for: a day.
MAX_WAIT_SECONDS = 86400
# jax.distributed's own start deadline lies this far past ours: when it
# runs out, jax aborts the process (a C++ check failure and a stack dump),
# so ours must come first, also on a loaded machine.
_JAX_START_MARGIN_S = 60


class StartTimeout(RunError):
  """Not every process joined jax.distributed in time."""
  exit_code = 1


def _check_address(flag: str, address: str) -> tuple[str, int]:
  """(host, port) of a `host:port` flag value, or UsageError."""
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise UsageError(flag, address, 'must be host:port with a port in '
                     '[1, 65535], e.g. 127.0.0.1:8476')
  return host.strip('[]'), int(port)


def check_flags() -> None:
  """Checks the multi-process flags, before anything starts or is written.

  Raises:
    UsageError: one names the flag, its value and the valid range.
  """
  n, p = NUM_PROCESSES.value, PROCESS_ID.value
  if n is not None and not 1 <= n <= MAX_PROCESSES:
    raise UsageError('--num_processes', n,
                     f'must be in [1, {MAX_PROCESSES}]')
  if p is not None and (p < 0 or (n is not None and p >= n)):
    top = '' if n is None else f', {n - 1}'
    raise UsageError('--process_id', p,
                     f'must be in [0{top}] (--num_processes={n}: processes '
                     'are numbered from 0)')
  for flag, address in (('--coordinator_address', COORDINATOR.value),
                        ('--transfer_address', TRANSFER_ADDRESS.value)):
    if address is not None:
      _check_address(flag, address)
  for flag, value in (('--heartbeat_timeout_seconds', HEARTBEAT.value),
                      ('--multihost_start_timeout', START_TIMEOUT.value)):
    if not 1 <= value <= MAX_WAIT_SECONDS:
      raise UsageError(flag, value,
                       f'must be in [1, {MAX_WAIT_SECONDS}] seconds')


def _transfer_address() -> str | None:
  if TRANSFER_ADDRESS.value:
    return TRANSFER_ADDRESS.value
  if not COORDINATOR.value or PROCESS_ID.value is None:
    return None
  host, port = COORDINATOR.value.rsplit(':', 1)
  if host not in ('127.0.0.1', 'localhost'):
    host = socket.gethostbyname(socket.gethostname())
  return f'{host}:{int(port) + 1 + PROCESS_ID.value}'


def _check_port_free(address: str) -> None:
  """UsageError if process 0 cannot serve on `address`'s port: bound by
  another program, jax.distributed fails with a traceback and a log line
  of its RPC library."""
  _, port = _check_address('--coordinator_address', address)
  # jax.distributed's coordinator listens on every address ([::]:port).
  family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
  with socket.socket(family) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(('::' if family == socket.AF_INET6 else '', port))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # No IPv6 here, say: jax.distributed says what it finds.
      raise UsageError(
          '--coordinator_address', address,
          f'port {port} is in use on this host (process 0 serves the job '
          'there); pick a free port for every process of the job') from None


def _coordinator_listens(address: str) -> bool:
  host, port = _check_address('--coordinator_address', address)
  try:
    with socket.create_connection((host, port), timeout=1):
      return True
  except OSError:
    return False


def _waited_for(timeout: float) -> str:
  """What a start that ran out of time waited for, in words."""
  n, p, address = NUM_PROCESSES.value, PROCESS_ID.value, COORDINATOR.value
  hint = ('; start every process of the job (with the same '
          '--num_processes), or raise --multihost_start_timeout')
  if n is None or p is None or address is None:
    return (f'jax.distributed did not start within {timeout:g} s (cluster '
            f'detected by JAX; coordinator {address or "?"}){hint}')
  peers = ', '.join(str(i) for i in range(n) if i != p)
  if p != 0 and not _coordinator_listens(address):
    return (f'process {p} of {n}: the coordinator {address} (process 0) did '
            f'not answer within {timeout:g} s{hint}')
  who = (f'peer {peers} did not join' if n == 2
         else f'peers {peers} did not all join')
  return (f'process {p} of {n}: {who} within {timeout:g} s (coordinator '
          f'{address}){hint}')


def _start_error(error: BaseException) -> BaseException:
  """jax.distributed's refusal to start, as one line."""
  text = str(error).strip().splitlines()
  first = text[0] if text else type(error).__name__
  if 'Failed to start RPC server' in first and COORDINATOR.value:
    return UsageError('--coordinator_address', COORDINATOR.value,
                      'process 0 cannot serve there (port in use, or not an '
                      'address of this host)')
  if isinstance(error, (ValueError, TypeError)):
    # jax's own checks of its arguments: off Cloud TPU, Slurm or MPI the
    # three flags are needed.
    return UsageError('--multihost', True,
                      f'jax.distributed cannot start: {first}; pass '
                      '--coordinator_address, --num_processes and '
                      '--process_id')
  return RunError(f'jax.distributed did not start: '
                  f'{type(error).__name__}: {first}')


def wait_for_start(start: Callable[[], None], timeout: float,
                   waited_for: Callable[[float], str]) -> None:
  """Runs `start` off the main thread (`train.jobs.entry.off_main_thread`:
  jax.distributed's start blocks in C++, which would hold SIGTERM and
  SIGINT until its own deadline) and waits for it at most `timeout` s.

  Raises:
    StartTimeout: `start` did not return within `timeout` s (the message
      is `waited_for(timeout)`).
    UsageError, RunError: `start` raised (`_start_error`).
  """
  deadline = time.monotonic() + timeout

  def check() -> None:
    if time.monotonic() > deadline:
      raise StartTimeout(waited_for(timeout))

  try:
    entry.off_main_thread(start, check, name='jax-distributed-start')
  except StartTimeout:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise _start_error(e) from e


def initialize(collectives: bool = True) -> None:
  """Starts jax.distributed if `--multihost`; before JAX's backend starts.

  `collectives`: programs span processes (the CPU client then runs every
  collective through gloo, also those within one process, which sums in
  another order). A job whose programs each run within one process (RL's
  rollout and learner processes) passes False, so that its sums are
  those of a one-process run, bit for bit.

  Raises:
    UsageError: a flag is wrong (`check_flags`), or process 0's
      coordinator port is taken.
    StartTimeout: not every process joined within
      `--multihost_start_timeout` s.
    errors.Interrupted: SIGTERM or SIGINT arrived while waiting (under
      `train.jobs.entry.run_job`).
  """
  check_flags()
  if not MULTIHOST.value:
    return
  if PROCESS_ID.value == 0 and COORDINATOR.value:
    _check_port_free(COORDINATOR.value)
  import jax  # pylint: disable=g-import-not-at-top
  # CPU processes exchange collectives through gloo (TCP), JAX's default
  # under jax.distributed; without it a CPU client runs collectives within
  # each process only. Accelerator backends ignore the setting.
  jax.config.update('jax_cpu_collectives_implementation',
                    'gloo' if collectives else None)
  address = _transfer_address()
  if address:
    jax.config.update('jax_cross_host_transfer_socket_address', address)
  kwargs = {k: v for k, v in (
      ('coordinator_address', COORDINATOR.value),
      ('num_processes', NUM_PROCESSES.value),
      ('process_id', PROCESS_ID.value)) if v is not None}
  timeout = START_TIMEOUT.value
  wait_for_start(
      lambda: jax.distributed.initialize(
          heartbeat_timeout_seconds=HEARTBEAT.value,
          # Its end (`exit_job`, and the interpreter's exit otherwise)
          # waits that long at most for the others, not JAX's 300 s.
          shutdown_timeout_seconds=HEARTBEAT.value,
          initialization_timeout=math.ceil(timeout) + _JAX_START_MARGIN_S,
          **kwargs),
      timeout, _waited_for)


def exit_job(code: int) -> NoReturn:
  """Ends this process of a job every process of which has ended (the run
  finished, or stopped saved), with exit status `code`.

  First jax.distributed's shutdown: a barrier of every process (at most
  `--heartbeat_timeout_seconds`), so that none outlives the coordination
  service in process 0, whose end would abort it. Then the process ends
  without the interpreter's teardown (`entry.exit_now`): that teardown
  destroys the backend, whose cross-process transfer server (`launch.rl`'s
  weights and batches, on CPU) first waits for every transfer under way,
  and one whose other end has stopped never completes. A stopped 3-process
  RL job hung there, its line printed, in 2 of 7 runs on a loaded host
  (docs/lab/multihost.md; tests/test_rl_transport.py holds the case).
  """
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.distributed.shutdown()
  except Exception as e:  # pylint: disable=broad-except
    # A peer that never came to the barrier: its own end says why.
    logging.warning('jax.distributed did not shut down cleanly: %s', e)
  entry.exit_now(code)
