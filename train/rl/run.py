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

The workdir gets the trainer's guarantees: one run at a time (a lock),
the config checked against the checkpoint's on resume, verified Orbax
checkpoints every `checkpoint_every` versions, SIGTERM/SIGINT save one
and stop. A checkpoint holds the learner (weights, optimizer state,
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

from train import aot
from train import checkpointing
from train import checksums
from train import disk_space
from train import fileio
from train import metrics as metrics_lib
from train import plots
from train import preemption
from train import resume_check
from train import sharding as sharding_lib
from train import steps
from train import workdir_lock
from train.errors import ConfigError, NonFiniteLossError, Preempted
from train.experiment import check_seed
from train.experiment import check_workdir
from train.lm import decoder as decoder_lm
from train.lm import trainer as lm_trainer
from train.rl import grpo
from train.rl import learner as learner_lib
from train.rl import rollout as rollout_lib
from train.rl import runtime as runtime_lib
from train.rl import scheduler as scheduler_lib
from train.rl import sft
from train.rl import tasks

RESULTS = 'results.json'
PLOT = 'pass_at_1.png'
TASK = 'rl'
# The console line, every PROGRESS_EVERY versions and at evaluations.
PROGRESS_EVERY = 10
PROGRESS_KEYS = ('reward', 'staleness', 'samples_per_second',
                 'learner_busy_fraction', 'eval/pass_at_1')
MAY_CHANGE = ('log_every', 'checkpoint_every', 'keep_checkpoints',
              'cpu_devices', 'runtime.shutdown_timeout',
              'runtime.max_actor_restarts', 'sft_workdir')


def loss_settings(config) -> learner_lib.LearnerSettings:
  g = config.grpo
  return learner_lib.LearnerSettings(
      loss=grpo.LossSettings(epsilon=g.epsilon, beta=g.beta,
                             correction=g.correction, is_cap=g.is_cap,
                             aggregation=g.aggregation,
                             temperature=config.temperature),
      group_size=g.group_size, iterations=g.iterations)


# Bounds checked before anything is allocated.
MAX_BATCH_ROWS = 1 << 16
MAX_EVAL_EXAMPLES = 100_000


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


def meshes(config, devices: list | None = None) -> tuple[Mesh, Mesh]:
  """(rollout mesh, learner mesh) of `devices` (default: this job's)."""
  axes, shape, rules = learner_layout(config)
  rollout_mesh, learner_mesh = runtime_lib.split_devices(
      config.rollout_devices, devices, axes, shape)
  sharding_lib.check_rules(rules, axes, field='learner_mesh.rules')
  return rollout_mesh, learner_mesh


def learner_shardings(config, model: decoder_lm.DecoderLM,
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
                 require_sft: bool = True) -> None:
  """ConfigError naming the field, before anything is read or computed.
  `devices`: the job's (default: this process's); `require_sft=False`
  lets the SFT workdir be unset (compiling needs its config only)."""
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
  # Sizes, before anything is allocated (a billion of any of these grew
  # the process to 18 GB before it was killed).
  if config.runtime.max_staleness > config.num_versions:
    raise ConfigError('runtime.max_staleness', config.runtime.max_staleness,
                      f'must be <= num_versions ({config.num_versions}): '
                      'the learner keeps that many past policies')
  rows = config.prompts_per_batch * config.grpo.group_size
  if rows > MAX_BATCH_ROWS:
    raise ConfigError('prompts_per_batch', config.prompts_per_batch,
                      f'times grpo.group_size ({config.grpo.group_size}) '
                      f'must be at most {MAX_BATCH_ROWS} sequences a batch')
  if config.eval_examples > MAX_EVAL_EXAMPLES:
    raise ConfigError('eval_examples', config.eval_examples,
                      f'must be at most {MAX_EVAL_EXAMPLES} per difficulty')
  scheduler_lib.check_config(config)
  if not config.runtime.shutdown_timeout > 0:
    raise ConfigError('runtime.shutdown_timeout',
                      config.runtime.shutdown_timeout, 'must be > 0')
  for field in ('learning_rate', 'grad_clip_norm'):
    value = config.optimizer[field]
    if not (isinstance(value, (int, float)) and 0 < value < math.inf):
      raise ConfigError(f'optimizer.{field}', value, 'must be finite and > 0')
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
  check_config(config)
  workdir = check_workdir(workdir)
  with workdir_lock.hold(workdir):
    newest = checkpointing.newest_meta(workdir)
    if newest is not None:  # Before the SFT policy is read.
      _check_resume(config, workdir, *newest)
    with disk_space.reported(
        workdir, None, fileio.join(workdir, checkpointing.CHECKPOINTS)):
      return _train(config, workdir)


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


# Every float of the policy and optimizer state finite (before a save).
_all_finite = jax.jit(steps.tree_is_finite)


def _train(config, workdir: str) -> dict[str, Any]:
  sft_config, model, sft_params = sft.load_policy(config.sft_workdir)
  check_policy(config, sft_config, model.max_len)
  # The warm start (the first policy and GRPO's reference) is pinned by
  # content: `sft_workdir` may move, but another policy there is refused
  # on resume and on a finished rerun.
  inputs = {'config.sft_workdir': checksums.digest(sft_params)}
  length = sequence_length(config)
  rsettings = runtime_settings(config)
  lsettings = loss_settings(config)
  s = rsettings.max_staleness
  rollout_mesh, learner_mesh = meshes(config)
  rollout_repl = NamedSharding(rollout_mesh, P())
  param_shardings, learner_rows = learner_shardings(config, model,
                                                    learner_mesh)
  rollout_rows = NamedSharding(rollout_mesh, P('data'))

  tx = optimizer(config)
  params = jax.device_put(sft_params, param_shardings)
  reference = params
  fresh = {'params': params, 'opt_state': jax.jit(
      tx.init, out_shardings=sharding_lib.optimizer_state_shardings(
          tx, params, param_shardings, learner_mesh))(params),
           'history': [params] * s}
  # Compiled ahead of time under the learner's mesh and rules, as
  # `launch.compile` compiles it.
  update = _update_program(config, model, tx, lsettings, params,
                           learner_mesh).lower().compile()
  heldout = {d: tasks.evaluation_set(config.family, d, config.eval_examples)
             for d in config.difficulties}

  with checkpointing.Checkpoints(workdir, every_steps=config.checkpoint_every,
                                 keep=config.keep_checkpoints) as ckpts:
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        fresh)

    def check_meta(step, meta):
      _check_resume(config, workdir, step, meta)
      resume_check.check_fingerprints(workdir, step, meta, inputs)

    found = ckpts.restore_latest_good(abstract, check_meta=check_meta)
    results_path = fileio.join(workdir, RESULTS)
    if found is not None:
      version, tree, meta = found
      if version == config.num_versions and fileio.exists(results_path):
        logging.info('%s is finished; its results are reported again.',
                     workdir)
        return metrics_lib.read_json(results_path)
      logging.info('Resuming at version %d of %d (batches generated but '
                   'not trained were dropped)', version, config.num_versions)
      state = tree
      counters = _counters(s, meta.get('counters'))
      writer = metrics_lib.MetricWriter(workdir, version,
                                        meta.get('metrics_records'))
      wall_offset = float(meta.get('wall_seconds', 0.0))
      curve = list(meta.get('curve', []))
    else:
      version, state, counters = 0, fresh, _counters(s)
      writer = metrics_lib.MetricWriter(workdir, None)
      wall_offset, curve = 0.0, []

    halt = threading.Event()
    scheduler = scheduler_lib.make(config, rsettings.deterministic,
                                   stopped=halt.is_set)
    if found is not None:
      scheduler.restore(version, meta.get('scheduler', {}))
    snapshots = runtime_lib.Snapshots(keep=s + 1)
    # The last s versions, oldest first, then the current one.
    for i, old in enumerate(state['history']):
      v = version - s + i
      if v >= 0:
        snapshots.publish(v, jax.device_put(old, rollout_repl))
    snapshots.publish(version, jax.device_put(state['params'], rollout_repl))
    buffer = runtime_lib.Buffer(rsettings.capacity, next_needed=version)
    base_key = jax.random.key(config.seed)

    def generate(k: int, v: int, params_v) -> Item:
      difficulty, problems = batch_problems(
          config, k, scheduler.plan(k, v).difficulty)
      start = time.perf_counter()
      out = rollout_lib.sample(
          model, params_v, problems, jax.random.fold_in(base_key, k),
          temperature=config.temperature,
          num_steps=tasks.max_answer_tokens(config.family, difficulty),
          version=v, sharding=rollout_rows)
      return Item(out, difficulty, time.perf_counter() - start)

    def plan(k: int, latest: int) -> int:
      return scheduler.plan(k, latest).min_version

    actors = runtime_lib.Actors(generate, snapshots, buffer, rsettings,
                                start=version, plan=plan)
    stop = preemption.StopFlag()
    started = time.perf_counter()

    def wall() -> float:
      return wall_offset + time.perf_counter() - started

    def evaluate(v: int) -> dict[str, float]:
      scores = {f'eval/pass_at_1_d{d}': rollout_lib.pass_at_1(
          model, state['params'], problems, sharding=learner_rows
          if len(problems) % learner_mesh.devices.size == 0 else None)
                for d, problems in heldout.items()}
      scores['eval/pass_at_1'] = float(np.mean(list(scores.values())))
      curve.append({'version': v, 'wall': wall(), **scores})
      return scores

    def save(v: int, force: bool = False) -> bool:
      # Called after every update: build the tree only for a save.
      if not (force or ckpts.should_save(v)):
        return False
      if not bool(_all_finite((state['params'], state['opt_state']))):
        # A finite loss can still leave inf in the parameters (an infinite
        # learning rate): never save them.
        raise NonFiniteLossError(v, ckpts.latest_step(), 'policy state',
                                 can_skip=False)
      history = [snapshots.held().get(v - s + i) for i in range(s)]
      tree = {'params': state['params'], 'opt_state': state['opt_state'],
              'history': [state['params'] if h is None else
                          jax.device_put(h, param_shardings)
                          for h in history]}
      meta = {'config': resume_check.as_json(config),
              'counters': {k: v.tolist() for k, v in counters.items()},
              'scheduler': scheduler.save(v),
              'metrics_records': writer.records, 'wall_seconds': wall(),
              'curve': curve, resume_check.FINGERPRINTS: inputs}
      return ckpts.save(v, tree, meta, force=force)

    if version == 0 and not curve:
      writer.write(0, evaluate(0))
    progress = metrics_lib.Progress(version, config.num_versions)
    actors.start()
    published = time.perf_counter()
    try:
      with stop.installed():
        for k in range(version, config.num_versions):
          item = buffer.take(k, actors.check)
          clock = time.perf_counter()
          admitted = scheduler.admit(k, item.difficulty, k - item.rollout.version)
          scheduler_seconds = time.perf_counter() - clock
          if not admitted:
            # Over its budget (the budget tightened since it was planned):
            # generated again from the current version, so nothing trains
            # stale and no difficulty is skipped.
            counters['dropped'][item.difficulty] += 1
            item = generate(k, k, snapshots.held()[k])
          out = item.rollout
          staleness = k - out.version
          if not 0 <= staleness <= s:
            raise RuntimeError(f'batch {k} from version {out.version}: '
                               f'staleness {staleness} outside [0, {s}]')
          host_batch = learner_lib.assemble(out, lsettings.group_size, length)
          weight = scheduler.loss_weight(item.difficulty)
          if weight != 1.0:
            host_batch = host_batch._replace(
                advantages=host_batch.advantages * np.float32(weight))
          batch = jax.device_put(host_batch, learner_rows)
          begin = time.perf_counter()
          params, opt_state, m = update(state['params'], state['opt_state'],
                                        batch, reference)
          m = jax.device_get(m)
          busy = time.perf_counter() - begin
          bad = sorted(key for key, x in m.items()
                       if not np.all(np.isfinite(x)))
          if bad:  # Stop before the policy is published or saved.
            raise NonFiniteLossError(
                k + 1, ckpts.latest_step(),
                'loss' if 'loss' in bad else f'train/{bad[0]}',
                can_skip=False)
          state['params'], state['opt_state'] = params, opt_state
          version = k + 1
          curvatures, curvature_seconds = None, 0.0
          scheduler.remember(item.difficulty, batch)
          if scheduler.needs_curvature(version):
            clock = time.perf_counter()
            curvatures = scheduler.curvatures(model, params, version)
            curvature_seconds = time.perf_counter() - clock
          now = time.perf_counter()
          clock = now
          scheduler_scalars = scheduler.observe(
              version, difficulty=item.difficulty, rewards=out.rewards,
              rows=len(out.rewards), generation_seconds=item.seconds,
              step_seconds=now - published, regenerated=not admitted,
              curvatures=curvatures)
          scheduler_seconds += time.perf_counter() - clock
          snapshots.publish(version, jax.device_put(params, rollout_repl))
          published = time.perf_counter()
          counters['staleness'][staleness] += 1
          counters['difficulty'][item.difficulty] += 1
          counters['staleness_by_difficulty'][item.difficulty,
                                              staleness] += 1
          counters['totals'] += [len(out.rewards), out.generated_tokens, busy]
          counters['scheduler'] += [scheduler_seconds, curvature_seconds]
          elapsed = wall()
          scalars = {f'train/{key}': float(v) for key, v in m.items()}
          scalars.update(scheduler_scalars)
          if curvatures:
            scalars.update({f'gas/lambda_max/d{d}': c
                            for d, c in curvatures.items()})
          scalars.update({
              'reward': float(out.rewards.mean()),
              'difficulty': float(item.difficulty),
              'staleness': float(staleness),
              'generation_seconds': item.seconds,
              'samples_per_second': counters['totals'][0] / elapsed,
              'tokens_per_second': counters['totals'][1] / elapsed,
              'learner_busy_fraction': counters['totals'][2] / elapsed,
              'buffer': float(len(buffer)),
              'actor_failures': float(actors.failures)})
          if version % config.eval_every == 0 or (
              version == config.num_versions):
            scalars.update(evaluate(version))
          if version % config.log_every == 0 or 'eval/pass_at_1' in scalars:
            writer.write(version, scalars)
          if version % PROGRESS_EVERY == 0 or 'eval/pass_at_1' in scalars:
            rate, eta = progress.update(version)
            metrics_lib.log_progress(
                version, config.num_versions,
                {k: scalars[k] for k in PROGRESS_KEYS if k in scalars},
                rate, eta, console=('eval/pass_at_1',))
          saved = save(version)
          if stop.requested(version) and version < config.num_versions:
            if not saved:
              save(version, force=True)
            ckpts.wait_until_finished()
            writer.flush()
            raise Preempted(version, stop.signal_name)
    finally:
      halt.set()
      actors.stop()
      try:
        actors.join(config.runtime.shutdown_timeout)
      finally:
        writer.close()
    ckpts.wait_until_finished()
    if ckpts.latest_step() != config.num_versions:
      save(config.num_versions, force=True)
    ckpts.wait_until_finished()
    results = _results(config, counters, curve, wall())
    if scheduler.diagnostics():
      results['gas'] = scheduler.diagnostics()
    results['params_sha256'] = fingerprint(state['params'])
    metrics_lib.write_json_atomic(results_path, results)
    _plot(curve, config, fileio.join(workdir, PLOT))
    return results


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
