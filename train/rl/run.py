"""`train_and_evaluate(config, workdir)` for asynchronous GRPO (`config.task = 'rl'`).

The policy starts from the SFT warm start (`config.sft_workdir`, written
by `launch.train` with configs/rl_sft.py). The devices split into a
rollout mesh and a learner mesh (`train.rl.runtime`); actor threads
generate G completions of each of P prompts per batch on the first, the
learner (this thread) runs one GRPO update per batch on the second
(`train.rl.learner`) and publishes each new version to the actors by
resharding its weights. Batch k holds P prompts of one difficulty, drawn
uniformly from `config.difficulties` by (seed, k), so its generation cost
grows with that difficulty (longer answers, more decoding steps).

The workdir gets the trainer's guarantees from the same core
(`train.run.resumable`): one run at a time (a lock), the config checked
against the checkpoint's on resume, the SFT policy pinned by content,
verified Orbax checkpoints every `checkpoint_every` versions,
SIGTERM/SIGINT save one and stop. A checkpoint holds the learner (weights, optimizer state,
version), the counters behind the metrics, and the weights of the last
s versions, so that in `runtime.deterministic` mode a resumed run
generates every later batch from the same version as an uninterrupted
one and ends bit for bit the same. Batches generated but not yet trained
are dropped on resume and generated again (with the same prompts and
keys); outside deterministic mode they may then use a newer version.

Metrics (metrics.jsonl, TensorBoard): per update the reward, the batch's
difficulty and staleness, the loss and its diagnostics (clip fraction,
importance weights and their effective sample size, the behaviour
policy's KL to the learner's), samples/s and tokens/s since the start,
the learner's busy fraction; every `eval_every` versions greedy pass@1
on each difficulty's held-out set. results.json adds the staleness
histogram and difficulty mix of the trained batches; pass_at_1.png plots
pass@1 against wall time.
"""

import dataclasses
import functools
import hashlib
import math
import threading
import time
from typing import Any

from absl import logging
import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from train.training import aot
from train.run import checksums
from train import fileio
from train.run import local_checkpoints
from train.run import metrics as metrics_lib
from train.analysis import plots
from train.run import preemption
from train.run import process_group
from train.run import resumable
from train.run import resume_check
from train.training import sharding as sharding_lib
from train.training import steps
from train.errors import ConfigError, Preempted, RunError, UsageError
from train.training.experiment import check_seed
from train.training.experiment import check_workdir
from train.lm import trainer as lm_trainer
from train.rl import control
from train.rl import grpo
from train.rl import learner as learner_lib
from train.rl import learner_group
from train.rl import limits
from train.rl import rollout as rollout_lib
from train.rl import processes as processes_lib
from train.rl import runtime as runtime_lib
from train.rl import scheduler as scheduler_lib
from train.rl import sft
from train.rl import tasks
from train.rl import transport as transport_lib

RESULTS = 'results.json'
PLOT = 'pass_at_1.png'
TASK = 'rl'
# The console line, every PROGRESS_EVERY versions and at evaluations.
PROGRESS_EVERY = 10
PROGRESS_KEYS = ('reward', 'staleness', 'samples_per_second',
                 'learner_busy_fraction', 'eval/pass_at_1')
# rollout_processes may change: a run resumes on another process split.
MAY_CHANGE = ('log_every', 'checkpoint_every', 'keep_checkpoints',
              'cpu_devices', 'runtime.shutdown_timeout',
              'runtime.max_actor_restarts', 'sft_workdir',
              'rollout_processes', 'runtime.transfer_timeout',
              'runtime.peer_timeout')
# Unset in configs older than the multi-process runtime.
TRANSFER_TIMEOUT = 300.0
PEER_TIMEOUT = 60.0


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


def fingerprint(params: Any) -> str:
  """SHA-256 of the parameters' bytes in tree order: equal iff bit-equal."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return digest.hexdigest()


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
  boxed = jax.eval_shape(functools.partial(lm_trainer.init_variables, model),
                         jax.random.key(0))
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


def _update_program(config, model, tx, lsettings, params, learner_mesh
                    ) -> aot.Program:
  """The learner's update on abstract `params` (with their shardings)."""
  param_shardings, rows = learner_shardings(config, model, learner_mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), params, param_shardings)
  opt_shardings = sharding_lib.optimizer_state_shardings(
      tx, params, param_shardings, learner_mesh)
  opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), jax.eval_shape(tx.init, params),
                           opt_shardings)
  return learner_lib.update_program(
      model, tx, lsettings, params=params, opt_state=opt_state,
      rows=config.prompts_per_batch * config.grpo.group_size,
      length=sequence_length(config), batch_sharding=rows,
      rules=learner_layout(config)[2])


