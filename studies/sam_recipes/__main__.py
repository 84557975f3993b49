r"""SGD vs SAM vs SAM + warm-start vs ASAM over a rho grid and seeds, with the detector.

  python -m launch.sam_study --workdir=workdirs/sam_study

Trains `configs/digits.py` (600 steps of momentum SGD, cosine schedule) once
per method, rho and seed, each run in its own workdir below `--workdir`
(a finished run is not trained again, an interrupted one resumes), then
writes `study.md` and `study.json`: test accuracy mean +- std over seeds,
the final training loss, and the detector's statistics (runs flagged at
least once, steps flagged as hallucinations, the smoothed |g+|/|g| at the
end; and whether the run stalled: its training loss over the last fifth
of the logged steps stayed above 0.9 ln K, K classes (the vocabulary for
the LM), near the loss of a uniform guess, so that it learned next to
nothing; a run that learns the clean labels but not the noisy ones ends
well below that). Method `sgd` is the config's own optimizer without SAM
(momentum SGD for digits, AdamW for the LM). With symmetric label noise on
the training labels (test labels clean; the SAM label-noise study of
RESULTS.md), on digits and on 5,000 MNIST images:

  python -m launch.sam_study --workdir=workdirs/sam_noise40 \
    --config_arg=label_noise=0.4 --rhos=0.05,0.2,0.5,1.0,2.0
  python -m launch.sam_study --workdir=workdirs/mnist_noise4 \
    --config_arg=dataset=mnist5k,label_noise=0.4 --rhos=1.0,2.0 \
    --asam_rhos=2.0,5.0

The detector at large rho on the in-project LM (`configs/lm.py:forgetting`,
next-byte accuracy as the test accuracy):

  python -m launch.sam_study --workdir=workdirs/lm_rho --experiment=lm \
    --config_arg=forgetting --num_steps=800 --methods=sgd,sam,sam_warmstart \
    --rhos=0.5,2.0

With data for a standard TFDS set:

  python -m launch.sam_study --workdir=/tmp/c10 --dataset=cifar10 \
    --data_dir=gs://BUCKET/tensorflow_datasets

A bad flag (an unknown method or experiment, a radius <= 0, `--dataset`
with the LM) ends with one line naming it before anything is trained.
"""

import json
import math
import os
import statistics

from absl import app
from absl import flags
from absl import logging

from launch import entry
from launch import trainers
from train import metrics
from train import stats
from train.errors import UsageError
from train.vision import datasets

METHODS = ('sgd', 'sam', 'sam_warmstart', 'asam')
EXPERIMENTS = ('digits', 'lm')

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/sam_study', 'Root dir.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per setting.')
_RHOS = flags.DEFINE_list(
    'rhos', ['0.02', '0.05', '0.1', '0.2', '0.5', '1.0', '2.0'], 'SAM radii.')
_ASAM_RHOS = flags.DEFINE_list(
    'asam_rhos', None, "ASAM's radii (default: --rhos). ASAM's perturbation "
    'is relative to |w| per parameter, so its useful radii are on another '
    'scale than SAM\'s.')
_METHODS = flags.DEFINE_list('methods', ['sgd', 'sam', 'sam_warmstart', 'asam'],
                             'Methods.')
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


def check_flags() -> None:
  """UsageError naming the flag, before anything is trained."""
  stats.check_seed_count('--seeds', _SEEDS.value)
  if _EXPERIMENT.value not in EXPERIMENTS:
    raise UsageError('--experiment', _EXPERIMENT.value, 'unknown experiment',
                     EXPERIMENTS)
  unknown = [m for m in _METHODS.value if m not in METHODS]
  if unknown or not _METHODS.value:
    raise UsageError('--methods', unknown[0] if unknown else '',
                     'unknown method', METHODS)
  for flag, values in (('--rhos', _RHOS.value),
                       ('--asam_rhos', _ASAM_RHOS.value or [])):
    for value in values:
      try:
        ok = float(value) > 0
      except ValueError:
        ok = False
      if not ok:
        raise UsageError(flag, value, 'a radius must be a number > 0')
  if _EXPERIMENT.value == 'lm' and (_DATASET.value or _DATA_DIR.value):
    raise UsageError('--dataset' if _DATASET.value else '--data_dir',
                     _DATASET.value or _DATA_DIR.value,
                     'the LM reads its own corpora (configs/lm.py data.mix)')
  if _NUM_STEPS.value is not None and _NUM_STEPS.value < 1:
    raise UsageError('--num_steps', _NUM_STEPS.value, 'must be >= 1')
  if (_WARMSTART.value < 0 or 'sam_warmstart' in _METHODS.value
      and _WARMSTART.value >= run_config('sgd', 0.0, 0).num_steps):
    raise UsageError('--warmstart_steps', _WARMSTART.value,
                     'must lie in [0, num_steps)')


