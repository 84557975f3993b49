"""Simulated devices on a CPU host, set before JAX creates its backends.

On a CPU host the mesh code runs over N simulated devices, exactly as it
would over N accelerators. XLA:CPU runs the devices' parts of a program on
one shared thread pool, sized by default to the number of cores, and a
collective (all-reduce, all-gather) blocks its thread until every peer
device arrives. Independent collectives over different device groups may
start in a different order on different devices, so with fewer threads
than blocked collectives the pool starves and the program deadlocks (seen
here: 8 devices on 2 cores, a model-parallel train step, within a few
hundred steps). A pool with several threads per device (XLA reads its size
from PJRT_NPROC) removes the starvation; dispatching CPU programs one at a
time keeps at most one program's collectives in flight. Both settings only
affect the CPU client: accelerator hosts are unchanged.
"""

import os

import jax

from train.errors import ConfigError

THREADS_PER_DEVICE = 8
# The most devices a host simulates: 8 threads each (above), so 4096
# threads; the largest TPU slices (256 chips) fit. A million asked for a
# million-device client, which grew by 40 MB/s with no output.
MAX_CPU_DEVICES = 512


def check_cpu_devices(num_devices) -> None:
  """ConfigError naming `cpu_devices` unless it is in [1, MAX_CPU_DEVICES]."""
  if (isinstance(num_devices, bool) or not isinstance(num_devices, int)
      or not 1 <= num_devices <= MAX_CPU_DEVICES):
    raise ConfigError('cpu_devices', num_devices, 'simulated CPU devices: '
                      f'an integer in [1, {MAX_CPU_DEVICES}]')


def configure_cpu_devices(num_devices: int) -> None:
  """Use `num_devices` CPU devices; call before any JAX computation.

  Raises:
    ConfigError: `num_devices` is not in [1, MAX_CPU_DEVICES].
  """
  check_cpu_devices(num_devices)
  jax.config.update('jax_num_cpu_devices', num_devices)
  if num_devices > 1:
    os.environ.setdefault(
        'PJRT_NPROC',
        str(max(os.cpu_count() or 1, THREADS_PER_DEVICE * num_devices)))
    jax.config.update('jax_cpu_enable_async_dispatch', False)


def host_memory_bytes() -> int:
  """This host's physical memory (what its CPU devices share)."""
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