def programs(config: ml_collections.ConfigDict,
             policy_config: ml_collections.ConfigDict, devices: list
             ) -> list[tuple[str, Mesh, Any, list[aot.Program]]]:
  """For `launch.compile`: the learner's update on the learner mesh and
  the rollout's generation (prefill and KV-cached decoding of the longest
  answer, with behaviour log-probabilities) on the rollout mesh, for the
  policy `policy_config` describes, on shapes only. Returns (name, mesh,
  rules, programs) per mesh."""
  check_config(config, devices, require_sft=False)
  model = lm_trainer.create_model(policy_config)
  check_policy(config, policy_config, model.max_len)
  rollout_mesh, learner_mesh = meshes(config, devices)
  params = nn.meta.unbox(jax.eval_shape(
      functools.partial(lm_trainer.init_variables, model),
      jax.random.key(0)))['params']
  update = _update_program(config, model, optimizer(config),
                           loss_settings(config), params, learner_mesh)
  top = max(config.difficulties)
  rows = config.prompts_per_batch * config.grpo.group_size
  return [('learner', learner_mesh, learner_layout(config)[2], [update]),
          ('rollout', rollout_mesh, (('batch', 'data'),),
           [rollout_lib.sample_program(
               model, params, rows, tasks.max_prompt_tokens(config.family,
                                                            top),
               tasks.max_answer_tokens(config.family, top),
               config.temperature, rollout_mesh)])]


@dataclasses.dataclass(frozen=True)
class Item:
  """A generated batch: its rollout, difficulty and generation time."""
  rollout: rollout_lib.Rollout
  difficulty: int
  seconds: float


# A batch's arrays as they cross from a rollout process to the learner.
_BATCH_ARRAYS = ('prompt', 'prompt_valid', 'completion', 'completion_mask',
                 'behaviour_logps', 'rewards')


def generate_batch(config, model, base_key: jax.Array, k: int, v: int,
                   params, difficulty: int | None, sharding: NamedSharding,
                   codec: tasks.Codec = tasks.BYTES) -> Item:
  """Batch k (of `difficulty`, or its drawn one if None) sampled from
  version v's `params`, with the same prompts and key wherever it runs;
  timed."""
  difficulty, problems = batch_problems(config, k, difficulty)
  start = time.perf_counter()
  out = rollout_lib.sample(
      model, params, problems, jax.random.fold_in(base_key, k),
      temperature=config.temperature,
      num_steps=tasks.max_answer_tokens(config.family, difficulty),
      version=v, sharding=sharding, codec=codec)
  return Item(out, difficulty, time.perf_counter() - start)


def batch_problems(config, k: int, difficulty: int | None = None
                   ) -> tuple[int, list[tasks.Problem]]:
  """Batch k's difficulty and its P prompts, each G times (groups together).

  The difficulty is uniform by (seed, k) unless a scheduler chose it; the
  prompts' seed is drawn from (seed, k) either way.
  """
  rng = np.random.default_rng([config.seed, k, 17])
  drawn = int(rng.choice(list(config.difficulties)))
  difficulty = drawn if difficulty is None else difficulty
  prompts = tasks.sample(config.family, difficulty, config.prompts_per_batch,
                         seed=int(rng.integers(2**31)))
  return difficulty, [p for p in prompts
                      for _ in range(config.grpo.group_size)]


def sequence_length(config) -> int:
  """The learner's padded length: the longest prompt and answer."""
  top = max(config.difficulties)
  return (tasks.max_prompt_tokens(config.family, top)
          + tasks.max_answer_tokens(config.family, top))


def _check_resume(config, workdir: str, step: int, meta: dict) -> None:
  resume_check.check_task(config, workdir, step, meta, task=TASK,
                          what='an RL run', may_change=MAY_CHANGE)


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, Any]:
  """Trains the policy in `workdir` (resuming it); returns the results.

  Raises:
    UsageError: a setting is invalid, the SFT workdir holds no usable
      policy, or the workdir belongs to another run.
    WorkdirBusy: another run holds the workdir.
    NoGoodCheckpoint: the workdir's checkpoints are all damaged.
    ActorFailed: actors failed more often than allowed.
    NonFiniteLossError: the loss, a gradient norm or the policy went
      non-finite (nothing non-finite is saved).
    DiskFull: a write ran out of space (earlier checkpoints are intact).
    Preempted: SIGTERM or SIGINT arrived; a checkpoint was saved first.
  """
  if not multi_process(config):
    check_config(config)  # Refuses rollout_processes on one process.
  roles = processes_lib.roles(config)
  if roles is None:
    workdir = check_workdir(workdir)
    _check_checkpoint_format(config, workdir, multi=False)
    with resumable.open_run(
        config, workdir, check_config=functools.partial(
            _check_resume, config, workdir), results_name=RESULTS) as run:
      return _train(config, run)
  job = _Job(config, roles)
  try:
    # Under the job's channel: a process that refuses (its SFT workdir
    # missing on its host, say) tells the others.
    check_config(config)
    if roles.is_follower:
      return _follow(config, job)
    if not roles.is_learner:
      return _rollout(config, job)
    # The learner holds the workdir alone; the rollout processes never
    # touch it.
    with process_group.alone():
      _check_local_workdir(workdir)
      workdir = check_workdir(workdir)
      _check_checkpoint_format(config, workdir, multi=True)
      with resumable.open_run(
          config, workdir, check_config=functools.partial(
              _check_resume, config, workdir), results_name=RESULTS,
          checkpoints=local_checkpoints.LocalCheckpoints) as run:
        job.tell('admitted', True)
        results = _train(config, run, job)
    job.tell('done', {'ok': True})
    return results
  except Preempted as e:
    if roles.is_learner:
      job.tell('done', {'stop': e.signal_name, 'step': e.step})
    raise
  except BaseException as e:
    # Every process ends with the refusing one's exit status and line:
    # the learner tells the run's end, any other process the learner.
    # The echo of another's refusal is not told again.
    if isinstance(e, control.PeerStopped):
      pass
    elif roles.is_learner:
      told = control.told(e)
      job.tell('done', {'error': told['line'], 'code': told['code']})
    else:
      job.tell(f'failed/{roles.process}', control.told(e))
    job.close(error=True, dead=getattr(e, 'process', None))
    raise
  finally:
    job.close()


