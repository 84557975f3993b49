"""An RL run's settings and layout, checked before anything is read or computed.

`check_config` refuses a mistake in one line naming the field; the
learner's and the runtime's settings, the optimizer, and the meshes the
devices split into (a rollout mesh and a learner mesh: `runtime`'s split
in one process, each process's own devices in several) are read from the
config here, by the run (`train.rl.run`) and by `launch.compile`.
"""

import math
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
import ml_collections
import numpy as np
import optax

from train.errors import ConfigError
from train.lm import trainer as lm_trainer
from train.rl import grpo
from train.rl import learner as learner_lib
from train.rl import limits
from train.rl import processes as processes_lib
from train.rl import runtime as runtime_lib
from train.rl import scheduler as scheduler_lib
from train.rl import sft
from train.rl import tasks
from train.run import resume_check
from train.run import workdir_run
from train.training import sharding as sharding_lib
from train.training.experiment import check_seed

TASK = 'rl'
# rollout_processes may change: a run resumes on another process split.
MAY_CHANGE = ('log_every', 'checkpoint_every', 'keep_checkpoints',
              'cpu_devices', 'runtime.shutdown_timeout',
              'runtime.max_actor_restarts', 'sft_workdir',
              'rollout_processes', 'runtime.transfer_timeout',
              'runtime.peer_timeout')
# Unset in configs older than the multi-process runtime.
TRANSFER_TIMEOUT = 300.0
PEER_TIMEOUT = 60.0
# How an RL job splits into processes, in the run core's refusals of a
# workdir of the other checkpoint back-end.
SPLIT = workdir_run.JobSplit(
    field='rollout_processes',
    whole='a one-process run',
    whole_resume='resume it with one process (no --multihost)',
    part='a multi-process run (launch.rl --multihost)',
    part_resume='resume it with --multihost and rollout_processes set (any '
    'number of rollout processes)',
    holder='the learner of a multi-process run')


def loss_settings(config) -> learner_lib.LearnerSettings:
  g = config.grpo
  return learner_lib.LearnerSettings(
      loss=grpo.LossSettings(epsilon=g.epsilon, beta=g.beta,
                             correction=g.correction, is_cap=g.is_cap,
                             aggregation=g.aggregation,
                             temperature=config.temperature),
      group_size=g.group_size, iterations=g.iterations)


def runtime_settings(config) -> runtime_lib.RuntimeSettings:
  r = config.runtime
  return runtime_lib.RuntimeSettings(
      max_staleness=r.max_staleness, num_actors=r.num_actors,
      deterministic=r.deterministic, max_actor_restarts=r.max_actor_restarts,
      buffer_capacity=r.buffer_capacity)


def optimizer(config) -> optax.GradientTransformation:
  """Adam after clipping the gradient's global norm."""
  return optax.chain(
      optax.clip_by_global_norm(config.optimizer.grad_clip_norm),
      optax.adam(config.optimizer.learning_rate, b1=config.optimizer.b1,
                 b2=config.optimizer.b2))

def _positive_int(config, field: str) -> None:
  value = config
  for part in field.split('.'):
    value = value[part]
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise ConfigError(field, value, 'must be a positive integer')


def learner_layout(config) -> tuple[tuple[str, ...], tuple[int, ...],
                                    tuple[tuple[str, Any], ...]]:
  """The learner mesh's axes, shape and logical-axis rules: the config's
  `learner_mesh` block (absent by default: older runs' configs stay
  equal), else one 'data' axis with the policy replicated."""
  block = config.get('learner_mesh')
  if block is None:
    return ('data',), (-1,), (('batch', 'data'),)
  return (tuple(block.axes), tuple(block.shape),
          tuple(tuple(r) for r in block.rules))


def multi_process(config, devices: list | None = None) -> bool:
  """Whether this job's processes split into rollout and learner ones."""
  return (devices is None and jax.process_count() > 1
          and config.get('rollout_processes') is not None)


def meshes(config, devices: list | None = None) -> tuple[Mesh, Mesh]:
  """(rollout mesh, learner mesh) of `devices` (default: this job's).

  With several processes (`rollout_processes`), each is over this
  process's own devices: a rollout process uses the first, the learner
  the second.
  """
  axes, shape, rules = learner_layout(config)
  if multi_process(config, devices):
    local = jax.local_devices()
    rollout_mesh = Mesh(np.array(local), ('data',))
    learner_mesh = sharding_lib.make_mesh(shape, axes, local,
                                          field='learner_mesh')
    sharding_lib.check_rules(rules, axes, field='learner_mesh.rules')
    return rollout_mesh, learner_mesh
  rollout_mesh, learner_mesh = runtime_lib.split_devices(
      config.rollout_devices, devices, axes, shape)
  sharding_lib.check_rules(rules, axes, field='learner_mesh.rules')
  return rollout_mesh, learner_mesh


