r"""Train a model: `python -m launch.train --config=configs/X.py[:arg] --workdir=DIR`.

Overrides: `--config.a.b=value`. Multi-host (TPU pods, or several processes
on one machine): `--multihost` calls `jax.distributed.initialize()`, which
finds the coordinator by itself on Cloud TPU; elsewhere pass
`--coordinator_address`, `--num_processes` and `--process_id`.

A mistake in the config or flags ends the run before any compute with one
line naming the setting, the value and the valid choices (exit status 2).
"""

import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

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
flags.mark_flags_as_required(['config', 'workdir'])

EXIT_USAGE = 2
EXIT_NONFINITE = 3


# Libraries whose routine lines (one per checkpoint file, per data set
# lookup, ...) would bury the progress line, with the highest level hidden.
_QUIET_LIBRARIES = {
    '/orbax/': logging.logging.INFO,
    '/jax/_src/': logging.logging.INFO,
    # TFDS warns about missing metadata of every variant folder it scans.
    '/tensorflow_datasets/': logging.logging.WARNING,
}


class _LibraryNoiseFilter(logging.logging.Filter):

  def filter(self, record) -> bool:
    return not any(lib in record.pathname and
                   record.levelno <= level
                   for lib, level in _QUIET_LIBRARIES.items())


def _init_jax(config) -> None:
  """Device settings that must precede JAX's backend initialisation."""
  import jax  # pylint: disable=g-import-not-at-top
  from train import host_devices  # pylint: disable=g-import-not-at-top
  if config.get('cpu_devices'):
    host_devices.configure_cpu_devices(int(config.cpu_devices))
  if _MULTIHOST.value:
    kwargs = {k: v for k, v in (
        ('coordinator_address', _COORDINATOR.value),
        ('num_processes', _NUM_PROCESSES.value),
        ('process_id', _PROCESS_ID.value)) if v is not None}
    jax.distributed.initialize(**kwargs)


def _one_line(error: Exception, argv: list[str]) -> str:
  """The useful part of a flag-parsing error, on one line."""
  text = str(error.args[0] if error.args else error)
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  if isinstance(error, (KeyError, AttributeError)):
    # ConfigDict's message for an override of a field that does not exist.
    hint = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
    field = hint.group(2) if hint else lines[0].strip('\'"')
    flag = next((a.split('=')[0] for a in argv
                 if a.startswith('--config.') and field in a), '--config.*')
    return (f'{flag}: the config has no field {field!r}'
            + (f'; did you mean {hint.group(1)!r}?' if hint else ''))
  if isinstance(error, OSError):
    return f'--config: cannot load the config file: {lines[-1]}'
  if any(l.startswith('Traceback') for l in lines):
    # config_flags embeds the traceback of get_config(); its last line says it.
    return f'{lines[0]} {lines[-1]}'
  return ' '.join(lines)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a mistake reported as one line (exit status 2)."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # A config file that failed to load raises here.
    return rest
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError,
          OSError) as e:
    print(f'error: {_one_line(e, argv)}', file=sys.stderr)
    sys.exit(EXIT_USAGE)


def main(argv):
  del argv
  config = _CONFIG.value
  logging.get_absl_handler().addFilter(_LibraryNoiseFilter())
  _init_jax(config)
  # Imported after _init_jax: importing the trainer must not fix the devices.
  from train import trainer  # pylint: disable=g-import-not-at-top
  from train.errors import NonFiniteLossError, Preempted, UsageError  # pylint: disable=g-import-not-at-top
  try:
    final = trainer.train_and_evaluate(config, _WORKDIR.value)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(EXIT_USAGE)
  except NonFiniteLossError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(EXIT_NONFINITE)
  except Preempted as e:
    logging.info('%s', e)
    print(str(e), file=sys.stderr)
    return
  print(f'test accuracy: {final["test_accuracy"]:.4f} '
        f'(test loss {final["test_loss"]:.4f}, step {final["step"]}, '
        f'workdir {_WORKDIR.value})')


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
