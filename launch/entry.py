"""What every absl entry point in launch/ shares: one-line usage errors,
quiet library logs, and device settings that precede JAX's start."""

import re
import sys

from absl import flags
from absl import logging

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


class LibraryNoiseFilter(logging.logging.Filter):

  def filter(self, record) -> bool:
    return not any(lib in record.pathname and
                   record.levelno <= level
                   for lib, level in _QUIET_LIBRARIES.items())


def one_line(error: Exception, argv: list[str]) -> str:
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


def parse_flags(argv: list[str], config_flag) -> list[str]:
  """absl's flag parsing, with a mistake reported as one line (exit status 2).

  `config_flag` is the job's `config_flags.DEFINE_config_file` holder (or
  None for jobs whose --config is a plain path).
  """
  try:
    rest = flags.FLAGS(argv)
    if config_flag is not None:
      config_flag.value.keys()  # A config file that failed to load raises here.
    return rest
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError,
          OSError) as e:
    print(f'error: {one_line(e, argv)}', file=sys.stderr)
    sys.exit(EXIT_USAGE)


def configure_devices(config) -> None:
  """Simulated CPU devices (`config.cpu_devices`), before JAX starts its backend."""
  from train import host_devices  # pylint: disable=g-import-not-at-top
  if config.get('cpu_devices'):
    host_devices.configure_cpu_devices(int(config.cpu_devices))
