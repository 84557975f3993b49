"""Everything a run needs before anything is compiled, validated from the config.

`build(config, workdir)` checks every user-facing setting first (names,
mesh, batch divisibility, data availability, workdir, step counts) and
raises `UsageError` naming the field, the value and the choices; only then
does it build the mesh, the model, the optimizer and the shardings. No
array is placed and nothing is compiled here, and nothing in the workdir
is touched except a probe file that checks it is writable.
"""

import dataclasses
import functools
import math
import os
import tempfile

from etils import epath
import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
import ml_collections
import numpy as np
import optax

from train import datasets
from train import fileio
from train import models
from train import optim
from train import sharding as sharding_lib
from train import steps
from train.errors import ConfigError, UsageError


@dataclasses.dataclass
class Experiment:
  config: ml_collections.ConfigDict
  workdir: str
  mesh: Mesh
  model: nn.Module
  tx: optax.GradientTransformationExtraArgs
  learning_rate: optax.Schedule
  spec: datasets.DatasetSpec
  state_shardings: steps.TrainState
  batch_sharding: NamedSharding
  abstract_state: steps.TrainState  # ShapeDtypeStructs with shardings.

  def init_state(self) -> steps.TrainState:
    """A fresh state, created directly with its shardings."""
    example = np.zeros((1, *self.spec.image_shape), np.uint8)
    fn = jax.jit(
        functools.partial(steps.init_state, self.model, self.tx, example),
        out_shardings=self.state_shardings)
    return fn(jax.random.key(self.config.seed))

  def abstract_batch(self, batch_size: int,
                     with_mask: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    s = self.batch_sharding
    batch = {
        'image': jax.ShapeDtypeStruct((batch_size, *self.spec.image_shape),
                                      np.uint8, sharding=s),
        'label': jax.ShapeDtypeStruct((batch_size,), np.int32, sharding=s),
    }
    if with_mask:
      batch['mask'] = jax.ShapeDtypeStruct((batch_size,), np.float32,
                                           sharding=s)
    return batch

  def abstract_index_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {'index': jax.ShapeDtypeStruct((batch_size,), np.int32,
                                          sharding=self.batch_sharding)}


def check_positive(config: ml_collections.ConfigDict, *fields: str) -> None:
  for field in fields:
    value = config[field]
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(field, value, 'must be a positive integer')


def check_workdir(workdir: str) -> str:
  """Creates `workdir` if needed and proves it writable with a probe file."""
  path = fileio.absolute(workdir)
  try:
    if fileio.is_remote(path):
      probe = epath.Path(path) / f'.write_probe_{os.getpid()}'
      probe.parent.mkdir(parents=True, exist_ok=True)
      probe.write_text('')
      probe.unlink()
    else:
      os.makedirs(path, exist_ok=True)
      with tempfile.NamedTemporaryFile(dir=path, prefix='.write_probe_'):
        pass
  except Exception as e:  # pylint: disable=broad-except
    # OSError locally; the bucket clients raise their own types.
    raise UsageError('--workdir', workdir,
                     f'not a writable directory '
                     f'({getattr(e, "strerror", None) or e})') from None
  return path


def _batch_divisor(mesh: Mesh, rules) -> int:
  spec = nn.logical_to_mesh_axes(('batch',), rules)[0]
  axes = () if spec is None else (spec if isinstance(spec, tuple) else (spec,))
  return math.prod(mesh.shape[a] for a in axes)


def build_mesh(config: ml_collections.ConfigDict) -> tuple[Mesh, list]:
  """The mesh and logical-axis rules of `config`, after checking that the
  mesh fits the devices and the batch sizes split over it and the hosts."""
  axes = tuple(config.mesh.axes)
  sharding_lib.mesh_shape(config.mesh.shape, axes, jax.device_count())
  rules = [tuple(r) for r in config.logical_axis_rules]
  sharding_lib.check_rules(rules, axes)
  mesh = sharding_lib.make_mesh(config.mesh.shape, axes)
  divisor = _batch_divisor(mesh, rules)
  for field in ('batch_size', 'eval_batch_size'):
    for what, n in (('the data-parallel mesh size', divisor),
                    ('the number of processes', jax.process_count())):
      if config[field] % n:
        raise ConfigError(field, config[field],
                          f'must be divisible by {what} ({n})')

  return mesh, rules


def build(config: ml_collections.ConfigDict, workdir: str) -> Experiment:
  """Validates `config` and builds the run's parts (see module docstring)."""
  if config.device_data_max_mb < 0:
    raise ConfigError('device_data_max_mb', config.device_data_max_mb,
                      'must be >= 0 (0 keeps data on the host)')
  check_positive(config, 'num_steps', 'batch_size', 'eval_batch_size',
                  'log_every', 'eval_every', 'checkpoint_every',
                  'keep_checkpoints')
  spec = datasets.get_spec(config.dataset)
  if config.nonfinite not in steps.NONFINITE_POLICIES:
    raise ConfigError('nonfinite', config.nonfinite, 'unknown policy',
                      steps.NONFINITE_POLICIES)
  model = models.create_model(config.model, spec.num_classes, spec.pixel_max)
  tx = optim.create_optimizer(config.optimizer, config.num_steps)
  learning_rate = optim.learning_rate_schedule(config.optimizer,
                                               config.num_steps)

  mesh, rules = build_mesh(config)

  sam_cfg = config.optimizer.get('sam')
  if sam_cfg and sam_cfg.enabled and sam_cfg.m_sharpness:
    batch_axes = nn.logical_to_mesh_axes(('batch',), rules)[0]
    if batch_axes != optim.M_SHARPNESS_AXIS:
      raise ConfigError(
          'optimizer.sam.m_sharpness', True,
          f'needs the batch split over the mesh axis '
          f'{optim.M_SHARPNESS_AXIS!r} alone (logical_axis_rules map '
          f"'batch' to {batch_axes!r})")
  workdir = check_workdir(workdir)
  datasets.check_available(config.dataset, config.data_dir)

  example = np.zeros((1, *spec.image_shape), np.uint8)
  boxed = jax.eval_shape(
      functools.partial(model.init, train=False), jax.random.key(0), example)
  param_shardings = sharding_lib.logical_to_shardings(boxed['params'], mesh,
                                                      rules)
  stats_shardings = sharding_lib.logical_to_shardings(
      boxed.get('batch_stats', {}), mesh, rules)
  abstract_params = nn.meta.unbox(boxed['params'])
  repl = sharding_lib.replicated(mesh)
  state_shardings = steps.TrainState(
      step=repl, params=param_shardings, batch_stats=stats_shardings,
      opt_state=sharding_lib.optimizer_state_shardings(
          tx, abstract_params, param_shardings, mesh),
      skipped_steps=repl)
  abstract = jax.eval_shape(
      functools.partial(steps.init_state, model, tx, example),
      jax.random.key(0))
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, state_shardings)
  return Experiment(
      config=config, workdir=workdir, mesh=mesh, model=model, tx=tx,
      learning_rate=learning_rate, spec=spec,
      state_shardings=state_shardings,
      batch_sharding=sharding_lib.batch_sharding(mesh, rules),
      abstract_state=abstract_state)
