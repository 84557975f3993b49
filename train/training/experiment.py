"""A run's parts, checked and assembled before anything is placed or compiled.

Every product (`train.vision`, `train.lm`, and the loops to come) builds
one `Experiment` from its config: it validates its own settings (model,
data), builds its model and says how to initialise it, what one example
looks like (`columns`) and its per-example loss; `assemble` does the rest,
which is common to all: the checks of the loop's settings, the mesh and
logical-axis rules, the optimizer and the method's hooks, and the
shardings and abstract shapes of the train state. A mistake raises
`UsageError` naming the field, the value and the choices; nothing is
placed, nothing is compiled, and nothing in the workdir is touched but a
probe file that proves it writable.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
import contextlib
import dataclasses
import functools
import json
import math
import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
import ml_collections
import numpy as np
import optax

from geom import method_hooks
from train.run import checkpointing
from train.training import host_devices
from train.training import model_shapes
from train.training import optim
from train.run import process_group
from train.run import workdir_path
from train.training import sharding as sharding_lib
from train.training import steps
from train.errors import ConfigError, UsageError

# Column name -> (shape of one example, dtype), e.g.
# {'image': ((8, 8, 1), np.uint8), 'label': ((), np.int32)}.
Columns = Mapping[str, tuple[tuple[int, ...], jax.typing.DTypeLike]]
# rng -> the model's variables (as `model.init` returns them, boxed or not:
# a pytree of arrays).
InitVariables = Callable[[jax.Array], Mapping[str, Any]]

# Fields every training config has, read by `train.training.loop`.
LOOP_FIELDS = ('num_steps', 'batch_size', 'eval_batch_size', 'log_every',
               'eval_every', 'checkpoint_every', 'keep_checkpoints')


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything `train.training.loop` needs to run, checked; nothing placed yet.

  Attributes:
    config: the run's config.
    workdir: the absolute workdir.
    mesh: the device mesh.
    model: the Flax model.
    init_variables: `rng -> variables`, the model's initialisation.
    per_example: the per-example loss (`steps.PerExample`).
    columns: what one example holds (`Columns`).
    tx: the whole optax transformation.
    learning_rate: its learning-rate schedule (for logging).
    hooks: what the method in `tx` needs from the loop.
    state_shardings: the train state's shardings.
    batch_sharding: the batch's (split over the data axis).
    abstract_state: the train state as ShapeDtypeStructs with shardings.
  """
  config: ml_collections.ConfigDict
  workdir: str
  mesh: Mesh
  model: nn.Module
  init_variables: InitVariables
  per_example: steps.PerExample
  columns: Columns
  tx: optax.GradientTransformationExtraArgs
  learning_rate: optax.Schedule
  hooks: method_hooks.MethodHooks
  state_shardings: steps.TrainState
  batch_sharding: NamedSharding
  abstract_state: steps.TrainState

  def init_state(self, variables: dict[str, Any] | None = None
                 ) -> steps.TrainState:
    """A fresh state, created directly with its shardings: from
    `config.seed`, or around given `variables` ({'params': ...} and
    optionally 'batch_stats', e.g. another run's; the optimizer state
    starts fresh). Given variables must match the model's tree and
    shapes (ConfigError naming `config.init_from` otherwise)."""
    if variables is None:
      fn = jax.jit(
          functools.partial(steps.init_state, self.init_variables, self.tx),
          out_shardings=self.state_shardings)
      return fn(jax.random.key(self.config.seed))
    variables = {'params': variables['params'],
                 'batch_stats': variables.get('batch_stats', {})}
    want = {'params': self.abstract_state.params,
            'batch_stats': self.abstract_state.batch_stats}
    _check_same_shapes(variables, want, self.config.get('init_from'))
    # The variables are an argument, not a constant baked into the program.
    fn = jax.jit(lambda v, rng: steps.init_state(lambda _: v, self.tx, rng),
                 out_shardings=self.state_shardings)
    return fn(variables, jax.random.key(self.config.seed))

  def abstract_batch(self, batch_size: int, with_mask: bool = False
                     ) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of `columns` (and an evaluation mask), split on the data axis."""
    s = self.batch_sharding
    batch = {name: jax.ShapeDtypeStruct((batch_size, *shape), dtype,
                                        sharding=s)
             for name, (shape, dtype) in self.columns.items()}
    if with_mask:
      batch['mask'] = jax.ShapeDtypeStruct((batch_size,), np.float32,
                                           sharding=s)
    return batch

  def abstract_index_batch(self, batch_size: int
                           ) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of example indices (for training data kept on the devices)."""
    return {'index': jax.ShapeDtypeStruct((batch_size,), np.int32,
                                          sharding=self.batch_sharding)}


