r"""Test-time adaptation of a trained classifier over a corrupted test stream.

Train the source classifier, then adapt it:

  python -m launch.train --config=configs/digits.py:dataset=mnist5k \
    --workdir=workdirs/mnist5k
  python -m launch.tta --config=configs/tta.py \
    --config.source_workdir=workdirs/mnist5k --workdir=workdirs/tta_tent

Variants through the config argument (comma-separated, combinable):

  python -m launch.tta --config=configs/tta.py:method=eata,schedule=conga \
    --config.source_workdir=workdirs/mnist5k --workdir=/tmp/eata_conga
  python -m launch.tta --config=configs/tta.py:runlocal,protocol=continual \
    --config.source_workdir=/tmp/src --workdir=/tmp/t

`method=` source | bn_stats | tent | eata | sar; `schedule=` fixed | conga;
`protocol=` episodic | continual | mixed; `runlocal` shrinks the stream
(three corruptions) for tests and laptops. Any field can be overridden,
e.g. `--config.severity=3 --config.batch_size=16
--config.method.learning_rate=1e-2 --config.corruptions=fog,contrast`.
"""

import ml_collections

from configs import config_args

# Published defaults: TENT and EATA step with Adam at 1e-3 (TENT's
# CIFAR setting), SAR with momentum SGD (its paper's optimizer).
_OPTIMIZER = {'source': 'adam', 'bn_stats': 'adam', 'tent': 'adam',
              'eata': 'adam', 'sar': 'sgd'}
_RATE = {'source': 1e-3, 'bn_stats': 1e-3, 'tent': 1e-3, 'eata': 1e-3,
         'sar': 1e-2}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The TTA run; `arg` selects variants (see module docstring)."""
  args = config_args.parse(arg, 'configs/tta.py', {
      'runlocal': 'runlocal', 'method': 'method=NAME',
      'schedule': 'schedule=fixed|conga', 'protocol': 'protocol=NAME'})
  config = ml_collections.ConfigDict()
  config.task = 'tta'
  config.seed = 0
  # The classifier trained by launch.train (required).
  config.source_workdir = ml_collections.config_dict.placeholder(str)
  # The clean data set; the stream is its `_corrupted` test sets.
  config.dataset = 'mnist5k'
  config.data_dir = ml_collections.config_dict.placeholder(str)
  config.corruptions = 'all'
  config.severity = 5
  config.protocol = args.get('protocol', 'episodic')
  config.order = 'shuffled'  # shuffled | by_class (label shift)
  config.batch_size = 64
  # The source run's mesh needs its devices to rebuild its model.
  config.cpu_devices = 8

  name = args.get('method', 'tent')
  config.method = ml_collections.ConfigDict(dict(
      name=name,
      optimizer=_OPTIMIZER.get(name, 'adam'),
      learning_rate=_RATE.get(name, 1e-3),
      schedule=args.get('schedule', 'fixed'),
      # geom.conga.conga's keyword arguments besides the base rate; None
      # (unset) is geom's default.
      conga=ml_collections.ConfigDict({
          name: ml_collections.config_dict.placeholder(float)
          for name in ('min_learning_rate', 'max_learning_rate', 'margin',
                       'grad_decay', 'entropy_decay', 'max_update_rms')}),
      d_margin=0.05, fisher_alpha=2000.0, fisher_samples=500,
      reset_below=0.2, rho=0.05))

  config.log_every = 1
  # Batches between checkpoints. Each save holds the loop for about 0.1 s
  # on CPU (measured: every 10 batches cost a quarter of the throughput of
  # a small CNN), so a resume may redo up to this many batches instead.
  config.checkpoint_every = 50
  config.keep_checkpoints = 2
  if 'runlocal' in args:
    config.corruptions = 'gaussian_noise,fog,contrast'
    config.method.fisher_samples = 128
  return config
