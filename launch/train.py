r"""Train a model: `python -m launch.train --config=configs/X.py[:arg] --workdir=DIR`.

Overrides: `--config.a.b=value`. Multi-host (TPU pods, or several processes
on one machine): `--multihost` calls `jax.distributed.initialize()`, which
finds the coordinator by itself on Cloud TPU; elsewhere pass
`--coordinator_address`, `--num_processes` and `--process_id`.

A mistake in the config or flags ends the run before any compute with one
line naming the setting, the value and the valid choices (exit status 2).
Other ends, each one line on stderr: the workdir is in use by another run
(75), no checkpoint in the workdir loads and verifies (4), a non-finite
loss (3), a full disk (5), a damaged data file (6); SIGTERM saves a
checkpoint and exits 0, SIGINT (Ctrl-C) saves one and exits 130; either
signal outside the training loop exits 128 + its number.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from launch import entry
from launch import trainers

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file (get_config(arg)).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics and plots.')
_MULTIHOST = flags.DEFINE_bool(
    'multihost', False, 'Call jax.distributed.initialize() before training.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0 (multihost only).')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, 'Number of processes (multihost only).')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', None, 'This process (multihost only).')
_HEARTBEAT = flags.DEFINE_integer(
    'heartbeat_timeout_seconds', 100,
    'Multihost: a process silent this long is declared dead and the others '
    'stop with an error instead of waiting for it.')
flags.mark_flags_as_required(['config', 'workdir'])



def _init_jax(config) -> None:
  """Device settings that must precede JAX's backend initialisation."""
  import jax  # pylint: disable=g-import-not-at-top
  entry.configure_devices(config)
  if _MULTIHOST.value:
    # CPU processes exchange collectives through gloo (TCP): the default CPU
    # client has none across processes. Accelerator backends ignore it.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    kwargs = {k: v for k, v in (
        ('coordinator_address', _COORDINATOR.value),
        ('num_processes', _NUM_PROCESSES.value),
        ('process_id', _PROCESS_ID.value)) if v is not None}
    jax.distributed.initialize(
        heartbeat_timeout_seconds=_HEARTBEAT.value, **kwargs)


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    _init_jax(config)
    return trainers.train_and_evaluate(config, _WORKDIR.value)

  final = entry.run_job(job)
  print(f'test accuracy: {final["test_accuracy"]:.4f} '
        f'(test loss {final["test_loss"]:.4f}, step {final["step"]}, '
        f'workdir {_WORKDIR.value})')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
