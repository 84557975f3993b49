r"""ResNet-50 on ImageNet with SAM (rho 0.05): the SAM paper's ImageNet recipe.

On a TPU pod or GPU nodes, with ImageNet prepared as array_record files
(`tfds build imagenet2012 --file_format=array_record --data_dir=...
--manual_dir=DIR_WITH_THE_ILSVRC2012_TARS`; never downloaded here):

  python -m launch.train --config=configs/resnet50_imagenet.py \
    --workdir=gs://BUCKET/r50_sam \
    --config.data_dir=gs://BUCKET/tensorflow_datasets --multihost

Here, a smoke run of the same recipe at toy size (a narrow bottleneck
ResNet of two stages, 2 + 1 blocks, on 5,000 MNIST images, offline; about
40 s of CPU time, most of it compiling; learning rate 0.3 for its 40
steps of 64):

  python -m launch.train --config=configs/resnet50_imagenet.py:runlocal \
    --workdir=/tmp/r50

The paper's (Foret et al., ICLR 2021, Section 3.1, as we read it; check
against the paper before quoting) and its code's (google-research/sam):
ResNet-50 (25.6M parameters), 100 epochs (the paper also trains 200 and
400; rho was tuned at 100), batch 4096, learning rate 1.0 with cosine decay
(no warm-up in the code), SGD with momentum 0.9 (Nesterov in the code),
weight decay 1e-4 as an L2 penalty on every parameter (the code's default),
gradient clipping at global norm 5 (the code's default), Inception crops
and flips at 224x224 (central 87.5% crops for evaluation), SAM with rho
0.05, and labels smoothed by 0.1 in training (`config.label_smoothing`;
evaluation keeps the plain cross-entropy).

Ours: 99% of ImageNet's training images train (1,268,355: 309 steps per
epoch, 30,900 steps) and the last 1% (12,812, big_vision's "minival") is
the validation split; ImageNet's `validation` split (50,000) is the test
split, evaluated once at the end. SAM perturbs with the whole batch's
gradient; the code perturbs each accelerator's share (m-sharpness), which
`--config.optimizer.sam.m_sharpness=True` does here. Activations in
bfloat16 (parameters float32); `--config.model.dtype=float32` for full
precision. The last BN of each block starts at zero (see
`train.vision.resnets`). Parameters are data-parallel; channels can also be
split over the mesh's 'model' axis, e.g. `--config.mesh.shape='(-1,2)'`.
"""

import ml_collections

from configs import config_args
from configs import optimizer_block

TRAIN_IMAGES = 1_268_355  # imagenet2012 train[:99%]
EPOCHS = 100


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The ResNet-50 recipe; `arg` 'runlocal' shrinks it (module docstring)."""
  args = config_args.parse(arg, 'configs/resnet50_imagenet.py',
                           {'runlocal': 'runlocal'})
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.dataset = 'imagenet2012'
  # None: $TFDS_DATA_DIR or ~/tensorflow_datasets; never downloaded.
  config.data_dir = ml_collections.config_dict.placeholder(str)
  config.augmentation = 'inception'
  # Simulated CPU devices when the job runs on a CPU host (ignored on TPU/GPU).
  config.cpu_devices = 8
  config.model = ml_collections.ConfigDict(dict(
      name='resnet', stage_sizes=(3, 4, 6, 3), block='bottleneck', width=64,
      zero_init_residual=True, dtype='bfloat16'))

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

  config.batch_size = 4096
  config.eval_batch_size = 4096
  steps_per_epoch = TRAIN_IMAGES // config.batch_size
  config.num_steps = EPOCHS * steps_per_epoch
  config.optimizer = optimizer_block.optimizer_block(
      name='momentum', learning_rate=1.0, schedule='cosine', warmup_steps=0,
      momentum=0.9, nesterov=True, weight_decay=1e-4,
      weight_decay_mode='l2',
      weight_decay_exclude=r'^$',  # Matches no parameter: decay them all.
      grad_clip_norm=5.0)
  config.optimizer.sam.enabled = True
  config.optimizer.sam.rho = 0.05
  config.label_smoothing = 0.1
  config.nonfinite = 'stop'

  config.log_every = 100
  config.eval_every = 5 * steps_per_epoch
  config.checkpoint_every = 1000
  config.keep_checkpoints = 3

  if 'runlocal' in args:
    # The same architecture family and recipe, narrow and shallow, on
    # offline data (held in memory, so its augmentation is crop_flip).
    config.dataset = 'mnist5k'
    config.augmentation = 'crop_flip'
    config.model = ml_collections.ConfigDict(dict(
        name='resnet', stage_sizes=(2, 1), block='bottleneck', width=8,
        zero_init_residual=True, dtype='float32'))
    config.batch_size = 64
    config.eval_batch_size = 256
    config.optimizer.learning_rate = 0.3
    config.num_steps = 40
    config.log_every = 10
    config.eval_every = 20
    config.checkpoint_every = 20
  return config