def _check_same_shapes(got: Any, want: Any, source: Any) -> None:
  """ConfigError naming config.init_from unless `got` has `want`'s tree,
  shapes and dtypes."""
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree_util.tree_leaves_with_path(want)
  if jax.tree.structure(got) != jax.tree.structure(want):
    got_paths = {jax.tree_util.keystr(p) for p, _ in got_leaves}
    want_paths = {jax.tree_util.keystr(p) for p, _ in want_leaves}
    odd = sorted(got_paths ^ want_paths)
    raise ConfigError('init_from', source, 'holds a model with other '
                      f'parameters than this config\'s (first difference: '
                      f'{odd[0] if odd else "the tree"})')
  for (path, a), (_, b) in zip(got_leaves, want_leaves):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ConfigError('init_from', source, 'holds a model of another '
                        f'shape: {jax.tree_util.keystr(path)} is '
                        f'{a.dtype}{list(a.shape)}, this config needs '
                        f'{b.dtype}{list(b.shape)}')


def check_positive(config: ml_collections.ConfigDict, *fields: str) -> None:
  for field in fields:
    value = config[field]
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(field, value, 'must be a positive integer')


def check_seed(config: ml_collections.ConfigDict) -> None:
  """`config.seed`: an integer in [0, 2**32), what both JAX's keys and
  NumPy's generators take (a negative or larger seed failed in the data
  pipeline, after the workdir was written)."""
  seed = config.seed
  if not isinstance(seed, int) or isinstance(seed, bool) or not (
      0 <= seed < 2**32):
    raise ConfigError('seed', seed, 'must be an integer in [0, 2**32)')


def check_loop_settings(config: ml_collections.ConfigDict) -> None:
  """The fields `train.training.loop` reads: seed, step counts, intervals, policies."""
  check_seed(config)
  check_positive(config, *LOOP_FIELDS)
  if config.get('device_data_max_mb', 0) < 0:
    raise ConfigError('device_data_max_mb', config.device_data_max_mb,
                      'must be >= 0 (0 keeps data on the host)')
  if config.nonfinite not in steps.NONFINITE_POLICIES:
    raise ConfigError('nonfinite', config.nonfinite, 'unknown policy',
                      steps.NONFINITE_POLICIES)


def _check_batch_memory(config: ml_collections.ConfigDict, columns: Columns,
                        hosts: int) -> None:
  """ConfigError naming the batch size whose input alone (`columns`, per
  host) needs more than half of this host's memory: a batch of 10**9 was
  allocated before anything said no."""
  example = sum(math.prod(shape) * np.dtype(dtype).itemsize
                for shape, dtype in columns.values())
  memory = host_devices.host_memory_bytes()
  for field in ('batch_size', 'eval_batch_size'):
    need = config[field] * example / hosts
    if need > memory / 2:
      raise ConfigError(
          field, config[field], f'its input alone is {need / 2**30:.1f} GiB '
          f'per host, more than half of this host\'s memory '
          f'({memory / 2**30:.1f} GiB)')


def _check_state_memory(config: ml_collections.ConfigDict,
                        abstract_state: steps.TrainState, mesh: Mesh) -> None:
  """ConfigError naming the model when the train state and its gradient
  (the parameters' size again), a lower bound of what training holds,
  cannot fit: per device against an accelerator's memory, or all of this
  host's devices against its memory on CPU, where they share it. A d_model of 2**30 otherwise died in
  XLA (an abort) after the workdir was written; 2**16 took the host's
  memory."""
  per_device = (sharding_lib.device_bytes(abstract_state)
                + sharding_lib.device_bytes(abstract_state.params))
  local = [d for d in mesh.devices.flat
           if d.process_index == jax.process_index()]
  if local[0].platform == 'cpu':
    need, have = per_device * len(local), host_devices.host_memory_bytes()
    where = f'this host\'s memory ({have / 2**30:.1f} GiB)'
  else:
    stats = local[0].memory_stats() or {}
    if 'bytes_limit' not in stats:
      return
    need, have = per_device, stats['bytes_limit']
    where = (f'the {have / 2**30:.1f} GiB of a {local[0].device_kind} '
             'device')
  if need > have:
    raise ConfigError(
        'model', _model_summary(config),
        f'its train state and gradient alone need {need / 2**30:,.1f} GiB '
        f'{"per device" if local[0].platform != "cpu" else "on this host"}, '
        f'more than {where}; make the model smaller or shard it over more '
        'devices (mesh, logical_axis_rules)')


