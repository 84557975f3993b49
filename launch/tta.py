r"""Adapt a trained classifier at test time over a corrupted stream.

  python -m launch.tta --config=configs/tta.py \
    --config.source_workdir=workdirs/mnist5k --workdir=workdirs/tta_tent

Prints the mean error over the stream's corruptions; per-corruption errors
go to `workdir/results.json`, `metrics.jsonl`, TensorBoard and
`errors.png`. A mistake in the config or flags, an unknown method,
corruption or severity, a missing or incompatible source checkpoint: one
line and exit status 2 before any compute. The workdir in use by another
run: 75; no checkpoint in it that loads and verifies: 4. SIGTERM saves a
checkpoint and exits 0, SIGINT saves one and exits 130; the same command
resumes the run, bit for bit.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'TTA config file (get_config(arg)).', lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics and results.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    entry.configure_devices(config)
    from train.tta import adapt  # pylint: disable=g-import-not-at-top
    return adapt.adapt_and_evaluate(config, _WORKDIR.value)

  results = entry.run_job(job)
  print(f'mean error: {results["mean_error"]:.2f}% over '
        f'{len(results["errors"])} corruptions ({config.method.name}, '
        f'{config.method.schedule}, {config.protocol}, severity '
        f'{config.severity}; workdir {_WORKDIR.value})')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
