r"""Test-time adaptation studies on mnist5k's corrupted test sets, over seeds.

  python -m launch.tta_study --study=table --workdir=workdirs/tta_study
  python -m launch.tta_study --study=rates --workdir=workdirs/tta_study
  python -m launch.tta_study --study=norm --workdir=workdirs/tta_study

Each seed trains its own source CNN (`configs/digits.py:dataset=mnist5k`,
that seed) into `<workdir>/source_<seed>`; the stream's shuffling uses the
same seed. Every adaptation run has its own workdir below `--workdir` (a
finished run is read back, an interrupted one resumes), and the study
writes `<study>.md` and `<study>.json` there (and `rates.png`).

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
  by class (label shift: a batch holds one or two classes). The source
  model's predictions do not depend on the batch or the order (running
  statistics, or none), so it runs once per norm and seed.
"""

import json
import math
import os
import statistics

from absl import app
from absl import flags
from absl import logging
import ml_collections

from configs import digits
from configs import tta
from launch import entry
from train import experiment
from train import plots
from train import stats
from train import workdir_lock
from train.errors import UsageError
from train.tta import adapt
from train.tta import methods
from train.tta import streams
from train.vision import models
from train.vision import trainer

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

# (label, method, schedule) of the table.
TABLE_ROWS = [
    ('source', 'source', 'fixed'), ('BN stats', 'bn_stats', 'fixed'),
    ('TENT', 'tent', 'fixed'), ('TENT+CONGA', 'tent', 'conga'),
    ('EATA', 'eata', 'fixed'), ('EATA+CONGA', 'eata', 'conga'),
    ('SAR', 'sar', 'fixed'), ('SAR+CONGA', 'sar', 'conga'),
]


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


def _source_dir(seed: int, norm: str = 'batch') -> str:
  # BatchNorm sources keep the table's and the rates study's names.
  return os.path.join(_WORKDIR.value, f'source_{seed}' if norm == 'batch'
                      else f'source_{norm}_{seed}')


def _source(seed: int, norm: str = 'batch') -> str:
  workdir = _source_dir(seed, norm)
  config = digits.get_config(_SOURCE_ARG.value + (
      '' if norm == 'batch' else f',norm={norm}'))
  config.seed = seed
  config.model.features = tuple(int(f) for f in _FEATURES.value)
  final = trainer.train_and_evaluate(config, workdir)
  logging.info('source %s %d: test accuracy %.4f', norm, seed,
               final['test_accuracy'])
  return workdir


def _adapt(seed: int, method: str, schedule: str, protocol: str,
           severity: int, rate: float | None = None, norm: str = 'batch',
           batch_size: int | None = None, order: str = 'shuffled') -> dict:
  config = tta.get_config(f'method={method},schedule={schedule},'
                          f'protocol={protocol}')
  config.seed = seed
  config.severity = severity
  config.batch_size = batch_size or _BATCH.value
  config.order = order
  config.source_workdir = _source_dir(seed, norm)
  config.checkpoint_every = 1000
  if rate is not None:
    config.method.learning_rate = rate
  name = (f'{method}_{schedule}_{protocol}_s{severity}_seed{seed}'
          + ('' if rate is None else f'_lr{rate:g}')
          + ('' if norm == 'batch' else f'_{norm}')
          + ('' if batch_size is None else f'_b{batch_size}')
          + ('' if order == 'shuffled' else f'_{order}'))
  return adapt.adapt_and_evaluate(config, os.path.join(_WORKDIR.value, name))


def table() -> tuple[str, dict]:
  seeds = range(_SEEDS.value)
  severities = [int(s) for s in _SEVERITIES.value]
  raw = {}
  for seed in seeds:
    _source(seed)
    for label, method, schedule in TABLE_ROWS:
      for protocol in _PROTOCOLS.value:
        for severity in (severities if protocol in _MEAN_PROTOCOLS.value
                         else [5]):
          result = _adapt(seed, method, schedule, protocol, severity)
          raw[f'{label}|{protocol}|{severity}|{seed}'] = result['mean_error']
  averaged = [p for p in _PROTOCOLS.value if p in _MEAN_PROTOCOLS.value]
  head = ['method'] + [f'{p} sev 5' for p in _PROTOCOLS.value] + [
      f'{p} sev {severities[0]}-{severities[-1]}' for p in averaged]
  rows = []
  for label, _, _ in TABLE_ROWS:
    cells = [label]
    for protocol in _PROTOCOLS.value:
      cells.append(stats.mean_std([raw[f'{label}|{protocol}|5|{s}']
                              for s in seeds]))
    for protocol in averaged:
      cells.append(stats.mean_std([
          statistics.mean(raw[f'{label}|{protocol}|{v}|{s}']
                          for v in severities) for s in seeds]))
    rows.append(cells)
  return stats.markdown_table(head, rows), raw


