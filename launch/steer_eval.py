r"""Evaluate steering methods on a trained LM.

  python -m launch.steer_eval --config=configs/steering.py \
    --config.lm_workdir=workdirs/lm --workdir=workdirs/steer

A mistake in the config or flags ends the run before any compute with one
line naming the setting and the valid choices (exit status 2).
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from launch import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Evaluation config file (get_config(arg)).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None,
                               'Directory for the table, plot and vector.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()
  entry.configure_devices(config)
  from train.steering import evaluation as steering_eval  # pylint: disable=g-import-not-at-top
  from train.errors import RunError, UsageError  # pylint: disable=g-import-not-at-top
  try:
    rows = steering_eval.evaluate(config, _WORKDIR.value)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  except RunError as e:  # e.g. no LM checkpoint that loads and verifies.
    print(f'error: {e}', file=sys.stderr)
    sys.exit(e.exit_code)
  print(f'{len(rows)} settings evaluated; table: {_WORKDIR.value}/results.md')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(
      argv, _CONFIG))
