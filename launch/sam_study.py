r"""SGD vs SAM vs SAM + warm-start vs ASAM over a rho grid and seeds, with the detector.

  python -m launch.sam_study --workdir=workdirs/sam_study

Trains `configs/digits.py` (600 steps of momentum SGD, cosine schedule) once
per method, rho and seed, each run in its own workdir below `--workdir`
(a finished run is not trained again, an interrupted one resumes), then
writes `study.md` and `study.json`: test accuracy mean +- std over seeds,
and the detector's statistics (runs flagged at least once, steps flagged
as hallucinations, the smoothed |g+|/|g| at the end; and whether the run
stalled: its training loss over the last fifth of the logged steps
stayed above 0.9 ln K, K classes, near the loss of a uniform guess, so
that it learned next to nothing; a run that learns the clean labels but
not the noisy ones ends well below that). With symmetric label noise on the
training labels (test labels clean; the SAM label-noise study of
RESULTS.md):

  python -m launch.sam_study --workdir=workdirs/sam_noise40 \
    --config_arg=label_noise=0.4 --rhos=0.05,0.2,0.5,1.0,2.0

With data for a standard TFDS set:

  python -m launch.sam_study --workdir=/tmp/c10 --dataset=cifar10 \
    --data_dir=gs://BUCKET/tensorflow_datasets
"""

import json
import math
import os
import statistics

from absl import app
from absl import flags
from absl import logging

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/sam_study', 'Root dir.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per setting.')
_RHOS = flags.DEFINE_list(
    'rhos', ['0.02', '0.05', '0.1', '0.2', '0.5', '1.0', '2.0'], 'SAM radii.')
_METHODS = flags.DEFINE_list('methods', ['sgd', 'sam', 'sam_warmstart', 'asam'],
                             'Methods.')
_WARMSTART = flags.DEFINE_integer(
    'warmstart_steps', 100, 'Plain steps before SAM for sam_warmstart.')
_DATASET = flags.DEFINE_string('dataset', 'digits', 'config.dataset')
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'config.data_dir')
_CONFIG_ARG = flags.DEFINE_string(
    'config_arg', '', 'Argument of configs/digits.py (e.g. runlocal, '
    'dataset=mnist5k, label_noise=0.4).')


def run_config(method: str, rho: float, seed: int):
  from configs import digits  # pylint: disable=g-import-not-at-top
  config = digits.get_config(_CONFIG_ARG.value or None)
  config.seed = seed
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
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return [r for r in records if 'train_loss' in r]


def stalled(records: list[dict], num_classes: int) -> bool:
  """The training loss's mean over the last fifth of the logged steps is
  above 0.9 ln(num_classes): near a uniform guess's, nothing learned."""
  losses = [r['train_loss'] for r in records]
  k = max(1, len(losses) // 5)
  return statistics.mean(losses[-k:]) > 0.9 * math.log(num_classes)


def summarize(results: dict) -> str:
  def mean_std(values):
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f'{100 * m:.2f} +- {100 * s:.2f}'

  lines = ['| method | rho | test accuracy % (mean +- std) | seeds | '
           'val accuracy % | SAM steps | runs flagged | flagged steps '
           '(mean) | \\|g+\\|/\\|g\\| EMA at end | runs whose loss '
           'stalled |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for (method, rho), runs in results.items():
    flagged = [r.get('opt/hallucination_steps', 0.0) for r in runs]
    n_flagged = sum(f > 0 for f in flagged)
    n_stalled = sum(bool(r.get('stalled')) for r in runs)
    sam_steps = [r.get('opt/sam_steps', 0.0) for r in runs]
    ratio = [r['opt/grad_ratio_ema'] for r in runs
             if r.get('opt/sam_steps', 0) > 0]
    lines.append(
        f'| {method} | {"-" if method == "sgd" else f"{rho:g}"} | '
        f'{mean_std([r["test_accuracy"] for r in runs])} | {len(runs)} | '
        f'{mean_std([r["val_accuracy"] for r in runs])} | '
        f'{statistics.mean(sam_steps):.0f} | {n_flagged}/{len(runs)} | '
        f'{statistics.mean(flagged):.1f} | '
        f'{f"{statistics.mean(ratio):.3f}" if ratio else "-"} | '
        f'{n_stalled}/{len(runs)} |')
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  from train import host_devices  # pylint: disable=g-import-not-at-top
  host_devices.configure_cpu_devices(run_config('sgd', 0.0, 0).cpu_devices)
  from train.vision import datasets  # pylint: disable=g-import-not-at-top
  from train.vision import trainer  # pylint: disable=g-import-not-at-top
  results = {}
  for method in _METHODS.value:
    rhos = [0.0] if method == 'sgd' else [float(r) for r in _RHOS.value]
    for rho in rhos:
      runs = []
      for seed in range(_SEEDS.value):
        name = f'{method}_rho{rho:g}_seed{seed}'
        workdir = os.path.join(_WORKDIR.value, name)
        final = trainer.train_and_evaluate(run_config(method, rho, seed),
                                           workdir)
        record = dict(final)
        records = train_records(workdir)
        record.update({k: v for k, v in records[-1].items()
                       if k.startswith('opt/')})
        record['stalled'] = stalled(records, datasets.get_spec(
            _DATASET.value).num_classes)
        runs.append(record)
        logging.info('%s: test accuracy %.4f', name, final['test_accuracy'])
      results[(method, rho)] = runs
  text = summarize(results)
  with open(os.path.join(_WORKDIR.value, 'study.md'), 'w') as f:
    f.write(text)
  with open(os.path.join(_WORKDIR.value, 'study.json'), 'w') as f:
    json.dump({f'{m}/{r}': v for (m, r), v in results.items()}, f, indent=1)
  print(text)


if __name__ == '__main__':
  app.run(main)
