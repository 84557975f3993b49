r"""Spherical steering vs addition on Gemma 3 270M (the registry's model).

  python -m studies.gemma_steering --config=configs/gemma.py:selection \
      --workdir=workdirs/gemma_steering_selected
  python -m studies.gemma_steering --config=configs/gemma.py \
      --workdir=workdirs/gemma_steering

With a config's `selection` block (the first, the selected settings:
`studies.gemma_steering.selected`), each method's layer, direction method
and alpha grid are chosen on validation items, then the test items are
scored once there; the report adds the reference settings' stored rows.
Without one (the reference settings), evaluates the config's methods x
alphas at `config.layer` and the layer sweep
(`studies.gemma_steering.layers`). Either writes study.md, study.json and
pareto_bands.png into --workdir. A rerun reuses finished evaluations made
with the same config from the same model file. A mistake in the config
or flags ends the run before the model is loaded, with one line naming
the setting (exit status 2); a workdir held by another run, exit 75.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'configs/gemma.py (get_config(arg)).', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Root directory of the study.')
_TARGETS = flags.DEFINE_list('targets', ['0.05', '0.1', '0.2', '0.33', '0.5'],
                             'KL values at which methods are compared.')
_SAMPLES = flags.DEFINE_integer('bootstrap_samples', 2000,
                                'Bootstrap replicates per interval.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    # pylint: disable=g-import-not-at-top
    from train.errors import UsageError
    try:
      targets = [float(t) for t in _TARGETS.value]
    except ValueError:
      raise UsageError('--targets', ','.join(_TARGETS.value),
                       'not a list of numbers') from None
    entry.configure_devices(config)
    if 'selection' in config:  # Its checks come before the model is read.
      from studies.gemma_steering import selected
      return selected.run(config, _WORKDIR.value, targets, _SAMPLES.value)
    from studies.gemma_steering import layers
    # pylint: enable=g-import-not-at-top
    return layers.run(config, _WORKDIR.value, targets, _SAMPLES.value)

  entry.run_job(job)
  print(f'study: {_WORKDIR.value}/study.md')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
