"""The trainer configs of the study's runs: each variant's pretraining and
the post-training that starts from it."""

import os

from configs import lm
from studies.lm_forgetting.settings import Settings


def pretrain_config(settings: Settings, variant: str, seed: int):
  config = lm.get_config(settings.config_arg or None)
  config.seed = seed
  opt = config.optimizer
  if variant in ('sam', 'sam_mid'):
    opt.sam.enabled = True
    opt.sam.rho = settings.rho
    if variant == 'sam_mid':
      # A step window: the first steps are the baseline's, bit for bit.
      opt.sam.window_start = config.num_steps - settings.mid_steps
  elif variant == 'large_lr':
    opt.learning_rate = settings.large_lr
  elif variant == 'short_anneal':
    opt.schedule = 'wsd'
    opt.decay_fraction = settings.anneal_fraction
  return config


def post_config(settings: Settings, seed: int, pretrain_workdir: str):
  config = lm.get_config(settings.config_arg or None)
  config.seed = seed
  config.data.mix = ((settings.post_source, 1.0),)
  config.num_steps = settings.post_steps
  config.optimizer.learning_rate = settings.post_lr
  config.optimizer.warmup_steps = max(1, settings.post_steps // 10)
  config.eval_every = config.checkpoint_every = settings.post_steps
  config.log_every = max(1, min(config.log_every, settings.post_steps))
  config.init_from = os.path.abspath(pretrain_workdir)
  return config
