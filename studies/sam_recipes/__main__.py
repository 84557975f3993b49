r"""SGD vs SAM vs SAM + warm-start vs ASAM over a rho grid and seeds, with the detector.

  python -m studies.sam_recipes --workdir=workdirs/sam_study

Trains `configs/digits.py` (600 steps of momentum SGD, cosine schedule) once
per method, rho and seed, each run in its own workdir below `--workdir`
(a finished run is not trained again, an interrupted one resumes;
`training_runs`), then writes `study.md` and `study.json`: test accuracy
mean +- std over seeds, the final training loss, and the detector's
statistics (runs flagged at least once, steps flagged as hallucinations,
the smoothed |g+|/|g| at the end; and whether the run stalled: its
training loss over the last fifth of the logged steps stayed above
0.9 ln K, K classes (the vocabulary for the LM), near the loss of a
uniform guess, so that it learned next to nothing; a run that learns the
clean labels but not the noisy ones ends well below that; `report`).
Method `sgd` is the config's own optimizer without SAM (momentum SGD for
digits, AdamW for the LM). With symmetric label noise on the training
labels (test labels clean), on digits and on 5,000 MNIST images:

  python -m studies.sam_recipes --workdir=workdirs/sam_noise4 \
    --config_arg=label_noise=0.4 --rhos=0.05,0.2,0.5,1.0,2.0
  python -m studies.sam_recipes --workdir=workdirs/mnist_noise4 \
    --config_arg=dataset=mnist5k,label_noise=0.4 --rhos=0.5,1.0,2.0 \
    --asam_rhos=2.0,5.0

The detector at large rho on the in-project LM (`configs/lm.py:forgetting`,
next-byte accuracy as the test accuracy):

  python -m studies.sam_recipes --workdir=workdirs/lm_rho --experiment=lm \
    --config_arg=forgetting --num_steps=600 --methods=sgd,sam,sam_warmstart \
    --rhos=0.5,2.0

(README.md lists the command behind each of its tables.) With data for a
standard TFDS set:

  python -m studies.sam_recipes --workdir=/tmp/c10 --dataset=cifar10 \
    --data_dir=gs://BUCKET/tensorflow_datasets

A bad flag (an unknown method or experiment, a radius <= 0, `--dataset`
with the LM) ends with one line naming it before anything is trained.
"""

import json
import os

from absl import app
from absl import flags

from studies.sam_recipes import report
from studies.sam_recipes import training_runs
from train.run import metrics
from train.analysis import stats
from train.errors import UsageError
from train.jobs import entry

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/sam_study', 'Root dir.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per setting.')
_RHOS = flags.DEFINE_list(
    'rhos', ['0.02', '0.05', '0.1', '0.2', '0.5', '1.0', '2.0'], 'SAM radii.')
_ASAM_RHOS = flags.DEFINE_list(
    'asam_rhos', None, "ASAM's radii (default: --rhos). ASAM's perturbation "
    'is relative to |w| per parameter, so its useful radii are on another '
    'scale than SAM\'s.')
_METHODS = flags.DEFINE_list(
    'methods', list(training_runs.RECIPES),
    f'Methods, of: {", ".join(training_runs.METHODS)} (looksamK: LookSAM, '
    'g+ every K steps; aesam: AE-SAM\'s switch, c = 0; aesam_linear: c '
    'from -1 to 1 over the run, the paper\'s).')
_WARMSTART = flags.DEFINE_integer(
    'warmstart_steps', 100, 'Plain steps before SAM for sam_warmstart.')
_DATASET = flags.DEFINE_string(
    'dataset', None, 'config.dataset (default: the config\'s, digits unless '
    '--config_arg names one).')
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'config.data_dir')
_CONFIG_ARG = flags.DEFINE_string(
    'config_arg', '', 'Argument of the experiment\'s config (digits: e.g. '
    'runlocal, dataset=mnist5k, label_noise=0.4; lm: e.g. forgetting).')
_EXPERIMENT = flags.DEFINE_string(
    'experiment', 'digits', 'Config: digits (configs/digits.py) or lm '
    '(configs/lm.py).')
_NUM_STEPS = flags.DEFINE_integer(
    'num_steps', None, 'Training steps of every run (default: the config\'s).')


def _radii(flag: str, values) -> tuple[float, ...]:
  out = []
  for value in values:
    try:
      rho = float(value)
    except ValueError:
      rho = 0.0
    if not rho > 0:
      raise UsageError(flag, value, 'a radius must be a number > 0')
    out.append(rho)
  return tuple(out)


def study_from_flags() -> training_runs.Study:
  """The study the flags ask for; UsageError naming a bad flag."""
  stats.check_seed_count('--seeds', _SEEDS.value)
  if _EXPERIMENT.value not in training_runs.EXPERIMENTS:
    raise UsageError('--experiment', _EXPERIMENT.value, 'unknown experiment',
                     training_runs.EXPERIMENTS)
  unknown = [m for m in _METHODS.value if m not in training_runs.METHODS]
  if unknown or not _METHODS.value:
    raise UsageError('--methods', unknown[0] if unknown else '',
                     'unknown method', training_runs.METHODS)
  rhos = _radii('--rhos', _RHOS.value)
  asam_rhos = _radii('--asam_rhos', _ASAM_RHOS.value or []) or None
  if _EXPERIMENT.value == 'lm' and (_DATASET.value or _DATA_DIR.value):
    raise UsageError('--dataset' if _DATASET.value else '--data_dir',
                     _DATASET.value or _DATA_DIR.value,
                     'the LM reads its own corpora (configs/lm.py data.mix)')
  if _NUM_STEPS.value is not None and _NUM_STEPS.value < 1:
    raise UsageError('--num_steps', _NUM_STEPS.value, 'must be >= 1')
  study = training_runs.Study(
      root=_WORKDIR.value, experiment=_EXPERIMENT.value,
      config_arg=_CONFIG_ARG.value, methods=tuple(_METHODS.value), rhos=rhos,
      asam_rhos=asam_rhos, seeds=_SEEDS.value,
      warmstart_steps=_WARMSTART.value, num_steps=_NUM_STEPS.value,
      dataset=_DATASET.value, data_dir=_DATA_DIR.value)
  if (_WARMSTART.value < 0 or 'sam_warmstart' in _METHODS.value
      and _WARMSTART.value >= study.config('sgd', 0.0, 0).num_steps):
    raise UsageError('--warmstart_steps', _WARMSTART.value,
                     'must lie in [0, num_steps)')
  return study


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    study = study_from_flags()
    entry.configure_devices(study.config('sgd', 0.0, 0))
    results = training_runs.train_all(study)
    text = report.summarize(results)
    # Atomic writes replace what is there (a FIFO would block an open).
    metrics.write_text_atomic(os.path.join(study.root, 'study.md'), text)
    metrics.write_text_atomic(
        os.path.join(study.root, 'study.json'),
        json.dumps({f'{m}/{r}': v for (m, r), v in results.items()},
                   indent=1))
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