def _check_local_workdir(workdir: str) -> None:
  if fileio.is_remote(workdir):
    raise UsageError(
        '--workdir', workdir, 'the learner of a multi-process run writes '
        'its checkpoints alone, to a file system (local, or a bucket '
        'mounted, e.g. by Cloud Storage FUSE), not to a bucket URL')


def _check_checkpoint_format(config, workdir: str, multi: bool) -> None:
  """A one-process run checkpoints through Orbax, the learner of a
  multi-process one alone (train.run.local_checkpoints, which any number of
  rollout processes resumes); neither reads the other's."""
  local = local_checkpoints.newest_is_local(workdir)
  if local is None or local == multi:
    return
  if multi:
    raise ConfigError(
        'rollout_processes', config.get('rollout_processes'),
        f'{workdir} holds the checkpoints of a one-process run; resume it '
        'with one process (no --multihost), or give a new workdir')
  raise ConfigError(
      'rollout_processes', None,
      f'{workdir} holds the checkpoints of a multi-process run (launch.rl '
      '--multihost); resume it with --multihost and rollout_processes set '
      '(any number of rollout processes), or give a new workdir')


class _Job:
  """A multi-process run's control plane: channel, liveness, transport."""

  def __init__(self, config, roles: processes_lib.Roles):
    self.roles = roles
    self.halt = threading.Event()
    # The defaults stand in for values check_config (run under the job,
    # so that a refusal reaches the others) has still to refuse.
    self.timeout = _seconds(config.runtime.get('transfer_timeout'),
                            TRANSFER_TIMEOUT)
    self.channel = processes_lib.channel(self.timeout, self.halt.is_set)
    self.peer_timeout = _seconds(config.runtime.get('peer_timeout'),
                                 PEER_TIMEOUT)
    self._closed = False
    self.liveness = control.Liveness(
        self.channel, roles.process, roles.names,
        dead_after=self.peer_timeout)
    self.liveness.start()
    self.transport = transport_lib.DevicePutTransport(
        self.channel, roles.process, self.timeout)

  def ended(self) -> dict[str, Any] | None:
    """The learner's end of the run (None while it goes on).

    Raises:
      control.PeerStopped: the learner refused or failed (its exit status
        and line).
    """
    done = self.channel.try_get('done')
    if done is not None and 'error' in done:
      raise control.PeerStopped(self.roles.learner, 'learner',
                                done.get('code', 1), done['error'])
    return done

  def wait_admitted(self) -> None:
    """Waits until the learner holds the workdir and found it fit to
    resume: a refusal of it (busy, another kind of run, another config)
    then ends every process before it read or printed anything.

    Raises:
      control.PeerStopped: the learner refused.
      control.ProcessDied: the learner stopped beating.
    """
    while self.channel.try_get('admitted') is None:
      self.ended()
      self.liveness.check()
      if self.halt.wait(0.05):
        raise runtime_lib.Stopped()

  def tell(self, key: str, value: Any) -> None:
    """Sets `key` if the control plane is still there (a failure to tell
    must not hide the error that ends the run)."""
    try:
      self.channel.set(key, value)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('could not tell the other processes %s: %s', key, e)

  def close(self, error: bool = False, dead: int | None = None) -> None:
    """Stops this process's side. Process 0 hosts jax.distributed's
    service, whose end aborts every other process: after an error it waits
    (up to `peer_timeout`) for the others, except a `dead` one, to end
    theirs, so that each reports its own one line."""
    if self._closed:
      return
    self._closed = True
    self.halt.set()
    self.transport.stop()
    self.liveness.stop()
    self.tell(f'exited/{self.roles.process}', 1)
    if self.roles.process != 0 or not error:
      return
    others = [p for p in range(self.roles.num_processes)
              if p not in (0, dead)]
    deadline = time.monotonic() + self.peer_timeout
    while time.monotonic() < deadline and any(
        self.channel.try_get(f'exited/{p}') is None for p in others):
      time.sleep(0.05)
    time.sleep(0.5)  # Their last line is being printed.