def rates() -> tuple[str, dict]:
  seeds = range(_SEEDS.value)
  grid = [float(r) for r in _RATES.value]
  raw = {}
  for seed in seeds:
    _source(seed)
    for method in _METHODS.value:
      for schedule in ('fixed', 'conga'):
        for rate in grid:
          result = _adapt(seed, method, schedule, _PROTOCOL.value, 5, rate)
          raw[f'{method}|{schedule}|{rate:g}|{seed}'] = result['mean_error']
  head = ['method', 'schedule'] + [f'{r:g}' for r in grid] + [
      'best', 'worst - best']
  rows, summary = [], {}
  for method in _METHODS.value:
    for schedule in ('fixed', 'conga'):
      means = [statistics.mean(raw[f'{method}|{schedule}|{r:g}|{s}']
                               for s in seeds) for r in grid]
      cells = [stats.mean_std([raw[f'{method}|{schedule}|{r:g}|{s}']
                          for s in seeds]) for r in grid]
      # The spread per seed, then its mean and deviation over seeds.
      spreads = [max(raw[f'{method}|{schedule}|{r:g}|{s}'] for r in grid)
                 - min(raw[f'{method}|{schedule}|{r:g}|{s}'] for r in grid)
                 for s in seeds]
      bests = [min(raw[f'{method}|{schedule}|{r:g}|{s}'] for r in grid)
               for s in seeds]
      summary[f'{method}|{schedule}'] = {'means': means, 'spreads': spreads,
                                         'bests': bests}
      rows.append([method, schedule, *cells, stats.mean_std(bests),
                   stats.mean_std(spreads)])
  _plot_rates(grid, summary)
  return stats.markdown_table(head, rows, 'll' + 'r' * (len(head) - 2)), raw


def norm() -> tuple[str, dict]:
  seeds = range(_SEEDS.value)
  sizes = [int(b) for b in _NORM_BATCHES.value]
  orders = ('shuffled', 'by_class')
  raw = {}
  for seed in seeds:
    for norm_name in _NORMS.value:
      _source(seed, norm_name)
      source = _adapt(seed, 'source', 'fixed', 'episodic', 5, norm=norm_name,
                      batch_size=sizes[0])['mean_error']
      for method in ['source'] + _NORM_METHODS.value:
        # Without BatchNorm there are no statistics to replace.
        if method == 'bn_stats' and norm_name != 'batch':
          continue
        for size in sizes:
          for order in orders:
            raw[f'{norm_name}|{method}|{size}|{order}|{seed}'] = (
                source if method == 'source' else _adapt(
                    seed, method, 'fixed', 'episodic', 5, norm=norm_name,
                    batch_size=size, order=order)['mean_error'])
  head = ['norm', 'method'] + [f'batch {b}, {o}' for o in orders
                               for b in sizes]
  rows = []
  for norm_name in _NORMS.value:
    for method in ['source'] + _NORM_METHODS.value:
      if f'{norm_name}|{method}|{sizes[0]}|shuffled|0' not in raw:
        continue
      rows.append([norm_name, method] + [
          stats.mean_std([raw[f'{norm_name}|{method}|{b}|{o}|{s}']
                          for s in seeds]) for o in orders for b in sizes])
  return stats.markdown_table(head, rows, 'll' + 'r' * (len(head) - 2)), raw


def _plot_rates(grid, summary) -> None:
  plt = plots.pyplot()
  names = _METHODS.value
  fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8),
                           sharey=True)
  for ax, method in zip(list(axes) if len(names) > 1 else [axes], names):
    for schedule, style in (('fixed', 'o-'), ('conga', 's-')):
      ax.plot(grid, summary[f'{method}|{schedule}']['means'], style,
              label=schedule)
    ax.set_xscale('log')
    ax.set_xlabel('base learning rate')
    ax.set_title(f'{method}, {_PROTOCOL.value}, severity 5')
    ax.grid(alpha=0.3)
    ax.legend()
  axes_list = list(axes) if len(names) > 1 else [axes]
  axes_list[0].set_ylabel(f'error % (mean of {_SEEDS.value} seeds)')
  plots.save_png(fig, os.path.join(_WORKDIR.value, 'rates.png'))


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    check_flags()
    entry.configure_devices(ml_collections.ConfigDict({'cpu_devices': 8}))
    root = experiment.check_workdir(_WORKDIR.value)
    # One study per workdir (its runs below lock their own directories).
    with workdir_lock.hold(root):
      text, raw = {'table': table, 'rates': rates,
                   'norm': norm}[_STUDY.value]()
      base = os.path.join(root, _STUDY.value)
      with open(base + '.md', 'w') as f:
        f.write(text + '\n')
      with open(base + '.json', 'w') as f:
        json.dump(raw, f, indent=1, sort_keys=True)
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
