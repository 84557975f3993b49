r"""WRN-28-10 on CIFAR-10 with SAM (rho 0.05): the SAM paper's CIFAR recipe.

On a TPU pod or GPU node, with CIFAR-10 prepared as array_record files
(`tfds build cifar10 --file_format=array_record --data_dir=...`):

  python -m launch.train --config=configs/wrn_cifar10.py --workdir=workdirs/wrn \
    --config.data_dir=gs://BUCKET/tensorflow_datasets [--multihost]

Here, a smoke run of the same recipe at toy size (WRN-10-1 on the 8x8
digits images, offline; about 35 s of CPU time, most of it compiling):

  python -m launch.train --config=configs/wrn_cifar10.py:runlocal --workdir=/tmp/wrn

The paper's (Foret et al., ICLR 2021, Section 3.1) and its code's
(google-research/sam): WRN-28-10 (36.5M parameters), batch 256, 200
epochs, SGD with momentum 0.9 (Nesterov in the code), learning rate 0.1
with cosine decay and no warm-up, weight decay 5e-4 as an L2 penalty on
every parameter (the code's default: BN parameters and biases included),
gradient clipping at global norm 5 (the code's default), the basic
augmentation (4-pixel reflect-padded random crops and horizontal flips;
`augmentation='crop_flip'`), and SAM with rho 0.05.

Ours: the last 10% of CIFAR-10's training images are the validation split
(the paper tuned rho on a 10% hold-out too), so 45,000 images train: 175
steps per epoch, 35,000 steps. SAM perturbs with the whole batch's
gradient; the code perturbs each accelerator's share (m-sharpness), which
`--config.optimizer.sam.m_sharpness=True` does here. Activations in
bfloat16 (parameters float32), what pods run; `--config.model.dtype=float32`
for full precision. Parameters are data-parallel; channels can also be
split over the mesh's 'model' axis, e.g. `--config.mesh.shape='(-1,2)'`.
"""

import ml_collections

from configs import config_args
from configs import optimizer_block

TRAIN_IMAGES = 45_000  # cifar10 train[:90%]
EPOCHS = 200


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The WRN-28-10 recipe; `arg` 'runlocal' shrinks it (module docstring)."""
  args = config_args.parse(arg, 'configs/wrn_cifar10.py',
                           {'runlocal': 'runlocal'})
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.dataset = 'cifar10'
  # None: $TFDS_DATA_DIR or ~/tensorflow_datasets; never downloaded.
  config.data_dir = ml_collections.config_dict.placeholder(str)
  config.augmentation = 'crop_flip'
  # Simulated CPU devices when the job runs on a CPU host (ignored on TPU/GPU).
  config.cpu_devices = 8
  config.model = ml_collections.ConfigDict(dict(
      name='wrn', depth=28, widen_factor=10, dtype='bfloat16'))

  config.mesh = ml_collections.ConfigDict(
      dict(axes=('data', 'model'), shape=(-1, 1)))
  # Logical axis -> mesh axis (None: replicated). 'batch' is the data axis;
  # channels go to 'model', which has size 1 unless mesh.shape asks more.
  config.logical_axis_rules = (
      ('batch', 'data'),
      ('conv_in', None),
      ('conv_out', 'model'),
      ('classes', None),
  )
  # Augmented views are made on the host, so the data never lives on the
  # devices; this applies only with augmentation='none'.
  config.device_data_max_mb = 256

  config.batch_size = 256
  config.eval_batch_size = 1024
  steps_per_epoch = TRAIN_IMAGES // config.batch_size
  config.num_steps = EPOCHS * steps_per_epoch
  config.optimizer = optimizer_block.optimizer_block(
      name='momentum', learning_rate=0.1, schedule='cosine', warmup_steps=0,
      momentum=0.9, nesterov=True, weight_decay=5e-4,
      weight_decay_mode='l2',
      weight_decay_exclude=r'^$',  # Matches no parameter: decay them all.
      grad_clip_norm=5.0)
  config.optimizer.sam.enabled = True
  config.optimizer.sam.rho = 0.05
  config.nonfinite = 'stop'

  config.log_every = 100
  config.eval_every = 5 * steps_per_epoch
  config.checkpoint_every = 5 * steps_per_epoch
  config.keep_checkpoints = 3

  if 'runlocal' in args:
    # The same architecture and recipe, narrow and shallow, on offline data.
    config.dataset = 'digits'
    config.model = ml_collections.ConfigDict(dict(
        name='wrn', depth=10, widen_factor=1, dtype='float32'))
    config.batch_size = 64
    config.eval_batch_size = 256
    config.num_steps = 40
    config.log_every = 10
    config.eval_every = 20
    config.checkpoint_every = 20
  return config