def _seconds(value: Any, default: float) -> float:
  """`value` if it is a finite number of seconds > 0, else `default`."""
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
        and 0 < value < math.inf)
  return value if ok else default


def _counters(bound: int, saved: dict | None = None
              ) -> dict[str, np.ndarray]:
  """The trained batches' staleness (0..bound) and difficulty counts, their
  staleness per difficulty, the batches dropped by admission per
  difficulty, the totals (samples, tokens, learner busy seconds) and the
  scheduler's seconds on the learner (its own, the curvature's); kept in
  the checkpoint's meta."""
  difficulties = tasks.MAX_DIFFICULTY + 1
  counters = {'staleness': np.zeros(bound + 1, np.int64),
              'difficulty': np.zeros(difficulties, np.int64),
              'staleness_by_difficulty': np.zeros((difficulties, bound + 1),
                                                  np.int64),
              'dropped': np.zeros(difficulties, np.int64),
              'totals': np.zeros(3, np.float64),
              'scheduler': np.zeros(2, np.float64)}
  for key, value in (saved or {}).items():
    counters[key] = np.array(value, counters[key].dtype)
  return counters


# Every float of the policy and optimizer state finite (before a save; a
# finite loss can still leave inf in the parameters, e.g. an infinite
# learning rate).
_policy_finite = jax.jit(lambda tree: steps.tree_is_finite(
    (tree['params'], tree['opt_state'])))


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where the policy lives and the learner's compiled update."""
  rollout_replicated: NamedSharding
  rollout_rows: NamedSharding
  learner_mesh: Mesh
  learner_rows: NamedSharding
  param_shardings: Any
  # (params, opt_state, batch, reference) -> (params, opt_state, metrics)
  update: Any


def _group(config, model, tx, params, roles: processes_lib.Roles
           ) -> learner_group.Group:
  """The learner group's mesh and update (on every learner process)."""
  axes, shape, rules = learner_layout(config)
  devices = [d for d in jax.devices() if d.process_index in roles.learners]
  mesh = sharding_lib.make_mesh(shape, axes, devices, field='learner_mesh')
  param_shardings, rows = learner_shardings(config, model, mesh)
  learner_group.check_replicated(
      param_shardings, config.prompts_per_batch * config.grpo.group_size,
      mesh)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), params, param_shardings)
  opt_shardings = sharding_lib.optimizer_state_shardings(
      tx, abstract, param_shardings, mesh)
  update = _update_program(config, model, tx, loss_settings(config), params,
                           mesh).lower().compile()
  local = NamedSharding(Mesh(np.array(jax.local_devices()), ('data',)), P())
  return learner_group.Group(mesh, param_shardings, opt_shardings, rows,
                             local, update)


def _lead_update(group: learner_group.Group, job: '_Job'):
  """The lead's update over the group: the batch goes to the followers,
  then every learner process runs the step."""
  on_group = []  # The reference policy's group view, made once.

  def update(params, opt_state, batch, reference):
    if not on_group:
      on_group.append(group.group_reference(reference))
    host = jax.device_get(batch)
    for p in job.roles.followers:
      job.transport.send('step', {}, list(host), p)
    return learner_group.wait_ready(
        group.step(params, opt_state, host, on_group[0]),
        lambda: processes_lib.check_peers(job.transport, job.liveness))
  return update


def _layout(config, model, tx, params, job: '_Job | None' = None
            ) -> _Layout:
  rollout_mesh, learner_mesh = meshes(config)
  param_shardings, learner_rows = learner_shardings(config, model,
                                                    learner_mesh)
  if job is not None and job.roles.followers:
    update = _lead_update(_group(config, model, tx, params, job.roles), job)
  else:
    # Compiled ahead of time under the learner's mesh and rules, as
    # `launch.compile` compiles it.
    update = _update_program(config, model, tx, loss_settings(config),
                             params, learner_mesh).lower().compile()
  if multi_process(config):
    # The learner process has no rollout mesh: its published versions stay
    # on its devices (the transport sends them), and a batch generated
    # again after admission refused it is generated on the learner mesh.
    return _Layout(NamedSharding(learner_mesh, P()), learner_rows,
                   learner_mesh, learner_rows, param_shardings, update)
  return _Layout(NamedSharding(rollout_mesh, P()),
                 NamedSharding(rollout_mesh, P('data')), learner_mesh,
                 learner_rows, param_shardings, update)


