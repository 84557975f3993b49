r"""The study's fine-tuning: configs/gemma.py:sft,frozen for 150 steps.

  python -m studies.gemma_forgetting --config=studies/gemma_forgetting/config.py \
      --rhos=0.05,0.01 --sharpness_iters=20 --workdir=workdirs/gemma_forgetting

The SFT warm start of the GRPO runs (answers to sums of 1 to 3 digits)
with the tied embedding frozen (a CPU budget: it halves a step and the
optimizer state), shortened to 150 steps (the study's 9 runs took about
3.5 h on 2 cores). The argument is passed on to configs/gemma.py
(`runlocal` for tests); any field can be overridden
(`--config.optimizer.learning_rate=1e-5`).
"""

import ml_collections

from configs import gemma


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = gemma.get_config(','.join(['sft', 'frozen'] + ([arg] if arg
                                                          else [])))
  if 'runlocal' not in (arg or '').split(','):
    config.num_steps = 150
  return config
