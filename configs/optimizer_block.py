"""The `config.optimizer` block shared by training configs (see train/training/optim.py).

Every field `train.training.optim` reads, with defaults; a config passes what it
changes: `optimizer_block(name='adamw', learning_rate=3e-3)`. SAM is the
`sam` sub-block (`configs/sam_block.py`), off by default. Optional fields
(`OPTIONAL`) are in the block only when a config passes them, so the
configs of runs made before they existed stay equal on resume.
"""

import ml_collections

from configs import sam_block

# Fields absent unless passed, with what `train.training.optim` assumes when absent.
OPTIONAL = {
    # 'decoupled': lr * wd * w after momentum (SGDW / AdamW); 'l2': wd * w
    # added to the gradient before clipping and momentum (an L2 penalty).
    'weight_decay_mode': 'decoupled',
    # A regular expression over parameter paths ('block_0/mlp/up'): the
    # parameters it matches are not trained (no gradient, no update, no
    # optimizer state), e.g. '^embedding$'. Empty: every one is.
    'frozen': '',
}


def optimizer_block(**changes) -> ml_collections.ConfigDict:
  """The defaults updated with `changes` (an unknown field is an error)."""
  block = dict(
      name='momentum',  # sgd | momentum | adamw
      learning_rate=0.1,
      schedule='cosine',  # cosine | constant | wsd (see train/training/optim.py)
      warmup_steps=30,
      end_lr_fraction=0.0,
      momentum=0.9,
      nesterov=False,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      weight_decay=5e-4,
      weight_decay_exclude=r'(bias|scale)$',
      grad_clip_norm=0.0,  # 0: no clipping.
  )
  unknown = sorted(set(changes) - set(block) - set(OPTIONAL))
  if unknown:
    raise ValueError(f'optimizer_block: unknown field {unknown[0]!r}; valid: '
                     f'{", ".join(sorted({**block, **OPTIONAL}))}')
  block.update(changes)
  block['sam'] = sam_block.sam_block()
  return ml_collections.ConfigDict(block)
