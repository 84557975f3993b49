r"""Gemma 3 270M (the registry's pretrained model): steering evaluation.

The whole study (the main layer, the layer sweep, the report; RESULTS.md
gives its time):

  python -m launch.gemma_steering --config=configs/gemma.py \
      --workdir=workdirs/gemma_steering

`runlocal` shrinks every grid for tests. Any field can be overridden, e.g.
`--config.layer=9 --config.alphas='(0.2,0.6)' --config.gguf=/path/x.gguf`
(a Gemma 3 270M GGUF file; empty: the registry package's, assembled once
into ~/.cache/geom and checked by its SHA-256). Compile the evaluation's
programs for an accelerator (`shape=1b` and `shape=4b`, in bfloat16, are
compile-only):

  python -m launch.compile --config=configs/gemma.py:shape=4b --target=v5e:1x1
"""

import ml_collections

from configs import config_args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_args.parse(arg, 'configs/gemma.py', {
      'runlocal': 'runlocal', 'shape': 'shape=270m|1b|4b'})
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
  return config