def _train(config, run: resumable.Run, job: '_Job | None' = None
           ) -> dict[str, Any]:
  sft_config, model, sft_params, codec = sft.load_policy(config.sft_workdir)
  check_policy(config, sft_config, model.max_len)
  # The warm start (the first policy and GRPO's reference) is pinned by
  # content: `sft_workdir` may move, but another policy there is refused
  # on resume and on a finished rerun.
  run.pin({'config.sft_workdir': checksums.digest(sft_params)})
  finished = run.finished(config.num_versions)
  if finished is not None:
    return finished
  tx = optimizer(config)
  layout = _layout(config, model, tx, sft_params, job)
  params = jax.device_put(sft_params, layout.param_shardings)
  s = config.runtime.max_staleness
  fresh = {'params': params, 'opt_state': jax.jit(
      tx.init, out_shardings=sharding_lib.optimizer_state_shardings(
          tx, params, layout.param_shardings, layout.learner_mesh))(params),
           'history': [params] * s}
  found = run.restore(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      fresh))
  if found is not None:
    logging.info('Resuming at version %d of %d (batches generated but not '
                 'trained were dropped)', found[0], config.num_versions)
  run.finite = resumable.Finite(_policy_finite, 'policy state',
                                can_skip=False)
  learner = _Learner(config, model, codec, run, layout, reference=params,
                     restored=found or (0, fresh, {}), job=job)
  # The learner holds what it needs: a name kept here would hold the warm
  # start's host copy, the first policy (the reference, unless beta = 0)
  # and, on resume, a fresh optimizer state through the run (up to 4 GiB
  # of the real Gemma's).
  del sft_params, params, fresh, found
  if job is not None:
    for p in job.roles.followers:  # They start from the lead's state.
      job.transport.send('state', {'version': learner.version},
                         jax.tree.leaves((learner.state['params'],
                                          learner.state['opt_state'])), p)
  if learner.version == 0 and not learner.curve:
    run.writer.write(0, learner.evaluate(0))
  learner.start()
  try:
    with run.stopping():
      for k in range(learner.version, config.num_versions):
        learner.log(learner.train_batch(k))
        run.end_step(learner.version, learner.checkpoint)
  finally:
    learner.stop(config.runtime.shutdown_timeout)
  results = _results(config, learner.counters, learner.curve, learner.wall())
  if learner.scheduler.diagnostics():
    results['gas'] = learner.scheduler.diagnostics()
  results['params_sha256'] = fingerprint(learner.state['params'])
  run.finish(results, learner.checkpoint)
  _plot(learner.curve, config, fileio.join(run.workdir, PLOT))
  return results