def learner_shardings(config, model: nn.Module,
                      mesh: Mesh) -> tuple[Any, NamedSharding]:
  """The policy's parameter shardings on the learner mesh (from its
  logical axes and the learner's rules) and the batch rows'."""
  _, _, rules = learner_layout(config)
  boxed = lm_trainer.abstract_variables(model)
  params = sharding_lib.logical_to_shardings(boxed['params'], mesh, rules)
  return params, sharding_lib.batch_sharding(mesh, rules)


def check_config(config: ml_collections.ConfigDict,
                 devices: list | None = None,
                 require_sft: bool = True,
                 processes: int | None = None) -> None:
  """ConfigError naming the field, before anything is read or computed.
  `devices`: the job's (default: this process's); `require_sft=False`
  lets the SFT workdir be unset (compiling needs its config only);
  `processes`: the job's process count before JAX starts (`launch.rl
  --multihost --num_processes`): checks everything that needs no device,
  `rollout_processes` against that count, and starts nothing."""
  if config.get('task') != TASK:
    raise ConfigError('task', config.get('task'), f'must be {TASK!r}')
  if require_sft:
    if not config.sft_workdir:
      raise ConfigError('sft_workdir', config.sft_workdir,
                        'required: the workdir of the SFT warm start '
                        '(launch.train with configs/rl_sft.py)')
    sft.check_has_checkpoints(config.sft_workdir)
  if not config.difficulties:
    raise ConfigError('difficulties', config.difficulties,
                      f'needs a difficulty in 1..{tasks.MAX_DIFFICULTY}')
  for d in config.difficulties:
    tasks.check(config.family, d, field='task')
  for field in ('prompts_per_batch', 'num_versions', 'eval_every',
                'eval_examples', 'log_every', 'checkpoint_every',
                'keep_checkpoints', 'rollout_devices'):
    _positive_int(config, field)
  check_seed(config)
  if not isinstance(config.temperature, (int, float)) or not (
      config.temperature > 0):
    raise ConfigError('temperature', config.temperature, 'must be > 0')
  loss_settings(config).check('grpo')
  runtime_settings(config).check('runtime')
  # Sizes, before anything is allocated: a billion of any of these takes
  # the process past the host's memory (14-18 GB when measured).
  limits.check_sizes(config)
  scheduler_lib.check_config(config)
  for field in ('shutdown_timeout', 'transfer_timeout', 'peer_timeout'):
    value = config.runtime.get(field, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < math.inf):
      raise ConfigError(f'runtime.{field}', value,
                        'must be a finite number of seconds > 0')
  for field in ('learning_rate', 'grad_clip_norm'):
    value = config.optimizer[field]
    if not (isinstance(value, (int, float)) and 0 < value < math.inf):
      raise ConfigError(f'optimizer.{field}', value, 'must be finite and > 0')
  if processes is not None:
    processes_lib.check_roles(config.get('rollout_processes'), processes)
    return
  if devices is None:
    processes_lib.roles(config)
  count = jax.device_count() if devices is None else len(devices)
  rollout_mesh, learner_mesh = meshes(config, devices)
  rows = config.prompts_per_batch * config.grpo.group_size
  _, _, rules = learner_layout(config)
  learner_rows = math.prod(learner_mesh.shape[a] for a in jax.tree.leaves(
      tuple(nn.logical_to_mesh_axes(('batch',), rules))))
  for name, size in (('rollout', rollout_mesh.devices.size),
                     ('learner data-parallel', learner_rows)):
    if rows % size:
      raise ConfigError('prompts_per_batch', config.prompts_per_batch,
                        f'x group_size={config.grpo.group_size} = {rows} '
                        f'rows must split over the {size} {name} devices '
                        f'(of {count})')
  if require_sft and devices is None:
    limits.check_host_memory(config, sequence_length(config))


def check_policy(config, policy_config, max_len: int) -> None:
  """The SFT policy's family and length against this run's."""
  if config.family not in policy_config.data.families:
    raise ConfigError('family', config.family,
                      f'the SFT policy was trained on '
                      f'{list(policy_config.data.families)}')
  length = sequence_length(config)
  if length > max_len:
    raise ConfigError('difficulties', config.difficulties,
                      f'need {length} tokens; the SFT model holds '
                      f'{max_len}')


def sequence_length(config) -> int:
  """The learner's padded length: the longest prompt and answer."""
  top = max(config.difficulties)
  return (tasks.max_prompt_tokens(config.family, top)
          + tasks.max_answer_tokens(config.family, top))


def check_resume(config, workdir: str, step: int, meta: dict) -> None:
  """The saved config of `workdir` at `step` against `config`."""
  resume_check.check_task(config, workdir, step, meta, task=TASK,
                          what='an RL run', may_change=MAY_CHANGE)
