r"""Gemma 3 270M (the registry's pretrained model): steering, fine-tuning, SFT.

`selection` (`--config=configs/gemma.py:selection`) adds the steering
evaluation's `selection` block (configs/steering.py): layer, direction
method and alpha grid per method chosen on validation items, blocks 3, 6,
9 and 12 (runlocal: 3 and 6), two validation sets of 40 items per task,
the real-text task pydoc_polarity added to copa and cloze (validation and
test, as many items as copa; not in runlocal); the gated methods with the calibrated gate
(`selection.gate`: centred on each candidate layer's contrastive mean,
kappa and beta from its contrastive cosines;
`--config.selection.gate=reference` for the reference's kappa 20 and
beta 0, uncentred). The steering study runs it as its selected settings
(studies/gemma_steering/README.md):

  python -m studies.gemma_steering --config=configs/gemma.py:selection \
      --workdir=workdirs/gemma_steering_selected

The steering study (the main layer, the layer sweep, the report;
studies/gemma_steering/README.md gives its time):

  python -m studies.gemma_steering --config=configs/gemma.py \
      --workdir=workdirs/gemma_steering

Its config is the steering evaluation's schema (configs/steering.py's
fields, read by `train.steering.evaluation.check_config`) with a GGUF file
(`gguf`, `shape`, `dtype`) in place of a trained LM's workdir, the
held-out windows' length (`window_len`), the layer sweep's fields and
`generation.enabled`. One evaluation alone:

  python -m launch.steer_eval --config=configs/gemma.py \
      --workdir=workdirs/gemma_steer

Fine-tuning on the shared loop (`finetune`: next-token loss on the
templated reviews and Python's documentation; `sft`: answers to arithmetic
problems, the GRPO policy's warm start and the forgetting study's
fine-tuning), with AdamW, or SAM around it (`sam`), the whole model or
with the tied embedding frozen (`frozen`):

  python -m launch.train --config=configs/gemma.py:finetune,frozen \
      --workdir=workdirs/gemma_ft
  python -m launch.train --config=configs/gemma.py:sft,sam \
      --workdir=workdirs/gemma_sft
  python -m launch.rl --config=configs/rl.py:gemma \
      --config.sft_workdir=workdirs/gemma_sft --workdir=workdirs/gemma_rl

SAM against AdamW fine-tuning and what each forgets: studies/gemma_forgetting
(its config.py is `sft,frozen` at 150 steps).

`runlocal` shrinks every grid and run for tests. Any field can be
overridden, e.g. `--config.layer=9 --config.alphas='(0.2,0.6)'
--config.gguf=/path/x.gguf` (steering) or `--config.model.gguf=/path/x.gguf
--config.optimizer.learning_rate=3e-5` (training): a Gemma 3 GGUF file;
empty: the registry package's, assembled once into ~/.cache/geom and
checked by its SHA-256; with `--config.shape=gguf` (steering) or
`--config.model.shape=gguf` (training) the file's own shape, any Gemma 3
text file. `shape=1b` and `shape=4b` (bfloat16) are compile-only, for
every job:

  python -m launch.compile --config=configs/gemma.py:shape=4b --target=v5e:1x1
  python -m launch.compile --config=configs/gemma.py:finetune,shape=4b \
      --target=v5e:2x2
"""

import ml_collections

from configs import config_args
from configs import decoder_blocks
from configs import optimizer_block
from configs import steering as steering_config


JOBS = ('finetune', 'sft')


def _model(shape: str, max_len: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      kind='gemma', shape=shape, gguf='',
      # float32: what the agreement with llama.cpp was measured in.
      dtype='float32' if shape == '270m' else 'bfloat16',
      max_len=max_len, remat=shape != '270m'))