class _Learner:
  """The learner's side of a run: the policy and its counters, the
  scheduler, and the actors generating from the published versions."""

  def __init__(self, config, model, codec: tasks.Codec, run: resumable.Run,
               layout: _Layout, reference, restored: tuple[int, dict, dict],
               job: '_Job | None' = None):
    self.config, self.model, self.run, self.layout = config, model, run, layout
    self.codec = codec
    # The update reads the reference only when beta > 0; held for nothing
    # it is a policy's copy once the first update replaced the weights.
    self.reference = reference if config.grpo.beta > 0 else None
    self.version, self.state, meta = restored
    s = self.bound = config.runtime.max_staleness
    rsettings = runtime_settings(config)
    self.settings = loss_settings(config)
    self.length = sequence_length(config)
    self.counters = _counters(s, meta.get('counters'))
    self.wall_offset = float(meta.get('wall_seconds', 0.0))
    self.curve = list(meta.get('curve', []))
    self.heldout = {d: tasks.evaluation_set(config.family, d,
                                            config.eval_examples)
                    for d in config.difficulties}
    self.halt = threading.Event()
    self.scheduler = scheduler_lib.make(scheduler_lib.settings(config),
                                        rsettings.deterministic,
                                        stopped=self.halt.is_set)
    if meta:
      self.scheduler.restore(self.version, meta.get('scheduler', {}))
    self.snapshots = runtime_lib.Snapshots(keep=s + 1)
    # The last s versions, oldest first, then the current one.
    for i, old in enumerate(self.state['history']):
      if self.version - s + i >= 0:
        self.snapshots.publish(self.version - s + i, jax.device_put(
            old, layout.rollout_replicated))
    self.snapshots.publish(self.version, jax.device_put(
        self.state['params'], layout.rollout_replicated))
    self.buffer = runtime_lib.Buffer(rsettings.capacity,
                                     next_needed=self.version)
    self.base_key = jax.random.key(config.seed)
    self.job = job
    if job is None:
      self.actors = runtime_lib.Actors(
          self.generate, self.snapshots, self.buffer, rsettings,
          start=self.version,
          plan=lambda k, latest: self.scheduler.plan(k, latest).min_version)
    else:
      self.actors = processes_lib.LearnerServices(
          roles_=job.roles, channel_=job.channel, transport=job.transport,
          liveness=job.liveness, snapshots=self.snapshots,
          plan=self.scheduler.plan, window=rsettings.capacity,
          leaves=jax.tree.leaves, deliver=self._deliver,
          request_stop=run.request_stop)
    self.progress = metrics_lib.Progress(self.version, config.num_versions)
    self.started = self.published = time.perf_counter()

  def start(self) -> None:
    """Starts the actors; the first step's time counts from here."""
    if self.job is None:
      self.actors.start()
    else:
      self.actors.start(self.version)
    self.published = time.perf_counter()

  def _deliver(self, meta: dict, arrays: list[jax.Array]) -> None:
    """A batch a rollout process generated (the transport's thread)."""
    k, difficulty = meta['k'], meta['difficulty']
    _, problems = batch_problems(self.config, k, difficulty)
    out = rollout_lib.Rollout(
        tuple(problems), version=meta['version'],
        **{name: np.asarray(a) for name, a in zip(_BATCH_ARRAYS, arrays)})
    self.buffer.deliver(k, Item(out, difficulty, meta['seconds']))

  def stop(self, timeout: float) -> None:
    """Stops the scheduler's waits and the actors; waits `timeout` s."""
    self.halt.set()
    self.actors.stop()
    self.actors.join(timeout)

  def generate(self, k: int, v: int, params_v) -> Item:
    return generate_batch(self.config, self.model, self.base_key, k, v,
                          params_v, self.scheduler.plan(k, v).difficulty,
                          self.layout.rollout_rows, self.codec)

  def wall(self) -> float:
    return self.wall_offset + time.perf_counter() - self.started

  def evaluate(self, v: int) -> dict[str, float]:
    devices = self.layout.learner_mesh.devices.size
    scores = {f'eval/pass_at_1_d{d}': rollout_lib.pass_at_1(
        self.model, self.state['params'], problems,
        sharding=self.layout.learner_rows
        if len(problems) % devices == 0 else None, codec=self.codec)
              for d, problems in self.heldout.items()}
    scores['eval/pass_at_1'] = float(np.mean(list(scores.values())))
    self.curve.append({'version': v, 'wall': self.wall(), **scores})
    return scores

  def checkpoint(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tree and metadata a checkpoint at `version` holds."""
    v, s = self.version, self.bound
    history = [self.snapshots.held().get(v - s + i) for i in range(s)]
    tree = {'params': self.state['params'],
            'opt_state': self.state['opt_state'],
            'history': [self.state['params'] if h is None else
                        jax.device_put(h, self.layout.param_shardings)
                        for h in history]}
    meta = {'counters': {k: c.tolist() for k, c in self.counters.items()},
            'scheduler': self.scheduler.save(v),
            'wall_seconds': self.wall(), 'curve': self.curve}
    return tree, meta

  def train_batch(self, k: int) -> dict[str, float]:
    """Trains batch k (version k -> k + 1), publishes the new version;
    returns its metrics."""
    if self.job is not None:
      self.actors.advance(k)
    item = self.buffer.take(k, self.actors.check)
    clock = time.perf_counter()
    admitted = self.scheduler.admit(k, item.difficulty,
                                    k - item.rollout.version)
    scheduler_seconds = time.perf_counter() - clock
    if not admitted:
      # Over its budget (the budget tightened since it was planned):
      # generated again from the current version, so nothing trains
      # stale and no difficulty is skipped.
      self.counters['dropped'][item.difficulty] += 1
      item = self.generate(k, k, self.snapshots.held()[k])
    out = item.rollout
    staleness = k - out.version
    if not 0 <= staleness <= self.bound:
      raise RuntimeError(f'batch {k} from version {out.version}: '
                         f'staleness {staleness} outside [0, {self.bound}]')
    host_batch = learner_lib.assemble(out, self.settings.group_size,
                                      self.length)
    weight = self.scheduler.loss_weight(item.difficulty)
    if weight != 1.0:
      host_batch = host_batch._replace(
          advantages=host_batch.advantages * np.float32(weight))
    batch = jax.device_put(host_batch, self.layout.learner_rows)
    begin = time.perf_counter()
    params, opt_state, m = self.layout.update(
        self.state['params'], self.state['opt_state'], batch,
        self.state['params'] if self.reference is None else self.reference)
    m = jax.device_get(m)
    busy = time.perf_counter() - begin
    bad = sorted(key for key, x in m.items() if not np.all(np.isfinite(x)))
    if bad:  # Stop before the policy is published or saved.
      self.run.stop_nonfinite(
          k + 1, 'loss' if 'loss' in bad else f'train/{bad[0]}',
          can_skip=False)
    self.state['params'], self.state['opt_state'] = params, opt_state
    self.version = version = k + 1
    curvatures, curvature_seconds = None, 0.0
    self.scheduler.remember(item.difficulty, batch)
    if self.scheduler.needs_curvature(version):
      clock = time.perf_counter()
      curvatures = self.scheduler.curvatures(self.model, params, version)
      curvature_seconds = time.perf_counter() - clock
    now = clock = time.perf_counter()
    scheduler_scalars = self.scheduler.observe(
        version, difficulty=item.difficulty, rewards=out.rewards,
        rows=len(out.rewards), generation_seconds=item.seconds,
        step_seconds=now - self.published, regenerated=not admitted,
        curvatures=curvatures)
    scheduler_seconds += time.perf_counter() - clock
    self.snapshots.publish(version, jax.device_put(
        params, self.layout.rollout_replicated))
    self.published = time.perf_counter()
    c = self.counters
    c['staleness'][staleness] += 1
    c['difficulty'][item.difficulty] += 1
    c['staleness_by_difficulty'][item.difficulty, staleness] += 1
    c['totals'] += [len(out.rewards), out.generated_tokens, busy]
    c['scheduler'] += [scheduler_seconds, curvature_seconds]
    elapsed = self.wall()
    scalars = {f'train/{key}': float(x) for key, x in m.items()}
    scalars.update(scheduler_scalars)
    if curvatures:
      scalars.update({f'gas/lambda_max/d{d}': x
                      for d, x in curvatures.items()})
    scalars.update({
        'reward': float(out.rewards.mean()),
        'difficulty': float(item.difficulty),
        'staleness': float(staleness),
        'generation_seconds': item.seconds,
        'samples_per_second': c['totals'][0] / elapsed,
        'tokens_per_second': c['totals'][1] / elapsed,
        'learner_busy_fraction': c['totals'][2] / elapsed,
        'buffer': float(len(self.buffer)),
        'actor_failures': float(self.actors.failures)})
    return scalars

  def log(self, scalars: dict[str, float]) -> None:
    """Evaluates when due; writes the metrics and the progress line."""
    version, config = self.version, self.config
    if version % config.eval_every == 0 or version == config.num_versions:
      scalars.update(self.evaluate(version))
    if version % config.log_every == 0 or 'eval/pass_at_1' in scalars:
      self.run.writer.write(version, scalars)
    if version % PROGRESS_EVERY == 0 or 'eval/pass_at_1' in scalars:
      rate, eta = self.progress.update(version)
      metrics_lib.log_progress(
          version, config.num_versions,
          {k: scalars[k] for k in PROGRESS_KEYS if k in scalars},
          rate, eta, console=('eval/pass_at_1',))


def _rollout(config, job: _Job) -> dict[str, Any]:
  """A rollout process: generates batches for the learner until it ends.

  Returns what it generated; raises `Preempted` when the learner stopped
  for a signal (the launcher exits as the learner did), `RunError` when
  the learner failed.
  """
  roles, ch = job.roles, job.channel
  # Until its loop handles them, signals end this process in one line:
  # jax.distributed's notifier, which owns SIGTERM otherwise, is answered
  # only at the learner's next step (the loop's handlers replace it too).
  with preemption.raise_on_signals():
    job.wait_admitted()
  with process_group.alone():  # Read with this process's devices only.
    sft_config, model, sft_params, codec = sft.load_policy(
        config.sft_workdir)
  check_policy(config, sft_config, model.max_len)
  treedef = jax.tree.structure(sft_params)
  del sft_params
  rollout_mesh, _ = meshes(config)
  replicated = NamedSharding(rollout_mesh, P())
  rows = NamedSharding(rollout_mesh, P('data'))
  settings = runtime_settings(config)
  window = settings.capacity
  snapshots = processes_lib.RemoteSnapshots(
      ch, roles.process, keep=window + settings.max_staleness + 2,
      timeout=job.timeout)

  def receive(kind, meta, src, arrays):
    if kind != 'weights' or src != roles.learner:
      raise ValueError(f'a rollout process received {kind!r} from {src}')
    snapshots.versions.add(meta['version'], jax.tree.unflatten(
        treedef, [jax.device_put(a, replicated) for a in arrays]))

  job.transport.start(receive)
  with preemption.raise_on_signals():
    while (start := ch.try_get('start')) is None:  # The learner restores.
      # Or refused (a damaged checkpoint, say), or found the run finished.
      if job.ended() is not None:
        return {'role': 'rollout', 'process': roles.process,
                'batches_sent': 0}
      job.liveness.check()
      if job.halt.wait(0.05):
        raise runtime_lib.Stopped()
  base_key = jax.random.key(config.seed)
  plans: dict[int, tuple[int, int]] = {}

  def plan(k: int, latest: int) -> int:
    del latest  # The learner's scheduler decides, with its own latest.
    if k not in plans:  # A restarted actor plans its batch again.
      plans[k] = tuple(ch.get(f'plan/{k}', timeout=math.inf))
      ch.delete(f'plan/{k}')  # Batch k is claimed by this process alone.
    return plans[k][1]

  def generate(k: int, v: int, params) -> Item:
    return generate_batch(config, model, base_key, k, v, params,
                          plans[k][0], rows, codec)

  def send(k: int, item: Item) -> None:
    out = item.rollout
    job.transport.send(
        'batch', {'k': k, 'version': out.version,
                  'difficulty': item.difficulty, 'seconds': item.seconds},
        [getattr(out, name) for name in _BATCH_ARRAYS], roles.learner)

  claim = processes_lib.remote_claim(ch, start, window, job.halt.is_set,
                                     total=config.num_versions)
  actors = runtime_lib.Actors(generate, snapshots,
                              processes_lib.RemoteBuffer(send), settings,
                              start=start, plan=plan, claim=claim)
  stop = preemption.StopFlag()
  forwarded = False
  with process_group.alone(), stop.installed():
    actors.start()
    try:
      while (done := job.ended()) is None:
        actors.check()
        processes_lib.check_peers(job.transport, job.liveness, job.ended)
        if stop.event.is_set() and not forwarded:
          ch.set('stop', stop.signal_name)
          forwarded = True
        time.sleep(0.05)
    except RunError:
      job.ended()  # A failure here may be the echo of the learner's end.
      raise
    finally:
      job.halt.set()
      actors.stop()
      snapshots.stop()
      try:
        actors.join(config.runtime.shutdown_timeout)
      except RuntimeError as e:
        logging.warning('%s', e)
  if 'stop' in done:
    raise Preempted(done['step'], done['stop'])
  return {'role': 'rollout', 'process': roles.process,
          'batches_sent': job.transport.sent}


def _follow(config, job: _Job) -> dict[str, Any]:
  """A learner process that follows the lead: it joins every update over
  the learner group (`train.rl.learner_group`) until the run ends.

  Returns how many updates it joined; raises `Preempted` when the lead
  stopped for a signal, `RunError` when it failed.
  """
  roles, ch = job.roles, job.channel
  job.wait_admitted()
  with process_group.alone():  # Read with this process's devices only.
    sft_config, model, sft_params, _ = sft.load_policy(config.sft_workdir)
  check_policy(config, sft_config, model.max_len)
  tx = optimizer(config)
  group = _group(config, model, tx, sft_params, roles)
  reference = group.group_reference(jax.device_put(sft_params, group.local))
  treedef = jax.tree.structure((sft_params, jax.eval_shape(tx.init,
                                                           sft_params)))
  inbox = learner_group.Inbox()
  job.transport.start(inbox.receive)
  stop = preemption.StopFlag()
  forwarded = False
  state, updates = None, 0

  def check() -> None:
    nonlocal forwarded
    processes_lib.check_peers(job.transport, job.liveness, job.ended)
    if stop.event.is_set() and not forwarded:
      ch.set('stop', stop.signal_name)
      forwarded = True

  with stop.installed():
    while (done := job.ended()) is None:
      message = inbox.next(check)
      if message is None:
        continue
      kind, meta, src, arrays = message
      if src != roles.learner or kind not in ('state', 'step'):
        raise ValueError(f'learner process {roles.process} received '
                         f'{kind!r} from process {src}')
      if kind == 'state':
        state = jax.tree.unflatten(treedef, [
            jax.device_put(a, group.local) for a in arrays])
        continue
      params, opt_state, _ = learner_group.wait_ready(
          group.step(*state, grpo.Batch(*arrays), reference), check)
      state = (params, opt_state)
      updates += 1
  job.halt.set()
  if 'stop' in done:
    raise Preempted(done['step'], done['stop'])
  return {'role': 'follower', 'process': roles.process, 'updates': updates}


def _results(config, counters, curve, seconds: float) -> dict[str, Any]:
  last = curve[-1]
  stale = counters['staleness']
  return {
      'versions': config.num_versions,
      'pass_at_1': {str(d): last[f'eval/pass_at_1_d{d}']
                    for d in config.difficulties},
      'mean_pass_at_1': last['eval/pass_at_1'],
      'initial_pass_at_1': {str(d): curve[0][f'eval/pass_at_1_d{d}']
                            for d in config.difficulties},
      'staleness_histogram': {str(i): int(n) for i, n in enumerate(stale)
                              if n},
      'difficulty_mix': {str(d): int(counters['difficulty'][d])
                         for d in config.difficulties},
      'staleness_by_difficulty': {
          str(d): {str(i): int(n) for i, n in enumerate(
              counters['staleness_by_difficulty'][d]) if n}
          for d in config.difficulties},
      'dropped': {str(d): int(counters['dropped'][d])
                  for d in config.difficulties},
      'scheduler_seconds': float(counters['scheduler'][0]),
      'curvature_seconds': float(counters['scheduler'][1]),
      'samples': int(counters['totals'][0]),
      'tokens': int(counters['totals'][1]),
      'wall_seconds': seconds,
      'samples_per_second': counters['totals'][0] / max(seconds, 1e-9),
      'learner_busy_fraction': counters['totals'][2] / max(seconds, 1e-9),
      'curve': curve,
  }


def _plot(curve, config, path: str) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  walls = [c['wall'] for c in curve]
  for d in config.difficulties:
    ax.plot(walls, [c[f'eval/pass_at_1_d{d}'] for c in curve], 'o-',
            label=f'{d} digits')
  ax.set_xlabel('wall time (s)')
  ax.set_ylabel('greedy pass@1 (held out)')
  bound = config.runtime.max_staleness
  ax.set_title(f'GRPO, {config.scheduler} scheduler, staleness <= {bound}, '
               f'{config.grpo.correction}')
  ax.grid(alpha=0.3)
  ax.legend()
  plots.save_png(fig, path)
