r"""Test-time adaptation studies on mnist5k's corrupted test sets, over seeds.

  python -m studies.tta --study=table --workdir=workdirs/tta_study
  python -m studies.tta --study=rates --workdir=workdirs/tta_study
  python -m studies.tta --study=norm --workdir=workdirs/tta_study

Runs the grid of `studies.tta.grids` and writes `<study>.md` and
`<study>.json` (the raw errors) in `--workdir`, and `rates.png`.

- `table`: error % of source, BN statistics, TENT, EATA and SAR, each with
  a fixed rate and with CONGA, on the episodic, continual and mixed
  streams at severity 5, and on the episodic stream averaged over
  severities 1-5 (`--mean_protocols`).
- `rates`: error % against the base learning rate (`--rates`, two decades
  or more), fixed vs CONGA, for TENT, EATA and SAR on one stream
  (`--protocol`, severity 5), with the spread over the grid (worst minus
  best) per method and schedule.
- `norm`: the failure modes of batch statistics. Sources with BatchNorm,
  GroupNorm and LayerNorm (`--norms`; the CNN's `norm` field) adapted
  with a fixed rate on the episodic stream at severity 5, at each batch
  size of `--norm_batch_sizes`, with the test images shuffled and sorted
  by class (label shift: a batch holds one or two classes).

`--runlocal` shrinks sources and streams to the configs' `runlocal` (the
suite runs the README's commands that way).
"""

import json
import math
import os

from absl import app
from absl import flags
import ml_collections

from studies.tta import grids
from studies.tta import report
from train.training import experiment
from train.analysis import stats
from train.run.job import open_job
from train.errors import UsageError
from train.jobs import entry
from train.tta import methods
from train.tta import streams
from train.vision import models

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/tta_study', 'Root dir.')
_STUDY = flags.DEFINE_enum('study', 'table', ['table', 'rates', 'norm'],
                           'Which study.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds (source model and stream).')
_SEVERITIES = flags.DEFINE_list('severities', ['1', '2', '3', '4', '5'],
                                'Severities (table).')
_PROTOCOLS = flags.DEFINE_list('protocols', ['episodic', 'continual', 'mixed'],
                               'Streams (table).')
_MEAN_PROTOCOLS = flags.DEFINE_list(
    'mean_protocols', ['episodic'],
    'Streams (table) also run at every severity for the mean over them.')
_PROTOCOL = flags.DEFINE_string('protocol', 'continual', 'Stream (rates).')
_RATES = flags.DEFINE_list(
    'rates', ['1e-4', '3e-4', '1e-3', '3e-3', '1e-2', '3e-2', '1e-1'],
    'Base learning rates (rates).')
_METHODS = flags.DEFINE_list('methods', ['tent', 'eata', 'sar'],
                             'Adapting methods (rates).')
_NORMS = flags.DEFINE_list('norms', ['batch', 'group', 'layer'],
                           "The source CNN's normalisations (norm).")
_NORM_BATCHES = flags.DEFINE_list('norm_batch_sizes', ['64', '8', '1'],
                                  'Test batch sizes (norm).')
_NORM_METHODS = flags.DEFINE_list('norm_methods',
                                  ['bn_stats', 'tent', 'eata', 'sar'],
                                  'Methods besides the source (norm).')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'config.batch_size')
_SOURCE_ARG = flags.DEFINE_string('source_arg', 'dataset=mnist5k',
                                  'Argument of configs/digits.py.')
_FEATURES = flags.DEFINE_list(
    'features', ['16', '32'],
    "The source CNN's conv widths (half the digits default: XLA:CPU "
    'convolution gradients dominate the study\'s time).')
_RUNLOCAL = flags.DEFINE_bool(
    'runlocal', False, "Sources and streams at the configs' runlocal size "
    '(configs/digits.py, configs/tta.py).')


def check_flags() -> None:
  """UsageError naming the first bad flag, before anything is trained."""

  def values(flag):
    items = flag.value if isinstance(flag.value, list) else [flag.value]
    if not items:
      raise UsageError(f'--{flag.name}', '', 'is empty')
    return items

  def numbers(flag, kind, ok, what):
    for text in values(flag):
      try:
        valid = ok(kind(text))
      except ValueError:
        valid = False
      if not valid:
        raise UsageError(f'--{flag.name}', text, f'must be {what}')

  def among(flag, choices):
    for value in values(flag):
      if value not in choices:
        raise UsageError(f'--{flag.name}', value, 'unknown', choices)

  at_least_1 = lambda v: v >= 1
  stats.check_seed_count('--seeds', _SEEDS.value)
  numbers(_SEVERITIES, int, lambda v: 1 <= v <= 5, 'an integer in 1-5')
  among(_PROTOCOLS, streams.PROTOCOLS)
  if _MEAN_PROTOCOLS.value:
    among(_MEAN_PROTOCOLS, streams.PROTOCOLS)
  among(_PROTOCOL, streams.PROTOCOLS)
  numbers(_RATES, float, lambda v: 0 < v < math.inf, 'a number > 0')
  # The rates study varies a learning rate: the methods that have one.
  among(_METHODS, [m for m in methods.METHODS
                   if m not in ('source', 'bn_stats')])
  among(_NORMS, models.NORMS)
  numbers(_NORM_BATCHES, int, at_least_1, 'an integer >= 1')
  among(_NORM_METHODS, [m for m in methods.METHODS if m != 'source'])
  numbers(_BATCH, int, at_least_1, 'an integer >= 1')
  numbers(_FEATURES, int, at_least_1, 'an integer >= 1')


def study_from_flags() -> grids.Study:
  return grids.Study(
      workdir=_WORKDIR.value, seeds=_SEEDS.value,
      severities=tuple(int(s) for s in _SEVERITIES.value),
      protocols=tuple(_PROTOCOLS.value),
      mean_protocols=tuple(_MEAN_PROTOCOLS.value), protocol=_PROTOCOL.value,
      rates=tuple(float(r) for r in _RATES.value),
      methods=tuple(_METHODS.value), norms=tuple(_NORMS.value),
      norm_batch_sizes=tuple(int(b) for b in _NORM_BATCHES.value),
      norm_methods=tuple(_NORM_METHODS.value), batch_size=_BATCH.value,
      source_arg=_SOURCE_ARG.value,
      features=tuple(int(f) for f in _FEATURES.value),
      runlocal=_RUNLOCAL.value)


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    check_flags()
    entry.configure_devices(ml_collections.ConfigDict({'cpu_devices': 8}))
    root = experiment.check_workdir(_WORKDIR.value)
    study = study_from_flags()
    name = _STUDY.value
    # One study per workdir (its runs below lock their own directories).
    with open_job(root):
      raw = {'table': grids.table, 'rates': grids.rates,
             'norm': grids.norm}[name](study)
      text = {'table': report.table, 'rates': report.rates,
              'norm': report.norm}[name](study, raw)
      if name == 'rates':
        report.plot_rates(study, raw, os.path.join(root, 'rates.png'))
      base = os.path.join(root, name)
      with open(base + '.md', 'w') as f:
        f.write(text + '\n')
      with open(base + '.json', 'w') as f:
        json.dump(raw, f, indent=1, sort_keys=True)
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
