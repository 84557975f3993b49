"""The SAM study's training runs: one config per method, rho and seed, trained or resumed.

`Study` holds what the command line chose; `Study.config(method, rho,
seed)` is the run's config (`configs/digits.py` or `configs/lm.py` with
SAM set for the method); `train_all` trains every run not yet finished,
each in its own workdir below `Study.root`, and returns per (method, rho)
the runs' final metrics with the optimizer's last statistics, the late
training loss and whether the run stalled.
"""

import dataclasses
import math
import os
import statistics

from absl import logging

from train.run import metrics
from train.jobs import trainers
from train.vision import datasets

# The recipes the first studies compared (the default), then SAM's cheaper
# variants: LookSAM's reuse with g+ every k steps, and AE-SAM's switch
# (g+ when |g|^2 >= its running mean + c std: c = 0, or the paper's c
# rising linearly from -1 to 1 over the run).
RECIPES = ('sgd', 'sam', 'sam_warmstart', 'asam')
LOOKSAM = {'looksam2': 2, 'looksam5': 5, 'looksam10': 10}
AESAM = {'aesam': (0.0, 0.0), 'aesam_linear': (-1.0, 1.0)}
METHODS = RECIPES + tuple(LOOKSAM) + tuple(AESAM)
EXPERIMENTS = ('digits', 'lm')


@dataclasses.dataclass(frozen=True)
class Study:
  root: str
  experiment: str = 'digits'
  config_arg: str = ''
  methods: tuple[str, ...] = RECIPES
  rhos: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
  asam_rhos: tuple[float, ...] | None = None  # None: `rhos`.
  seeds: int = 3
  warmstart_steps: int = 100
  num_steps: int | None = None  # None: the config's.
  dataset: str | None = None
  data_dir: str | None = None

  def config(self, method: str, rho: float, seed: int):
    """The run's config: the experiment's, with SAM set for `method`."""
    # pylint: disable=g-import-not-at-top
    if self.experiment == 'lm':
      from configs import lm as module
    else:
      from configs import digits as module
    config = module.get_config(self.config_arg or None)
    config.seed = seed
    if self.num_steps:
      config.num_steps = self.num_steps
    if self.dataset:
      config.dataset = self.dataset
    if self.data_dir:
      config.data_dir = self.data_dir
    sam = config.optimizer.sam
    if method != 'sgd':
      sam.enabled = True
      sam.rho = rho
      sam.adaptive = method == 'asam'
      if method == 'sam_warmstart':
        sam.warmup_steps = self.warmstart_steps
      sam.every = LOOKSAM.get(method, 1)
      sam.ae.enabled = method in AESAM
      if method in AESAM:
        sam.ae.margin_start, sam.ae.margin_end = AESAM[method]
    return config

  def radii(self, method: str) -> tuple[float, ...]:
    if method == 'sgd':
      return (0.0,)
    if method == 'asam' and self.asam_rhos:
      return self.asam_rhos
    return self.rhos


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


def train_all(study: Study) -> dict:
  """Trains every (method, rho, seed) not yet finished; their records."""
  results = {}
  for method in study.methods:
    for rho in study.radii(method):
      runs = []
      for seed in range(study.seeds):
        name = f'{method}_rho{rho:g}_seed{seed}'
        workdir = os.path.join(study.root, name)
        config = study.config(method, rho, seed)
        final = trainers.train_and_evaluate(config, workdir)
        record = dict(final)
        records = train_records(workdir)
        record.update({k: v for k, v in records[-1].items()
                       if k.startswith('opt/')})
        record['late_train_loss'] = late_loss(records)
        record['num_steps'] = config.num_steps
        record['stalled'] = stalled(records, num_classes(config))
        runs.append(record)
        logging.info('%s: test accuracy %.4f', name, final['test_accuracy'])
      results[(method, rho)] = runs
  return results
