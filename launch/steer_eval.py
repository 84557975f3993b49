r"""Evaluate steering methods on a trained LM, or on Gemma 3.

  python -m launch.steer_eval --config=configs/steering.py \
    --config.lm_workdir=workdirs/lm --workdir=workdirs/steer
  python -m launch.steer_eval --config=configs/gemma.py \
    --workdir=workdirs/gemma_steer

One evaluation (`train.steering.evaluation`) for both: the config names
the LM, a trained LM's workdir or a Gemma 3 GGUF file.

A mistake in the config or flags ends the run before any compute with one
line naming the setting and the valid choices (exit status 2); a workdir
held by another evaluation is one line and exit status 75; an LM with no
checkpoint that loads and verifies, exit status 4.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry

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

  def job():
    entry.configure_devices(config)
    from train.steering import evaluation as steering_eval  # pylint: disable=g-import-not-at-top
    return steering_eval.evaluate(config, _WORKDIR.value)

  rows = entry.run_job(job)
  print(f'{len(rows)} settings evaluated; table: {_WORKDIR.value}/results.md')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(
      argv, _CONFIG))
