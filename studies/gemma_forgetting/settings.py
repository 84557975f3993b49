"""The study's settings and the trainer config of each (variant, seed).

Variants of the same recipe (the config's SFT fine-tuning), one resumable
trainer run per (variant, seed):

  adamw        the config's optimizer (AdamW) with SAM off;
  sam_rho<r>   SAM of radius r (the config's `optimizer.sam` otherwise)
               around the same AdamW, same learning rate and steps, for
               each r of `rhos`: SAM's radius trades fit for flatness, so
               more than one shows whether less forgetting only follows
               from learning less.
"""

import dataclasses

import ml_collections

from train.errors import UsageError
from train.jobs import sam_flags
from train.lm import models
from train.rl import sft

REFERENCE = 'adamw'
SAM_PREFIX = 'sam_rho'


@dataclasses.dataclass(frozen=True)
class Settings:
  """The study's own settings (flags of `python -m studies.gemma_forgetting`)."""
  seeds: int = 3
  rhos: tuple[float, ...] = (0.05,)
  windows: int = 32
  window_len: int = 128
  sharpness_iters: int = 0
  sharpness_problems: int = 32

  @property
  def variants(self) -> tuple[str, ...]:
    return (REFERENCE,) + tuple(f'{SAM_PREFIX}{r:g}' for r in self.rhos)

  def check(self) -> None:
    """UsageError naming the flag, before anything is loaded or trained."""
    sam_flags.radii('--rhos', self.rhos)
    for flag, ok, what in (
        ('--seeds', 1 <= self.seeds <= 100, 'in [1, 100]'),
        ('--windows', 2 <= self.windows <= 4096, 'in [2, 4096]'),
        ('--window_len', 8 <= self.window_len <= 2048, 'in [8, 2048]'),
        ('--sharpness_iters', 0 <= self.sharpness_iters <= 1000,
         'in [0, 1000]'),
        ('--sharpness_problems', 1 <= self.sharpness_problems <= 4096,
         'in [1, 4096]')):
      if not ok:
        raise UsageError(flag, getattr(self, flag[2:]), f'must be {what}')


def check_config(base: ml_collections.ConfigDict) -> None:
  """UsageError naming the field unless `base` fine-tunes a pretrained
  model on the tasks (and builds: every field checked, nothing read)."""
  if base.get('task') != sft.TASK or models.kind(base) != 'gemma':
    raise UsageError('--config', base.get('task'),
                     "the study fine-tunes a Gemma on the tasks: "
                     "studies/gemma_forgetting/config.py")
  if base.optimizer.sam.enabled:
    raise UsageError('--config.optimizer.sam.enabled', True,
                     'the study turns SAM on for its sam_rho<r> variants '
                     'alone (--rhos)')
  sft.check_config(base)
  models.check_config(base)


def run_config(base: ml_collections.ConfigDict, variant: str, seed: int
               ) -> ml_collections.ConfigDict:
  """The trainer config of one (variant, seed)."""
  config = ml_collections.ConfigDict(base.to_dict())
  config.seed = seed
  if variant.startswith(SAM_PREFIX):
    config.optimizer.sam.enabled = True
    config.optimizer.sam.rho = float(variant[len(SAM_PREFIX):])
  return config
