r"""Asynchronous GRPO on arithmetic from the SFT warm start.

  python -m launch.train --config=configs/rl_sft.py --workdir=workdirs/rl_sft
  python -m launch.rl --config=configs/rl.py \
    --config.sft_workdir=workdirs/rl_sft --workdir=workdirs/rl

Variants through the config argument (comma-separated, combinable):

  python -m launch.rl --config=configs/rl.py:staleness=2,correction=tis \
    --config.sft_workdir=workdirs/rl_sft --workdir=/tmp/rl_s2
  python -m launch.rl --config=configs/rl.py:runlocal \
    --config.sft_workdir=/tmp/sft --workdir=/tmp/rl

`staleness=` is the global bound s (0, the default: synchronous GRPO);
`correction=` none | tis | decoupled; `gas=` full | no_bandit |
no_execution | no_coupling | fixed_lambda schedules with GAS (geom.gas;
s is then the easiest difficulty's budget), e.g.

  python -m launch.rl --config=configs/rl.py:gas=full,staleness=4 \
    --config.sft_workdir=workdirs/rl_sft --workdir=/tmp/rl_gas

`size=1b` (or 125m, 8b) is GRPO on a TPU pod with the LM of that size as
its policy (`configs/rl_sft.py:size=`): 128 devices generate and 128
train (v5e:16x16), the learner's policy split FSDP-style over them as
configs/lm.py splits it, 64 prompts x 16 samples per batch:

  python -m launch.compile --config=configs/rl.py:size=1b \
    --model_config=configs/rl_sft.py:size=1b --target=v5e:16x16

`gemma` is GRPO with Gemma 3 270M as the policy (its SFT warm start from
`configs/gemma.py:sft`): one CPU device generates and one learns (each
holds the policy; the learner its AdamW moments too), sums of 1 to 3
digits, 4 prompts x 4 samples per batch, learning rate 1e-6:

  python -m launch.train --config=configs/gemma.py:sft \
    --workdir=workdirs/gemma_sft
  python -m launch.rl --config=configs/rl.py:gemma \
    --config.sft_workdir=workdirs/gemma_sft --workdir=workdirs/gemma_rl

`runlocal` shrinks the run for tests. Every field can be overridden, e.g. `--config.runtime.num_actors=3
--config.grpo.beta=0.04 --config.runtime.deterministic=True`.
"""

import ml_collections

