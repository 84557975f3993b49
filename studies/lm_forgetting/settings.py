"""The study's settings (the flags of `python -m studies.lm_forgetting`),
checked before anything is trained."""

import dataclasses
import os

from train.analysis import stats
from train.errors import UsageError
from train.lm import data as lm_data

VARIANTS = ('baseline', 'sam', 'sam_mid', 'large_lr', 'short_anneal')


@dataclasses.dataclass(frozen=True)
class Settings:
  """Each field is the flag of the same name."""
  workdir: str = 'workdirs/forgetting'
  config_arg: str = 'forgetting'
  seeds: int = 3
  variants: tuple[str, ...] = VARIANTS
  rho: float = 0.05
  mid_steps: int = 400
  large_lr: float = 1e-2
  anneal_fraction: float = 0.1
  post_source: str = 'attribute'
  post_steps: int = 400
  post_lr: float = 1e-3
  bits: int = 4
  hessian_windows: int = 64
  power_iters: int = 30
  trace_samples: int = 32

  def check(self, pretrain) -> None:
    """UsageError naming the flag, before anything is trained (`pretrain`:
    the baseline's pretraining config)."""
    unknown = [v for v in self.variants if v not in VARIANTS]
    if unknown or not self.variants:
      raise UsageError('--variants', unknown[0] if unknown else '',
                       'unknown variant', VARIANTS)
    if 'baseline' not in self.variants:
      raise UsageError('--variants', ','.join(self.variants),
                       'must include baseline (forgetting is relative to it)')
    stats.check_seed_count('--seeds', self.seeds)
    n = pretrain.num_steps
    if 'sam_mid' in self.variants and not 0 < self.mid_steps < n:
      raise UsageError('--mid_steps', self.mid_steps,
                       f'the SAM window must lie inside the pretraining run: '
                       f'need 0 < mid_steps < num_steps={n}')
    source = self.post_source
    if source not in lm_data.SOURCES and not os.path.isdir(source):
      raise UsageError('--post_source', source, 'unknown post-training '
                       'source (or not a directory of .txt files)',
                       lm_data.SOURCES)
    if lm_data.source_names(pretrain.data) == [source]:
      raise UsageError('--post_source', source, 'is the pretraining data: '
                       'post-training must move to another distribution')
    for flag, value, ok, what in (
        ('--rho', self.rho, self.rho > 0, '> 0'),
        ('--large_lr', self.large_lr, self.large_lr > 0, '> 0'),
        ('--anneal_fraction', self.anneal_fraction,
         0 < self.anneal_fraction <= 1, 'in (0, 1]'),
        ('--post_steps', self.post_steps, self.post_steps >= 1, '>= 1'),
        ('--post_lr', self.post_lr, self.post_lr > 0, '> 0'),
        ('--bits', self.bits, 2 <= self.bits <= 16, 'in [2, 16]')):
      if not ok:
        raise UsageError(flag, value, f'must be {what}')