def run_config(method: str, rho: float, seed: int):
  # pylint: disable=g-import-not-at-top
  if _EXPERIMENT.value == 'lm':
    from configs import lm as module
  else:
    from configs import digits as module
  config = module.get_config(_CONFIG_ARG.value or None)
  config.seed = seed
  if _NUM_STEPS.value:
    config.num_steps = _NUM_STEPS.value
  if _DATASET.value:
    config.dataset = _DATASET.value
  if _DATA_DIR.value:
    config.data_dir = _DATA_DIR.value
  sam = config.optimizer.sam
  if method != 'sgd':
    sam.enabled = True
    sam.rho = rho
    sam.adaptive = method == 'asam'
    if method == 'sam_warmstart':
      sam.warmup_steps = _WARMSTART.value
  return config


def train_records(workdir: str) -> list[dict]:
  records = metrics.read_jsonl(os.path.join(workdir, 'metrics.jsonl'), workdir)
  return [r for r in records if 'train_loss' in r]


def late_loss(records: list[dict]) -> float:
  """The training loss's mean over the last fifth of the logged steps."""
  losses = [r['train_loss'] for r in records]
  return statistics.mean(losses[-max(1, len(losses) // 5):])


def stalled(records: list[dict], num_classes: int) -> bool:
  """`late_loss` is above 0.9 ln(num_classes): near a uniform guess's,
  nothing learned."""
  return late_loss(records) > 0.9 * math.log(num_classes)


def num_classes(config) -> int:
  """K of the stall criterion: classes, or the LM's vocabulary."""
  if config.get('task', 'classification') == 'lm':
    return config.model.vocab_size
  return datasets.get_spec(config.dataset).num_classes


def summarize(results: dict) -> str:
  def mean_std(values):
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f'{100 * m:.2f} +- {100 * s:.2f}'

  head = ['method', 'rho', 'test accuracy % (mean +- std)', 'seeds',
          'val accuracy %', 'training loss, last fifth', 'SAM steps',
          'runs flagged', 'flagged steps (mean)',
          '\\|g+\\|/\\|g\\| EMA at end', 'runs whose loss stalled']
  rows = []
  for (method, rho), runs in results.items():
    flagged = [r.get('opt/hallucination_steps', 0.0) for r in runs]
    n_flagged = sum(f > 0 for f in flagged)
    n_stalled = sum(bool(r.get('stalled')) for r in runs)
    sam_steps = [r.get('opt/sam_steps', 0.0) for r in runs]
    ratio = [r['opt/grad_ratio_ema'] for r in runs
             if r.get('opt/sam_steps', 0) > 0]
    rows.append([
        method, '-' if method == 'sgd' else f'{rho:g}',
        mean_std([r['test_accuracy'] for r in runs]), len(runs),
        mean_std([r['val_accuracy'] for r in runs]),
        f'{statistics.mean(r["late_train_loss"] for r in runs):.3f}',
        f'{statistics.mean(sam_steps):.0f}', f'{n_flagged}/{len(runs)}',
        f'{statistics.mean(flagged):.1f}',
        f'{statistics.mean(ratio):.3f}' if ratio else '-',
        f'{n_stalled}/{len(runs)}'])
  return stats.markdown_table(head, rows, '-' * len(head)) + '\n'


def run_study() -> dict:
  """Trains every (method, rho, seed) not yet finished; their records."""
  results = {}
  for method in _METHODS.value:
    if method == 'sgd':
      rhos = [0.0]
    elif method == 'asam' and _ASAM_RHOS.value:
      rhos = [float(r) for r in _ASAM_RHOS.value]
    else:
      rhos = [float(r) for r in _RHOS.value]
    for rho in rhos:
      runs = []
      for seed in range(_SEEDS.value):
        name = f'{method}_rho{rho:g}_seed{seed}'
        workdir = os.path.join(_WORKDIR.value, name)
        config = run_config(method, rho, seed)
        final = trainers.train_and_evaluate(config, workdir)
        record = dict(final)
        records = train_records(workdir)
        record.update({k: v for k, v in records[-1].items()
                       if k.startswith('opt/')})
        record['late_train_loss'] = late_loss(records)
        record['stalled'] = stalled(records, num_classes(config))
        runs.append(record)
        logging.info('%s: test accuracy %.4f', name, final['test_accuracy'])
      results[(method, rho)] = runs
  return results


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    check_flags()
    entry.configure_devices(run_config('sgd', 0.0, 0))
    results = run_study()
    text = summarize(results)
    # Atomic writes replace what is there (a FIFO would block an open).
    metrics.write_text_atomic(os.path.join(_WORKDIR.value, 'study.md'), text)
    metrics.write_text_atomic(
        os.path.join(_WORKDIR.value, 'study.json'),
        json.dumps({f'{m}/{r}': v for (m, r), v in results.items()},
                   indent=1))
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