def _training(args: dict[str, str]) -> ml_collections.ConfigDict:
  """A fine-tuning run of Gemma on the shared loop (`finetune`, `sft`)."""
  shape = args.get('shape', '270m')
  config = ml_collections.ConfigDict()
  config.seed = 0
  # One device on a CPU host: the simulated devices of a CPU share its
  # memory, and a replica of 270M parameters with AdamW's moments is 3 GiB.
  config.cpu_devices = 1
  config.tokenizer = ml_collections.ConfigDict(dict(kind='gemma'))
  if 'finetune' in args:
    config.task = 'lm'
    config.init_from = ml_collections.config_dict.placeholder(str)
    config.data = ml_collections.ConfigDict(dict(
        mix=(('attribute', 0.5), ('pydoc', 0.5)), train_bytes=400_000,
        eval_bytes=40_000, seq_len=64))
    config.model = _model(shape, 128)
  else:
    config.task = 'rl_sft'
    # An LM run to post-train (a Gemma continued on text): its parameters.
    config.init_from = ml_collections.config_dict.placeholder(str)
    # Sums of 1 to 3 digits: Gemma 3 270M answers some already (its
    # pass@1 before fine-tuning is in RESULTS.md), so fine-tuning moves a
    # model that is partly competent, as the RL warm start needs.
    config.data = ml_collections.ConfigDict(dict(
        families=('add',), difficulties=(1, 2, 3), train_examples=20_000,
        eval_examples=100))
    config.model = _model(shape, 32)
  # FSDP and tensor parallelism as the pod-scale LMs (configs/lm.py:size=):
  # on one device they are the identity.
  config.mesh = ml_collections.ConfigDict(dict(axes=('data', 'model'),
                                               shape=(-1, 1)))
  config.logical_axis_rules = decoder_blocks.SIZE_RULES
  config.batch_size = 16
  config.eval_batch_size = 50
  config.num_steps = 200
  # Fine-tuning a pretrained model: a small peak rate, short warmup,
  # cosine to 10%; weight decay towards zero would pull every pretrained
  # weight, so none.
  config.optimizer = optimizer_block.optimizer_block(
      name='adamw', learning_rate=3e-5, warmup_steps=20,
      end_lr_fraction=0.1, b2=0.999, eps=1e-8, weight_decay=0.0,
      grad_clip_norm=1.0,
      frozen='^embedding$' if 'frozen' in args else '')
  if 'sam' in args:
    config.optimizer.sam.enabled = True
    config.optimizer.sam.rho = 0.05
  config.nonfinite = 'stop'
  config.log_every = 10
  config.eval_every = 100
  config.checkpoint_every = 100
  # A checkpoint of 270M in float32 with AdamW's moments is 3.2 GB.
  config.keep_checkpoints = 1
  if shape != '270m':
    config.batch_size = config.eval_batch_size = 64
  if 'runlocal' in args:
    config.num_steps = 4
    config.batch_size = 4
    config.eval_batch_size = 8
    config.optimizer.warmup_steps = 1
    config.log_every = config.eval_every = config.checkpoint_every = 2
    if 'finetune' in args:
      config.data.update(dict(train_bytes=4_000, eval_bytes=1_000,
                              seq_len=16))
    else:
      config.data.update(dict(difficulties=(1, 2), train_examples=64,
                              eval_examples=8))
  return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_args.parse(arg, 'configs/gemma.py', {
      'runlocal': 'runlocal', 'shape': 'shape=270m|1b|4b',
      'finetune': 'finetune', 'sft': 'sft', 'sam': 'sam (training)',
      'frozen': 'frozen (training)', 'selection': 'selection (steering)'})
  if 'finetune' in args and 'sft' in args:
    raise ValueError('configs/gemma.py: finetune and sft are two jobs; '
                     'pick one')
  if not any(job in args for job in JOBS) and (
      'sam' in args or 'frozen' in args):
    raise ValueError('configs/gemma.py: sam and frozen are for a training '
                     'job (finetune or sft)')
  if any(job in args for job in JOBS):
    if 'selection' in args:
      raise ValueError('configs/gemma.py: selection is for the steering '
                       'evaluation, not a training job')
    return _training(args)
  config = ml_collections.ConfigDict()
  config.gguf = ''
  # 1b and 4b are for `launch.compile` only: the registry ships 270m.
  config.shape = args.get('shape', '270m')
  config.dtype = 'float32'  # What the agreement with llama.cpp was measured in.
  config.cpu_devices = 1  # The evaluation runs on one device.
  # Block 6 of 18, a third of the way up: chosen before any Gemma run (the
  # in-project LMs are steered at block 2 of 4); the sweep adds 3 and 12.
  config.layer = 6
  # The layer sweep: these blocks again, with `sweep_methods` only.
  config.sweep_layers = (3, 12)
  config.sweep_methods = ('none', 'addition', 'spherical', 'spherical_gate')
  config.sweep_items = 20  # Items per set and task in the sweep.
  config.direction = ml_collections.ConfigDict(
      dict(method='mean_diff', position='mean', pairs=64, seed=1))
  config.methods = ('none', 'addition', 'addition_renorm', 'addition_gate',
                    'spherical', 'spherical_gate')
  # Log-spaced: with c = the mean activation norm (about 5,200 at block 6,
  # set by a few huge residual dimensions), addition at alpha 0.3 already
  # gives a KL of 2.3 nats per token, the rotation far less.
  config.alphas = (0.01, 0.03, 0.1, 0.3, 1.0)
  config.kappa = 20.0  # The reference's.
  config.beta = 0.0
  config.tasks = ml_collections.ConfigDict(dict(copa=40, cloze=40))
  config.mc_seeds = (7, 8, 9)
  config.heldout_windows = 16
  config.window_len = 64
  config.generation = ml_collections.ConfigDict(dict(
      enabled=True, prompts=32, steps=32, temperature=0.8, seed=0,
      mode='cached'))
  if config.shape != '270m':
    config.dtype = 'bfloat16'
  if 'runlocal' in args:
    config.direction.pairs = 8
    config.methods = ('none', 'addition', 'spherical_gate')
    config.alphas = (0.3, 1.0)
    config.sweep_layers = (3,)
    config.sweep_methods = ('none', 'spherical_gate')
    config.sweep_items = 2
    config.tasks = ml_collections.ConfigDict(dict(copa=4, cloze=4))
    config.mc_seeds = (7, 8)
    config.heldout_windows = 2
    config.window_len = 16
    config.generation.update(dict(prompts=4, steps=6))
  if 'selection' in args:
    config.selection = steering_config.selection_block(
        layers=(3, 6) if 'runlocal' in args else (3, 6, 9, 12),
        mc_seeds=(101,) if 'runlocal' in args else (101, 102),
        items=4 if 'runlocal' in args else 40, gate='calibrated')
    # The real-text task beside the two template ones, as many items: its
    # pool holds 3 test sets of up to 67 and 2 validation sets of up to 59.
    # Not in runlocal: reading the pool takes seconds of every test.
    if 'runlocal' not in args:
      config.tasks.pydoc_polarity = config.tasks.copa
  return config
