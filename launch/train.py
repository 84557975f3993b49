r"""Train a model: `python -m launch.train --config=configs/X.py[:arg] --workdir=DIR`.

Overrides: `--config.a.b=value`. Multi-host (TPU pods, or several processes
on one machine): `--multihost` (`train.jobs.multihost`) calls
`jax.distributed.initialize()`, which finds the coordinator by itself on
Cloud TPU; elsewhere pass `--coordinator_address`, `--num_processes` and
`--process_id`. Those flags are checked before the processes meet (exit
2); a process that is not joined by every other within
`--multihost_start_timeout` (60 s) says which it waited for (exit 1), and
SIGTERM or SIGINT ends that wait at once.

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

from train.jobs import entry
from train.jobs import multihost
from train.jobs import trainers

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file (get_config(arg)).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics and plots.')
flags.mark_flags_as_required(['config', 'workdir'])



def _init_jax(config) -> None:
  """Device settings that must precede JAX's backend initialisation."""
  entry.configure_devices(config)
  if multihost.MULTIHOST.value:
    trainers.check_config(config)
  multihost.initialize()


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
