"""The `--multihost` flags of the launchers that run one job over several
processes (`launch.train`, `launch.rl`), and `jax.distributed`'s start.

`--multihost` calls `jax.distributed.initialize()`, which finds the
coordinator by itself on Cloud TPU; elsewhere pass `--coordinator_address`,
`--num_processes` and `--process_id`. On CPU hosts the processes exchange
collectives through gloo, and arrays between processes (`launch.rl`'s
weights and batches) through the transfer server at `--transfer_address`
(default: this host's address, port = the coordinator's + 1 + process id).
"""

import socket

from absl import flags

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


def _transfer_address() -> str | None:
  if TRANSFER_ADDRESS.value:
    return TRANSFER_ADDRESS.value
  if not COORDINATOR.value or PROCESS_ID.value is None:
    return None
  host, port = COORDINATOR.value.rsplit(':', 1)
  if host not in ('127.0.0.1', 'localhost'):
    host = socket.gethostbyname(socket.gethostname())
  return f'{host}:{int(port) + 1 + PROCESS_ID.value}'


def initialize(collectives: bool = True) -> None:
  """Starts jax.distributed if `--multihost`; before JAX's backend starts.

  `collectives`: programs span processes (the CPU client then runs every
  collective through gloo, also those within one process, which sums in
  another order). A job whose programs each run within one process (RL's
  rollout and learner processes) passes False, so that its sums are
  those of a one-process run, bit for bit.
  """
  if not MULTIHOST.value:
    return
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
  jax.distributed.initialize(heartbeat_timeout_seconds=HEARTBEAT.value,
                             **kwargs)
