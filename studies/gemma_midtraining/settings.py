"""The study's settings and the trainer configs of each (variant, seed).

Variants of the mid-trained model (one resumable trainer run each):

  checkpoint   the registry's checkpoint itself, not mid-trained (one
               model for every seed);
  adamw        mid-trained with the config's AdamW: the control for
               "SAM, not more training" (same tokens, steps and rate);
  sam_rho<r>   mid-trained with SAM of radius r around the same AdamW,
               for each r of `rhos`.

Each is then post-trained (the config's arithmetic fine-tune, one run per
seed, the checkpoint's from the model file) and quantised to 4 bits.
Seed s sets the data order of both phases, shared by the variants, so the
seeds pair.
"""

import dataclasses
import os

import ml_collections

from train.errors import UsageError
from train.jobs import sam_flags
from train.lm import models
from train.lm import trainer as lm_trainer
from train.rl import sft

CHECKPOINT = 'checkpoint'
REFERENCE = 'adamw'
SAM_PREFIX = 'sam_rho'
PAPER = {'post': 0.31, 'quant': 0.40}  # Reductions in the abstract.


@dataclasses.dataclass(frozen=True)
class Settings:
  """The study's own settings (flags of `python -m studies.gemma_midtraining`)."""
  seeds: int = 3
  rhos: tuple[float, ...] = (0.05, 0.01)
  windows: int = 32
  window_len: int = 128
  bits: int = 4
  group_size: int = 32
  lanczos_steps: int = 20
  trace_probes: int = 4
  sharpness_windows: int = 4

  @property
  def midtrained(self) -> tuple[str, ...]:
    return (REFERENCE,) + tuple(f'{SAM_PREFIX}{r:g}' for r in self.rhos)

  @property
  def variants(self) -> tuple[str, ...]:
    return (CHECKPOINT,) + self.midtrained

  def check(self) -> None:
    """UsageError naming the flag, before anything is loaded or trained."""
    sam_flags.radii('--rhos', self.rhos)
    for flag, ok, what in (
        ('--seeds', 1 <= self.seeds <= 100, 'in [1, 100]'),
        ('--windows', 2 <= self.windows <= 4096, 'in [2, 4096]'),
        ('--window_len', 8 <= self.window_len <= 2048, 'in [8, 2048]'),
        ('--bits', 2 <= self.bits <= 8, 'in [2, 8]'),
        ('--group_size', 0 <= self.group_size <= 65536,
         'in [0, 65536] (0: one scale per channel)'),
        ('--lanczos_steps', 0 <= self.lanczos_steps <= 1000,
         'in [0, 1000]'),
        ('--trace_probes', 0 <= self.trace_probes <= 1000, 'in [0, 1000]'),
        ('--sharpness_windows', 1 <= self.sharpness_windows <= 4096,
         'in [1, 4096]')):
      if not ok:
        raise UsageError(flag, getattr(self, flag[2:]), f'must be {what}')


def check_config(base: ml_collections.ConfigDict) -> None:
  """UsageError naming the field unless `base` holds a mid-training (an
  LM run of a Gemma) and a post-training (SFT on the tasks) of the same
  model file, SAM off (every field checked, nothing read)."""
  for field in ('midtrain', 'posttrain'):
    if field not in base:
      raise UsageError('--config', sorted(base.keys()),
                       f'needs {field}: studies/gemma_midtraining/config.py')
  mid, post = base.midtrain, base.posttrain
  if mid.get('task') != 'lm' or models.kind(mid) != 'gemma':
    raise UsageError('--config.midtrain.task', mid.get('task'),
                     'mid-training continues a Gemma on text (task lm)')
  if post.get('task') != sft.TASK or models.kind(post) != 'gemma':
    raise UsageError('--config.posttrain.task', post.get('task'),
                     f'post-training fine-tunes on the tasks ({sft.TASK})')
  for field, config in (('midtrain', mid), ('posttrain', post)):
    if config.optimizer.sam.enabled:
      raise UsageError(f'--config.{field}.optimizer.sam.enabled', True,
                       'the study turns SAM on for its sam_rho<r> '
                       'mid-training alone (--rhos)')
    if config.get('init_from'):
      raise UsageError(f'--config.{field}.init_from', config.init_from,
                       'the study sets where each run starts')
  if (mid.model.gguf, mid.model.shape) != (post.model.gguf, post.model.shape):
    raise UsageError('--config.posttrain.model.gguf', post.model.gguf,
                     f'must be the mid-training\'s file ({mid.model.gguf!r}, '
                     f'shape {mid.model.shape})')
  lm_trainer.create_model(mid)
  sft.check_config(post)
  models.check_config(mid)


def mid_dir(root: str, variant: str, seed: int) -> str:
  return os.path.join(root, 'runs', f'mid_{variant}_seed{seed}')


def post_dir(root: str, variant: str, seed: int) -> str:
  return os.path.join(root, 'runs', f'post_{variant}_seed{seed}')


def mid_config(base: ml_collections.ConfigDict, variant: str, seed: int
               ) -> ml_collections.ConfigDict:
  """The mid-training run of (variant, seed) (not for the checkpoint)."""
  config = ml_collections.ConfigDict(base.midtrain.to_dict())
  config.seed = seed
  if variant.startswith(SAM_PREFIX):
    config.optimizer.sam.enabled = True
    config.optimizer.sam.rho = float(variant[len(SAM_PREFIX):])
  return config


def post_config(base: ml_collections.ConfigDict, root: str, variant: str,
                seed: int) -> ml_collections.ConfigDict:
  """The post-training run of (variant, seed): from the mid-trained run,
  or from the model file for the checkpoint."""
  config = ml_collections.ConfigDict(base.posttrain.to_dict())
  config.seed = seed
  config.init_from = (None if variant == CHECKPOINT
                      else mid_dir(root, variant, seed))
  return config