def _model_summary(config: ml_collections.ConfigDict) -> Any:
  model = config.get('model')
  if isinstance(model, ml_collections.ConfigDict):
    return {k: v for k, v in model.items() if isinstance(v, (int, str))}
  return model


# The run core checks a workdir (`train.run.workdir_path`); the name stays
# for the products and studies that check theirs here.
check_workdir = workdir_path.check


def _batch_axes(rules) -> tuple[str, ...]:
  spec = nn.logical_to_mesh_axes(('batch',), rules)[0]
  return () if spec is None else (spec if isinstance(spec, tuple) else (spec,))


def build_mesh(config: ml_collections.ConfigDict,
               devices: Sequence[Any] | None = None) -> tuple[Mesh, list]:
  """The mesh and logical-axis rules of `config`, after checking that the
  mesh fits the devices and the batch sizes split over it and the hosts.

  `devices` (default: all of this job's) may be another machine's, e.g. a
  TPU pod's compile-only devices (`launch.compile`); their hosts are then
  the processes the batch is split over.
  """
  axes = tuple(config.mesh.axes)
  count = (len(process_group.devices()) if devices is None
           else len(devices))
  sharding_lib.mesh_shape(config.mesh.shape, axes, count)
  rules = [tuple(r) for r in config.logical_axis_rules]
  sharding_lib.check_rules(rules, axes)
  batch_axes = _batch_axes(rules)
  mesh = sharding_lib.make_mesh(config.mesh.shape, axes, devices,
                                dcn_axis=batch_axes[0] if batch_axes
                                else None)
  processes = (process_group.count() if devices is None
               else len({d.process_index for d in devices}))
  divisor = math.prod(mesh.shape[a] for a in batch_axes)
  for field in ('batch_size', 'eval_batch_size'):
    for what, n in (('the data-parallel mesh size', divisor),
                    ('the number of processes', processes)):
      if config[field] % n:
        raise ConfigError(field, config[field],
                          f'must be divisible by {what} ({n})')
  return mesh, rules


def _check_hooks(optimizer: optim.Optimizer, rules) -> None:
  """The method's needs against what the train step and the mesh give."""
  hooks = optimizer.hooks
  try:
    steps.check_update_arguments(hooks)
  except ValueError as e:
    raise ConfigError('optimizer', hooks.name, str(e)) from None
  axis = hooks.per_device_axis
  if axis is not None:
    batch_axes = _batch_axes(rules)
    if batch_axes != (axis,):
      raise ConfigError(
          optimizer.per_device_field or 'optimizer', True,
          f'needs the batch split over the mesh axis {axis!r} alone '
          f"(logical_axis_rules map 'batch' to {batch_axes!r})")


def assemble(config: ml_collections.ConfigDict, workdir: str, *,
             model: nn.Module, init_variables: InitVariables,
             per_example: steps.PerExample, columns: Columns,
             check_data: Callable[[], None] | None = None,
             devices: Sequence[Any] | None = None) -> Experiment:
  """Checks the shared settings and builds the shared parts of a run.

  Args:
    config: the run's config (the product has checked its own fields).
    workdir: where the run writes.
    model, init_variables, per_example, columns: the product's parts.
    check_data: called after everything else is checked and the workdir
      proved writable, to check that the data can be read.
    devices: the mesh's devices (default: this job's; see `build_mesh`).

  Raises:
    UsageError: a setting is invalid.
  """
  check_loop_settings(config)
  optimizer = optim.build(config.optimizer, config.num_steps)
  mesh, rules = build_mesh(config, devices)
  _check_batch_memory(config, columns,
                      len({d.process_index for d in mesh.devices.flat}))
  _check_hooks(optimizer, rules)

  boxed = model_shapes.abstract_variables(init_variables)
  frozen = optim.frozen_mask(config.optimizer, nn.meta.unbox(boxed['params']))
  if frozen is not None:
    optim.check_frozen(config.optimizer, nn.meta.unbox(boxed['params']))
    per_example = _stop_gradient_at(per_example, frozen)
  param_shardings = sharding_lib.logical_to_shardings(boxed['params'], mesh,
                                                      rules)
  stats_shardings = sharding_lib.logical_to_shardings(
      boxed.get('batch_stats', {}), mesh, rules)
  repl = sharding_lib.replicated(mesh)
  state_shardings = steps.TrainState(
      step=repl, params=param_shardings, batch_stats=stats_shardings,
      opt_state=sharding_lib.optimizer_state_shardings(
          optimizer.tx, nn.meta.unbox(boxed['params']), param_shardings,
          mesh),
      skipped_steps=repl)
  # From `boxed`: the model's init is traced once, not again for the state.
  abstract = jax.eval_shape(
      lambda variables: steps.init_state(lambda _: variables, optimizer.tx,
                                         None), boxed)
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, state_shardings)
  if devices is None:
    # Compile-only devices (`launch.compile`) are another machine's: its
    # report says whether the programs fit.
    _check_state_memory(config, abstract_state, mesh)
  # Only now, so that a run refused above leaves no workdir behind.
  workdir = check_workdir(workdir)
  if check_data is not None:
    check_data()
  return Experiment(
      config=config, workdir=workdir, mesh=mesh, model=model,
      init_variables=init_variables, per_example=per_example,
      columns=columns, tx=optimizer.tx,
      learning_rate=optimizer.learning_rate, hooks=optimizer.hooks,
      state_shardings=state_shardings,
      batch_sharding=sharding_lib.batch_sharding(mesh, rules),
      abstract_state=abstract_state)


