r"""Small CNN with BatchNorm on the digits images (offline), 8 simulated CPU devices.

The main job (`make run`):

  python -m launch.train --config=configs/digits.py --workdir=workdirs/digits

Variants through the config argument (comma-separated, combinable):

  python -m launch.train --config=configs/digits.py:runlocal --workdir=/tmp/d
  python -m launch.train --config=configs/digits.py:model=mlp --workdir=/tmp/m
  python -m launch.train --config=configs/digits.py:dataset=mnist5k,norm=group \
    --workdir=/tmp/mnist_gn
  python -m launch.train --config=configs/digits.py --workdir=/tmp/sam \
    --config.optimizer.sam.enabled=True --config.optimizer.sam.rho=0.1

`runlocal` shrinks the run for tests and laptops. `label_noise=0.4`
corrupts 40% of the training labels (symmetric; validation and test stay
clean), the setting of the SAM label-noise study (studies/sam_recipes:
`python -m studies.sam_recipes --config_arg=dataset=mnist5k,label_noise=0.4`).
`dataset=mnist5k` trains on 5,000 real 28x28 MNIST images (offline; the
source model of configs/tta.py); `norm=` picks the CNN's normalisation.
Sweeps (`get_sweep`; the learning-rate sweep's results are in
studies/local_sweeps):

  python -m launch.sweep --config=configs/digits.py --sweep=sam_rho \
    --workdir=workdirs/sam_rho --parallel=2
  python -m launch.report workdirs/sam_rho

Any field can be overridden, e.g. `--config.optimizer.learning_rate=0.05
--config.mesh.shape='(8,1)'`. For a standard TFDS data set that is
already prepared (array_record) in a data_dir:

  python -m launch.train --config=configs/digits.py --workdir=/tmp/c10 \
    --config.dataset=cifar10 --config.data_dir=gs://BUCKET/tensorflow_datasets
"""

import ml_collections

from configs import config_args
from configs import optimizer_block
from configs import sweeps


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The digits experiment; `arg` selects variants (see module docstring)."""
  args = config_args.parse(arg, 'configs/digits.py', {
      'runlocal': 'runlocal', 'model': 'model=cnn|mlp',
      'dataset': 'dataset=NAME', 'norm': 'norm=batch|group|layer',
      'label_noise': 'label_noise=RATE'})
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.dataset = args.get('dataset', 'digits')
  # None: $TFDS_DATA_DIR or ~/tensorflow_datasets. digits is built there
  # from scikit-learn on first use; other names must already be there.
  config.data_dir = ml_collections.config_dict.placeholder(str)
  # Simulated CPU devices when the job runs on a CPU host (ignored on TPU/GPU).
  config.cpu_devices = 8

  model = args.get('model', 'cnn')
  if model == 'cnn':
    config.model = ml_collections.ConfigDict(
        dict(name='cnn', features=(32, 64), hidden=128))
    if 'norm' in args:  # Absent by default: older runs' configs stay equal.
      config.model.norm = args['norm']
  elif model == 'mlp':
    config.model = ml_collections.ConfigDict(
        dict(name='mlp', widths=(256, 256)))
  else:
    raise ValueError(f'configs/digits.py: model={model!r}; valid: cnn, mlp')

  config.mesh = ml_collections.ConfigDict(
      dict(axes=('data', 'model'), shape=(-1, 2)))
  # Logical axis -> mesh axis (None: replicated). 'batch' is the data axis.
  config.logical_axis_rules = (
      ('batch', 'data'),
      ('conv_in', None),
      ('conv_out', 'model'),
      ('flat', None),
      ('hidden', 'model'),
      ('hidden_out', None),
      ('classes', None),
  )

  # A training split up to this size is kept on every device and batches
  # are gathered there (the host sends indices); 0 keeps data on the host.
  config.device_data_max_mb = 256
  config.batch_size = 128
  config.eval_batch_size = 256
  config.num_steps = 600

  # Momentum SGD, lr 0.1, cosine after 30 warm-up steps, weight decay 5e-4.
  config.optimizer = optimizer_block.optimizer_block()
  config.nonfinite = 'stop'  # stop | skip
  if 'label_noise' in args:  # Absent by default: older runs' configs stay equal.
    # Symmetric noise on the training labels (train/vision/label_noise.py);
    # the corrupted set is fixed by label_noise_seed, not by config.seed.
    config.label_noise = float(args['label_noise'])
    config.label_noise_seed = 0

  config.log_every = 50
  config.eval_every = 100
  config.checkpoint_every = 200
  config.keep_checkpoints = 3

  if 'runlocal' in args:
    config.num_steps = 40
    config.batch_size = 64
    config.eval_batch_size = 128
    config.optimizer.warmup_steps = 5
    config.log_every = 10
    config.eval_every = 20
    config.checkpoint_every = 20
    if model == 'cnn':
      config.model.hidden = 64
    else:
      config.model.widths = (64, 64)
  return config


def get_sweep(name: str) -> list[dict]:
  """Named lists of overrides for `python -m launch.sweep`."""
  seeds = {'seed': [0, 1, 2]}
  return sweeps.select(name, {
      # SAM's radius over seeds (the SAM study's core, one method).
      'sam_rho': lambda: sweeps.combine(
          [{'optimizer.sam.enabled': True}],
          sweeps.product({'optimizer.sam.rho': [0.02, 0.05, 0.1, 0.2, 0.5],
                          **seeds})),
      'learning_rate': lambda: sweeps.product(
          {'optimizer.learning_rate': [0.01, 0.03, 0.1, 0.3], **seeds}),
      # Two settings x two seeds of the small run: for tests and a quick try.
      'smoke': lambda: sweeps.product(
          {'optimizer.learning_rate': [0.05, 0.2], 'seed': [0, 1]}),
  })
