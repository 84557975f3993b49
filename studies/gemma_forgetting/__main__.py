r"""SAM against AdamW fine-tuning of Gemma 3 270M: what each forgets.

  python -m studies.gemma_forgetting --config=studies/gemma_forgetting/config.py \
      --rhos=0.05,0.01 --sharpness_iters=20 --workdir=workdirs/gemma_forgetting

The flat-minima claim (shared/research/sam.md: SAM-trained models forget
less after post-training) on a pretrained model. Which parts are whose:
SAM, the claim and its measure (held-out loss of the original
distribution after post-training) are the papers'; the task, the steps,
the learning rate and the frozen tied embedding (a CPU budget: it halves
a step and the optimizer state) are ours (`config`).

Fine-tunes the registry's Gemma 3 270M on arithmetic answers with the
config's AdamW, and with SAM around it at each radius of `--rhos`, for
`--seeds` seeds each (`settings`), and measures what each forgets: the
increase of its cross-entropy on held-out text that fine-tuning never
shows, next to what it learnt (answer cross-entropy, pass@1; `measure`).
Writes forgetting.md and forgetting.json into --workdir (`report`); every
run is a resumable trainer run below it and a rerun reuses what is
measured. Any config field can be overridden
(`--config.num_steps=100 --config.optimizer.learning_rate=1e-5`). A
mistake ends the study before the model is loaded, in one line (exit
status 2); a workdir held by another study, exit 75.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'studies/gemma_forgetting/config.py (get_config(arg)) '
    'or configs/gemma.py:sft[,frozen].', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Root directory of the study.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per variant.')
_RHOS = flags.DEFINE_list('rhos', ['0.05'], 'SAM radii: a SAM variant each, '
                          'against AdamW.')
_WINDOWS = flags.DEFINE_integer('windows', 32, 'Held-out text windows.')
_WINDOW_LEN = flags.DEFINE_integer('window_len', 128,
                                   'Tokens per held-out window.')
_SHARPNESS_ITERS = flags.DEFINE_integer(
    'sharpness_iters', 0, 'Power-iteration products for each model\'s top '
    'Hessian eigenvalue on the fine-tuning loss (0: not measured).')
_SHARPNESS_PROBLEMS = flags.DEFINE_integer(
    'sharpness_problems', 32, 'Training problems of that loss.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    # pylint: disable=g-import-not-at-top
    from studies.gemma_forgetting import settings as study_settings
    from studies.gemma_forgetting import study
    from train.analysis import stats
    from train.jobs import sam_flags
    stats.check_seed_count('--seeds', _SEEDS.value)
    rhos = sam_flags.radii('--rhos', _RHOS.value)
    settings = study_settings.Settings(
        seeds=_SEEDS.value, rhos=rhos,
        windows=_WINDOWS.value, window_len=_WINDOW_LEN.value,
        sharpness_iters=_SHARPNESS_ITERS.value,
        sharpness_problems=_SHARPNESS_PROBLEMS.value)
    settings.check()
    study_settings.check_config(config)
    entry.configure_devices(config)
    return study.run(settings, config, _WORKDIR.value)

  print(entry.run_job(job))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
