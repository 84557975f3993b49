r"""A short SAM mid-training phase on Gemma 3 270M: forgetting after
post-training and after 4-bit quantisation (the companion paper's
protocol).

  python -m studies.gemma_midtraining \
      --config=studies/gemma_midtraining/config.py \
      --workdir=workdirs/gemma_midtraining

The claim (ICML 2026, abstract only): "a short SAM mid-training phase
applied to an existing OLMo-2-1B checkpoint reduces forgetting by 31%
after MetaMath post-training and by 40% after 4-bit quantization". Which
parts are whose: the protocol (mid-train an existing checkpoint with SAM,
then post-train or quantise, and compare forgetting with a model
mid-trained without SAM) and the measure (loss of the original ability
after each) are the paper's; the model, the texts, the steps, the rate,
the radii, the frozen tied embedding (a CPU budget), the quantisation
scheme and the probes are ours (`config`, `settings`, `measure`).

Mid-trains the registry's Gemma 3 270M on Python's documentation with
AdamW, and with SAM around it at each radius of `--rhos`, for `--seeds`
seeds; post-trains each (and the checkpoint) on arithmetic; quantises
each to `--bits` bits; measures held-out text CE, knowledge probes,
pass@1 and sharpness (`measure`). Writes midtraining.md and
midtraining.json into --workdir (`report`); every run is a resumable
trainer run below it and a rerun reuses what is measured. A mistake ends
the study before the model is loaded, in one line (exit status 2); a
workdir held by another study, exit 75.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'studies/gemma_midtraining/config.py (get_config(arg)).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Root directory of the study.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds (data orders) per variant.')
_RHOS = flags.DEFINE_list('rhos', ['0.05', '0.01'],
                          'SAM radii of mid-training: a variant each.')
_WINDOWS = flags.DEFINE_integer('windows', 32, 'Held-out text windows.')
_WINDOW_LEN = flags.DEFINE_integer('window_len', 128,
                                   'Tokens per held-out window.')
_BITS = flags.DEFINE_integer('bits', 4, 'Quantisation bits.')
_GROUP_SIZE = flags.DEFINE_integer(
    'group_size', 32, 'Input weights per quantisation scale (0: one scale '
    'per output channel).')
_LANCZOS_STEPS = flags.DEFINE_integer(
    'lanczos_steps', 20, 'Lanczos products for the ends of each mid-trained '
    "model's Hessian spectrum (0: not measured).")
_TRACE_PROBES = flags.DEFINE_integer(
    'trace_probes', 4, 'Hutchinson probes for its Hessian trace (0: not '
    'measured).')
_SHARPNESS_WINDOWS = flags.DEFINE_integer(
    'sharpness_windows', 4, 'Training windows of that loss.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    # pylint: disable=g-import-not-at-top
    from studies.gemma_midtraining import settings as study_settings
    from studies.gemma_midtraining import study
    from train.analysis import stats
    from train.jobs import sam_flags
    stats.check_seed_count('--seeds', _SEEDS.value)
    rhos = sam_flags.radii('--rhos', _RHOS.value)
    settings = study_settings.Settings(
        seeds=_SEEDS.value, rhos=rhos, windows=_WINDOWS.value,
        window_len=_WINDOW_LEN.value, bits=_BITS.value,
        group_size=_GROUP_SIZE.value,
        lanczos_steps=_LANCZOS_STEPS.value,
        trace_probes=_TRACE_PROBES.value,
        sharpness_windows=_SHARPNESS_WINDOWS.value)
    settings.check()
    study_settings.check_config(config)
    entry.configure_devices(config.midtrain)
    return study.run(settings, config, _WORKDIR.value)

  print(entry.run_job(job))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
