r"""Compile a job for a TPU pod or GPU node from this host: per-chip memory and cost.

  python -m launch.compile --config=configs/lm.py:size=1b --target=v5e:16x16
  python -m launch.compile --config=configs/wrn_cifar10.py --target=h100:1x1x8 \
    --workdir=/tmp/compile_wrn
  python -m launch.compile --config=configs/lm.py:size=8b --target=v5p:4x4x4 \
    --num_slices=2

The job's real step functions, built from the config with abstract arrays
and compiled by the target's own compiler (`train.jobs.compile_jobs`). One
table row per program: per-chip bytes against the chip's HBM, FLOPs, HBM
bytes and a roofline step time; `--workdir` gets `compile.json`. Targets,
limits, deadlines and exit statuses: docs/compile.md.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import compile_jobs
from train.jobs import compile_watch
from train.jobs import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'The job\'s config file (get_config(arg)).',
    lock_config=True)
_TARGET = flags.DEFINE_string(
    'target', None, 'What to compile for: v5e:16x16, v5p:4x4x4, v6e:8x8, '
    'v4:2x2x2, h100:1x1x8, h200:2x1x8, ... (TPU chips per dimension; GPU '
    'nodes x 1 x GPUs per node).')
_NUM_SLICES = flags.DEFINE_integer(
    'num_slices', 1, 'TPU slices over the data-centre network (the data '
    'axis spans them).')
_COMPILE_TIMEOUT = flags.DEFINE_float(
    'compile_timeout', compile_watch.DEFAULT_TIMEOUT_S,
    'Seconds each step may take (building the programs; tracing and '
    'compiling each one); then the launcher stops in one line naming it. '
    f'In [1, {compile_watch.MAX_TIMEOUT_S}].')
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Where to write compile.json (optional).')
_MODEL_CONFIG = config_flags.DEFINE_config_file(
    'model_config', None, 'For jobs that read a trained model from another '
    'workdir: that model\'s config file.', lock_config=True)
flags.mark_flags_as_required(['config', 'target'])


def main(argv):
  del argv
  entry.quiet_libraries()
  config = _CONFIG.value
  # The flags and sizes first, before JAX is imported (a second of start-up
  # for a refusal otherwise).
  # pylint: disable=g-import-not-at-top
  from train.errors import UsageError
  from train.compilation.targets import ToolchainMissing
  # pylint: enable=g-import-not-at-top
  try:
    compile_jobs.check_flags(config, _TARGET.value, _NUM_SLICES.value,
                             _COMPILE_TIMEOUT.value, _MODEL_CONFIG.value)
  except (UsageError, ToolchainMissing) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  # Before run_job, whose imports import JAX (the CUDA plugin's lines);
  # its backend starts inside, where signals end the launcher in one line.
  compile_jobs.import_jax()
  entry.run_job(lambda: compile_jobs.run(
      config, _TARGET.value, _NUM_SLICES.value, _WORKDIR.value,
      _MODEL_CONFIG.value, _COMPILE_TIMEOUT.value))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
