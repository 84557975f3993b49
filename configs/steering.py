r"""Steering evaluation: methods x alpha on the in-project LM (offline).

The schema is `train.steering.evaluation`'s, shared with Gemma's
(configs/gemma.py), which names a GGUF file where this names an LM's
workdir (`lm_workdir`).

Train the LM first (configs/lm.py), then:

  python -m launch.steer_eval --config=configs/steering.py \
    --config.lm_workdir=workdirs/lm --workdir=workdirs/steer

Writes results.md (the method table), results.json, pareto.png and the
steering vector (steering_vector.npz, with its layer and the model's
fingerprint) into --workdir. `runlocal` shrinks the grid for tests; any
field can be overridden, e.g. `--config.layer=1 --config.beta=-1.0
--config.alphas='(0.2,0.6)' --config.generation.mode=recompute`, or
`--config.vector_file=PATH` to reuse a saved vector.

`selection` (`--config=configs/steering.py:selection`) adds the
`selection` block: the layer, direction method and alpha grid of each
method chosen on validation items, then the test items evaluated once
(`train.steering.selection`), the gated methods with the calibrated gate
(`selection.gate='calibrated'`; 'reference' keeps `kappa` and `beta`);
without it the evaluation is as before.
"""

import ml_collections

from configs import config_args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  args = config_args.parse(arg, 'configs/steering.py',
                           {'runlocal': 'runlocal', 'selection': 'selection'})
  config = ml_collections.ConfigDict()
  config.lm_workdir = ml_collections.config_dict.placeholder(str)
  config.vector_file = ''  # Empty: extract the direction from contrastive pairs.
  config.cpu_devices = 1  # Evaluation runs on one device.
  config.layer = 2  # The middle of configs/lm.py's 4 blocks.
  # Mean-difference of the activations averaged over each text's tokens
  # ('mean'); the reference takes the last token ('last'), which on this
  # byte-level LM mostly encodes the closing phrase just read (RESULTS.md).
  config.direction = ml_collections.ConfigDict(
      dict(method='mean_diff', position='mean', pairs=256, seed=1))
  config.methods = ('none', 'addition', 'addition_renorm', 'addition_gate',
                    'spherical', 'spherical_gate')
  config.alphas = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0)
  config.kappa = 20.0  # The reference's.
  config.beta = 0.0
  config.tasks = ml_collections.ConfigDict(dict(copa=200, cloze=200))
  config.mc_seeds = (7,)  # One item set per seed (the study uses several).
  config.heldout_windows = 64
  config.generation = ml_collections.ConfigDict(dict(
      prompts=64, steps=96, temperature=0.8, seed=0, mode='cached'))
  if 'runlocal' in args:
    config.layer = 1
    config.direction.pairs = 16
    config.alphas = (0.3, 1.0)
    config.tasks = ml_collections.ConfigDict(dict(copa=8, cloze=8))
    config.heldout_windows = 4
    config.generation.update(dict(prompts=4, steps=8))
  if 'selection' in args:
    config.selection = selection_block(
        layers=(0, 1) if 'runlocal' in args else (1, 2, 3),
        mc_seeds=(101,), items=4 if 'runlocal' in args else 100)
  return config


def selection_block(layers: tuple[int, ...], mc_seeds: tuple[int, ...],
                    items: int, gate: str = 'calibrated'
                    ) -> ml_collections.ConfigDict:
  """The `selection` block (`train.steering.selection`): candidate
  layers and direction methods, the validation item sets (seeds of their
  own, `items` per set and task), the KL targets of the matched-KL
  reading (the study's), the accuracy it reads (mean log-prob) and the
  gated methods' gate (`train.steering.selection_gate`: 'calibrated',
  centred on the layer's contrastive mean with kappa and beta from its
  contrastive cosines, per candidate; 'reference': `kappa` and `beta`
  uncentred)."""
  return ml_collections.ConfigDict(dict(
      layers=layers,
      direction_methods=('mean_diff', 'pca_center', 'logistic'),
      mc_seeds=mc_seeds, items_per_set=items,
      targets=(0.05, 0.1, 0.2, 0.33, 0.5), score='mean', gate=gate))