def _stop_gradient_at(per_example: steps.PerExample, mask: Any
                      ) -> steps.PerExample:
  """`per_example` seeing the parameters `mask` marks as constants: their
  gradient is zero and never computed (`config.optimizer.frozen`)."""
  def wrapped(model, variables, batch, train):
    params = jax.tree.map(
        lambda frozen, p: jax.lax.stop_gradient(p) if frozen else p, mask,
        variables['params'])
    return per_example(model, {**variables, 'params': params}, batch, train)
  return wrapped


def require_checkpoints(workdir: str, *, field: str, hint: str) -> None:
  """UsageError naming `field` unless `workdir` has a checkpoints
  directory (cheap: nothing is read); `hint` says how to make one."""
  directory = os.path.join(os.path.abspath(workdir), checkpointing.CHECKPOINTS)
  if not os.path.isdir(directory):
    raise UsageError(field, workdir, f'holds no checkpoints; {hint}')


@contextlib.contextmanager
def reading_checkpoints(workdir: str) -> Iterator[checkpointing.Checkpoints]:
  """Another run's checkpoints (a source model, a policy, an LM), opened
  read-only: nothing in its workdir is created, probed, cleaned up or
  moved, so a read-only directory loads, and so does a run that is still
  saving. Its experiment may be built inside (`check_workdir` then only
  resolves the path)."""
  with workdir_path.reading_another_run(), checkpointing.Checkpoints(
      workdir, every_steps=1, keep=1, async_save=False,
      read_only=True) as ckpts:
    yield ckpts


class TrainedRun(NamedTuple):
  config: ml_collections.ConfigDict
  exp: Experiment
  step: int
  state: Any  # The train state.
  meta: dict[str, Any]  # The checkpoint's metadata.


def load_trained(workdir: str,
                 build: Callable[[ml_collections.ConfigDict, str],
                                 Experiment], *,
                 field: str, task: str, what: str, hint: str) -> TrainedRun:
  """Another run's newest checkpoint that verifies, rebuilt from its saved
  config. A damaged checkpoint is skipped but left in place: the workdir
  belongs to the run that wrote it.

  Args:
    workdir: the trained run's workdir.
    build: the product's `build(config, workdir)`.
    field: the config field naming `workdir`, for messages.
    task: the `config.task` the run must have.
    what: the run it must be, for messages (e.g. 'an LM').
    hint: how to train one, for messages.

  Raises:
    UsageError: `workdir` holds no checkpoint, or another task's run.
    NoGoodCheckpoint: it holds checkpoints and none loads and verifies.
  """
  require_checkpoints(workdir, field=field, hint=hint)
  built = {}

  def abstract_state(meta: dict):
    if 'config' not in meta:
      raise UsageError(field, workdir, 'its checkpoint has no saved config')
    config = ml_collections.ConfigDict(json.loads(meta['config']))
    # An image classifier's config has no task field.
    if config.get('task', 'classification') != task:
      raise UsageError(field, workdir,
                       f'holds a {config.get("task", "classification")!r} '
                       f'run, not {what}')
    built['config'], built['exp'] = config, build(config, workdir)
    return built['exp'].abstract_state

  with reading_checkpoints(workdir) as ckpts:
    found = ckpts.restore_latest_good(abstract_state, move_damaged=False)
  if found is None:
    raise UsageError(field, workdir, f'holds no checkpoints; {hint}')
  step, state, meta = found
  return TrainedRun(built['config'], built['exp'], step, state, meta)