from configs import config_args
from configs import decoder_blocks
from configs import sweeps


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The RL run; `arg` selects variants (see module docstring)."""
  args = config_args.parse(arg, 'configs/rl.py', {
      'runlocal': 'runlocal', 'staleness': 'staleness=S',
      'correction': 'correction=none|tis|decoupled',
      'gas': 'gas=full|no_bandit|no_execution|no_coupling|fixed_lambda',
      'size': 'size=' + '|'.join(decoder_blocks.SIZES),
      'gemma': 'gemma'})
  config = ml_collections.ConfigDict()
  config.task = 'rl'
  config.seed = 0
  # The warm start written by launch.train with configs/rl_sft.py (required).
  config.sft_workdir = ml_collections.config_dict.placeholder(str)
  config.cpu_devices = 8
  # Devices that generate; the rest train (disjoint meshes).
  config.rollout_devices = 4
  # With launch.rl --multihost: how many processes generate (0..R-1, each
  # on its own devices); the others learn, the first of them leading
  # (train.rl.learner_group when they are several). Unset: one process.
  config.rollout_processes = ml_collections.config_dict.placeholder(int)

  config.family = 'add'
  config.difficulties = (1, 2, 3, 4, 5)
  config.prompts_per_batch = 8
  config.temperature = 1.0
  config.num_versions = 1000  # Learner updates, one per batch.

  config.grpo = ml_collections.ConfigDict(dict(
      group_size=8, iterations=1, epsilon=0.2, beta=0.0,
      correction=args.get('correction', 'decoupled'), is_cap=2.0,
      aggregation='sequence-mean'))
  config.optimizer = ml_collections.ConfigDict(dict(
      # 3e-5: with 1e-4 and 3e-4 pass@1 rose then fell back within 1000
      # updates (seed 0 warm start; RESULTS.md).
      learning_rate=3e-5, b1=0.9, b2=0.99, grad_clip_norm=1.0))
  config.runtime = ml_collections.ConfigDict(dict(
      max_staleness=int(args.get('staleness', 0)), num_actors=2,
      deterministic=False, max_actor_restarts=3,
      # Unset: max_staleness + num_actors batches.
      buffer_capacity=ml_collections.config_dict.placeholder(int),
      shutdown_timeout=60.0,
      # Multi-process runs: a transfer or a wait on another process (s),
      # and how long a process may stay silent before it is declared dead
      # (keep it below launch.rl's --heartbeat_timeout_seconds).
      transfer_timeout=300.0, peer_timeout=60.0))

  # 'fixed': every batch may lag runtime.max_staleness versions, uniform
  # difficulty. 'gas': geom.gas; gas.s_base is the easiest difficulty's
  # budget (unset: runtime.max_staleness, which bounds every budget).
  config.scheduler = 'fixed'
  config.gas = ml_collections.ConfigDict(dict(
      s_base=ml_collections.config_dict.placeholder(int), alpha=0.5, estimate_alpha=True, alpha_decay=0.7, curvature_decay=0.5,
      bandit='boltzmann', signal='learnability', discount=0.95,
      temperature=0.05, exploration=0.1, floor=0.1, coupling=1.0,
      execution_aware=True, max_defer=8, latency_decay=0.8,
      # lambda_max by power iteration ('power') or the one-product proxy
      # ('rayleigh'), on curvature_rows rows of each difficulty's last
      # batch, every curvature_every versions (0: never; alpha stays).
      # Every 100 cost a third of the wall time here (5 difficulties x 10
      # products on the learner): every 200.
      curvature='power', curvature_every=200, curvature_iters=10,
      curvature_rows=16,
      loss_weight=False,  # Scale advantages by exp(-lambda (d - d_0)).
      # 'measured' (seconds) or 'model': tokens x model_seconds_per_token
      # and model_step_seconds (deterministic runs need 'model').
      latency_source='measured', model_seconds_per_token=0.01,
      model_step_seconds=0.05))

  config.eval_every = 100
  config.eval_examples = 100  # Held-out problems per difficulty.
  config.log_every = 1
  config.checkpoint_every = 100
  config.keep_checkpoints = 2

  if 'gas' in args:
    config.scheduler = 'gas'
    variant = args['gas']
    ablations = {'full': {}, 'no_bandit': {'bandit': 'uniform'},
                 'no_execution': {'execution_aware': False},
                 'no_coupling': {'coupling': 0.0},
                 'fixed_lambda': {'estimate_alpha': False,
                                  'curvature_every': 0}}
    if variant not in ablations:
      raise ValueError(f'configs/rl.py: gas={variant!r}; valid choices: '
                       + ', '.join(ablations))
    config.gas.update(ablations[variant])
  if 'size' in args:
    if args['size'] not in decoder_blocks.SIZES:
      raise ValueError(f'configs/rl.py: size={args["size"]!r}; valid: '
                       + ', '.join(decoder_blocks.SIZES))
    # Absent by default: older runs' configs stay equal.
    config.rollout_devices = 128
    config.learner_mesh = ml_collections.ConfigDict(dict(
        axes=('data', 'model'), shape=(-1, decoder_blocks.size_model(
            args['size'], 256, 32)[1][1]), rules=decoder_blocks.SIZE_RULES))
    config.prompts_per_batch = 64
    config.grpo.group_size = 16
  if 'gemma' in args:
    if 'size' in args:
      raise ValueError('configs/rl.py: gemma and size= are two policies; '
                       'pick one')
    # The simulated devices of a CPU share its memory: one replica of
    # the policy generates, one learns.
    config.cpu_devices = 2
    config.rollout_devices = 1
    config.runtime.num_actors = 1
    config.difficulties = (1, 2, 3)
    config.prompts_per_batch = 4
    config.grpo.group_size = 4
    config.num_versions = 100
    config.eval_every = 25
    config.eval_examples = 50
    config.checkpoint_every = 25
    config.keep_checkpoints = 1
    # A pretrained policy: 1e-6, as GRPO recipes for small pretrained LMs
    # (tunix's Gemma examples use 3e-6 with larger batches).
    config.optimizer.learning_rate = 1e-6
  if 'runlocal' in args:
    config.difficulties = (1, 2, 3)
    config.prompts_per_batch = 4
    config.grpo.group_size = 4
    config.num_versions = 6
    config.eval_every = 3
    config.eval_examples = 16
    config.checkpoint_every = 2
    config.optimizer.learning_rate = 1e-3
    if 'gemma' in args:
      config.difficulties = (1, 2)
      config.prompts_per_batch = 2
      config.grpo.group_size = 2
      config.num_versions = 2
      config.eval_every = 2
      config.eval_examples = 4
      config.optimizer.learning_rate = 1e-6
  return config


def get_sweep(name: str) -> list[dict]:
  """Named lists of overrides for `python -m launch.sweep` (runs launch.rl;
  give the warm start with `--set=sft_workdir=...`)."""
  seeds = {'seed': [0, 1, 2]}
  return sweeps.select(name, {
      # The staleness bound over seeds: synchronous, then asynchronous.
      'staleness': lambda: sweeps.product(
          {'runtime.max_staleness': [0, 1, 2, 4], **seeds}),
      'correction': lambda: sweeps.product(
          {'grpo.correction': ['none', 'tis', 'decoupled'], **seeds}),
      # Two bounds, one seed: for tests and a quick try.
      'smoke': lambda: [{'runtime.max_staleness': s} for s in (0, 1)],
  })
