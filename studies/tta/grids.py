"""The TTA study's runs: source CNNs and adaptation runs over seeds, as grids.

Each seed trains its own source CNN (`configs/digits.py`, that seed) into
`<workdir>/source_<seed>` (`source_<norm>_<seed>` for GroupNorm and
LayerNorm); the stream's shuffling uses the same seed. Every adaptation
run has its own workdir below the study's (a finished run is read back,
an interrupted one resumes). Each grid returns its raw errors, keyed
`a|b|...|seed`, which `studies.tta.report` tabulates.
"""

import dataclasses
import os

from absl import logging

from configs import digits
from configs import tta
from train.tta import adapt
from train.vision import trainer

# (label, method, schedule) of the table.
TABLE_ROWS = [
    ('source', 'source', 'fixed'), ('BN stats', 'bn_stats', 'fixed'),
    ('TENT', 'tent', 'fixed'), ('TENT+CONGA', 'tent', 'conga'),
    ('EATA', 'eata', 'fixed'), ('EATA+CONGA', 'eata', 'conga'),
    ('SAR', 'sar', 'fixed'), ('SAR+CONGA', 'sar', 'conga'),
]

# The norm study's orders of the test images within each corruption.
ORDERS = ('shuffled', 'by_class')


@dataclasses.dataclass(frozen=True)
class Study:
  """What `python -m studies.tta` measures (its flags, parsed)."""
  workdir: str
  seeds: int = 3
  severities: tuple[int, ...] = (1, 2, 3, 4, 5)
  protocols: tuple[str, ...] = ('episodic', 'continual', 'mixed')
  mean_protocols: tuple[str, ...] = ('episodic',)
  protocol: str = 'continual'
  rates: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
  methods: tuple[str, ...] = ('tent', 'eata', 'sar')
  norms: tuple[str, ...] = ('batch', 'group', 'layer')
  norm_batch_sizes: tuple[int, ...] = (64, 8, 1)
  norm_methods: tuple[str, ...] = ('bn_stats', 'tent', 'eata', 'sar')
  batch_size: int = 64
  source_arg: str = 'dataset=mnist5k'
  features: tuple[int, ...] = (16, 32)
  # Tests: the sources and streams of the configs' `runlocal`.
  runlocal: bool = False


def _source_dir(study: Study, seed: int, norm: str = 'batch') -> str:
  # BatchNorm sources keep the table's and the rates study's names.
  return os.path.join(study.workdir, f'source_{seed}' if norm == 'batch'
                      else f'source_{norm}_{seed}')


def _source(study: Study, seed: int, norm: str = 'batch') -> str:
  workdir = _source_dir(study, seed, norm)
  config = digits.get_config(
      ('runlocal,' if study.runlocal else '') + study.source_arg
      + ('' if norm == 'batch' else f',norm={norm}'))
  config.seed = seed
  config.model.features = study.features
  final = trainer.train_and_evaluate(config, workdir)
  logging.info('source %s %d: test accuracy %.4f', norm, seed,
               final['test_accuracy'])
  return workdir


def _adapt(study: Study, seed: int, method: str, schedule: str,
           protocol: str, severity: int, rate: float | None = None,
           norm: str = 'batch', batch_size: int | None = None,
           order: str = 'shuffled') -> float:
  """The mean error of one adaptation run."""
  config = tta.get_config(('runlocal,' if study.runlocal else '')
                          + f'method={method},schedule={schedule},'
                          f'protocol={protocol}')
  config.seed = seed
  config.severity = severity
  config.batch_size = batch_size or study.batch_size
  config.order = order
  config.source_workdir = _source_dir(study, seed, norm)
  config.checkpoint_every = 1000
  if rate is not None:
    config.method.learning_rate = rate
  name = (f'{method}_{schedule}_{protocol}_s{severity}_seed{seed}'
          + ('' if rate is None else f'_lr{rate:g}')
          + ('' if norm == 'batch' else f'_{norm}')
          + ('' if batch_size is None else f'_b{batch_size}')
          + ('' if order == 'shuffled' else f'_{order}'))
  return adapt.adapt_and_evaluate(
      config, os.path.join(study.workdir, name))['mean_error']


def table(study: Study) -> dict[str, float]:
  """Every method of TABLE_ROWS on every stream at severity 5, and at each
  severity on the mean protocols: `label|protocol|severity|seed`."""
  raw = {}
  for seed in range(study.seeds):
    _source(study, seed)
    for label, method, schedule in TABLE_ROWS:
      for protocol in study.protocols:
        for severity in (study.severities
                         if protocol in study.mean_protocols else [5]):
          raw[f'{label}|{protocol}|{severity}|{seed}'] = _adapt(
              study, seed, method, schedule, protocol, severity)
  return raw


def rates(study: Study) -> dict[str, float]:
  """Each method, fixed and CONGA, at each base rate on one stream at
  severity 5: `method|schedule|rate|seed`."""
  raw = {}
  for seed in range(study.seeds):
    _source(study, seed)
    for method in study.methods:
      for schedule in ('fixed', 'conga'):
        for rate in study.rates:
          raw[f'{method}|{schedule}|{rate:g}|{seed}'] = _adapt(
              study, seed, method, schedule, study.protocol, 5, rate)
  return raw


def norm(study: Study) -> dict[str, float]:
  """Each norm's source, and each method adapted with a fixed rate, at each
  batch size and order on the episodic stream at severity 5:
  `norm|method|batch size|order|seed`. The source model's predictions do
  not depend on the batch or the order (running statistics, or none), so
  it runs once per norm and seed."""
  sizes = study.norm_batch_sizes
  raw = {}
  for seed in range(study.seeds):
    for norm_name in study.norms:
      _source(study, seed, norm_name)
      source = _adapt(study, seed, 'source', 'fixed', 'episodic', 5,
                      norm=norm_name, batch_size=sizes[0])
      for method in ['source'] + list(study.norm_methods):
        # Without BatchNorm there are no statistics to replace.
        if method == 'bn_stats' and norm_name != 'batch':
          continue
        for size in sizes:
          for order in ORDERS:
            raw[f'{norm_name}|{method}|{size}|{order}|{seed}'] = (
                source if method == 'source' else _adapt(
                    study, seed, method, 'fixed', 'episodic', 5,
                    norm=norm_name, batch_size=size, order=order))
  return raw
