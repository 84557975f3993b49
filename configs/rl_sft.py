r"""The supervised warm start of the RL policy: arithmetic answers, by difficulty.

  python -m launch.train --config=configs/rl_sft.py --workdir=workdirs/rl_sft

The decoder LM of configs/lm.py, smaller, learns to answer `a+b=` problems
of 1 to 5 digits (train.rl.tasks) from examples, briefly: the goal is a
policy with partial competence (pass@1 high on few digits, low on many),
which RL then improves. pass@1 per difficulty on held-out problems lands
in `<workdir>/pass_at_1.json`. Variants:

  python -m launch.train --config=configs/rl_sft.py:runlocal --workdir=/tmp/s
  python -m launch.train --config=configs/rl_sft.py:families=add+mul \
    --workdir=workdirs/rl_sft_mul

`runlocal` shrinks the model, the data and the steps for tests;
`families=` takes '+'-joined families (add, mul). `size=` 125m | 1b | 8b
makes the policy configs/lm.py's LM of that size (bytes, as the tasks
are), sharded as it is; compile GRPO with it on a pod
(`python -m launch.compile --config=configs/rl.py:size=1b
--model_config=configs/rl_sft.py:size=1b --target=v5e:16x16`).
"""

import ml_collections

from configs import config_args
from configs import decoder_blocks


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The SFT run; `arg` selects variants (see module docstring)."""
  args = config_args.parse(arg, 'configs/rl_sft.py', {
      'runlocal': 'runlocal', 'families': 'families=add+mul',
      'size': 'size=' + '|'.join(decoder_blocks.SIZES)})
  config = ml_collections.ConfigDict()
  config.task = 'rl_sft'
  config.seed = 0
  config.cpu_devices = 8

  config.model = ml_collections.ConfigDict(dict(
      vocab_size=256, d_model=64, num_layers=2, num_heads=4, mlp_dim=192,
      max_len=32))
  config.data = ml_collections.ConfigDict(dict(
      families=tuple(args.get('families', 'add').split('+')),
      difficulties=(1, 2, 3, 4, 5),
      train_examples=50_000,
      # Held-out problems per family and difficulty (pass@1, validation).
      eval_examples=200,
  ))

  decoder_blocks.local_mesh(config)
  config.batch_size = 64
  config.eval_batch_size = 200
  config.num_steps = 1500
  decoder_blocks.local_training(config, weight_decay=0.01)

  if 'size' in args:
    config.model, shape = decoder_blocks.size_model(args['size'], config.model.vocab_size,
                                        config.model.max_len)
    config.mesh.shape = shape
    config.logical_axis_rules = decoder_blocks.SIZE_RULES
  if 'runlocal' in args:
    config.model.update(dict(d_model=32, num_layers=1, num_heads=2,
                             mlp_dim=64))
    if 'size' in args:
      config.model.num_kv_heads = 1
    config.data.update(dict(difficulties=(1, 2, 3), train_examples=2_000,
                            eval_examples=24))
    config.batch_size = 32
    config.eval_batch_size = 32
    config.num_steps = 30
    config.optimizer.warmup_steps = 5
    config.log_every = 10
    config.eval_every = 20
    config.checkpoint_every = 20
  return config
