"""The learner's loop: one GRPO update per batch, each version published.

`train(config, run, job)` loads the SFT warm start, restores the run's
newest checkpoint (or starts it), and trains batch k = version, ..., each
as take -> admit -> update -> publish -> record (`Learner.train_batch`).
Its batches come from, and its weights go to, a `runtime.Generation`:
actor threads of this process, or the rollout processes of a job
(`train.rl.generation`); the learner runs the same either way.
"""

import dataclasses
import threading
import time
from typing import Any, Callable

from absl import logging
import jax
import numpy as np

from train import fileio
from train.rl import batches
from train.rl import generation as generation_lib
from train.rl import learner as learner_lib
from train.rl import programs
from train.rl import rollout as rollout_lib
from train.rl import runtime as runtime_lib
from train.rl import scheduler as scheduler_lib
from train.rl import settings as settings_lib
from train.rl import sft
from train.rl import tally as tally_lib
from train.rl import tasks
from train.rl.job import Job
from train.run import checksums
from train.run import resumable
from train.training import sharding as sharding_lib

RESULTS = 'results.json'
PLOT = 'pass_at_1.png'


@dataclasses.dataclass
class _Step:
  """What one update found and spent, from its admission to its record."""
  item: batches.Item
  admitted: bool
  staleness: int = 0
  scheduler_seconds: float = 0.0
  busy: float = 0.0
  batch: Any = None
  metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
  curvatures: dict[int, float] | None = None
  curvature_seconds: float = 0.0
  scheduler_scalars: dict[str, float] = dataclasses.field(
      default_factory=dict)


def _snapshots(state: dict[str, Any], version: int, bound: int,
               sharding) -> runtime_lib.Snapshots:
  """The last `bound` versions (the checkpoint's history), oldest first,
  then the current one, published on `sharding`."""
  snapshots = runtime_lib.Snapshots(keep=bound + 1)
  for i, old in enumerate(state['history']):
    if version - bound + i >= 0:
      snapshots.publish(version - bound + i, jax.device_put(old, sharding))
  snapshots.publish(version, jax.device_put(state['params'], sharding))
  return snapshots


class _Heldout:
  """Greedy pass@1 on each difficulty's held-out set."""

  def __init__(self, config, model, codec: tasks.Codec,
               layout: programs.Layout):
    self.model, self.codec, self.layout = model, codec, layout
    self.sets = {d: tasks.evaluation_set(config.family, d,
                                         config.eval_examples)
                 for d in config.difficulties}

  def pass_at_1(self, params) -> dict[str, float]:
    devices = self.layout.learner_mesh.devices.size
    scores = {f'eval/pass_at_1_d{d}': rollout_lib.pass_at_1(
        self.model, params, problems,
        sharding=self.layout.learner_rows
        if len(problems) % devices == 0 else None, codec=self.codec)
              for d, problems in self.sets.items()}
    scores['eval/pass_at_1'] = float(np.mean(list(scores.values())))
    return scores


def _scheduler(config, version: int, meta: dict[str, Any], stopped
               ) -> Any:
  """The config's scheduler, restored at `version` from a checkpoint's
  metadata (none for a new run)."""
  scheduler = scheduler_lib.make(
      scheduler_lib.settings(config),
      settings_lib.runtime_settings(config).deterministic, stopped=stopped)
  if meta:
    scheduler.restore(version, meta.get('scheduler', {}))
  return scheduler


def _checkpoint_tree(state: dict[str, Any], snapshots: runtime_lib.Snapshots,
                     version: int, bound: int, shardings) -> dict[str, Any]:
  """The policy, its optimizer state and the last `bound` versions (the
  current one where a version is older than the run)."""
  held = snapshots.held()
  history = [held.get(version - bound + i) for i in range(bound)]
  return {'params': state['params'], 'opt_state': state['opt_state'],
          'history': [state['params'] if h is None else
                      jax.device_put(h, shardings) for h in history]}


def _weighted(batch, weight: float):
  """`batch` with its advantages scaled by the scheduler's loss weight."""
  if weight == 1.0:
    return batch
  return batch._replace(advantages=batch.advantages * np.float32(weight))


class Learner:
  """The learner's side of a run: the policy, the scheduler, the tally,
  and the generation it trains from (`runtime.Generation`)."""

  def __init__(self, config, model, codec: tasks.Codec, run: resumable.Run,
               layout: programs.Layout, reference,
               restored: tuple[int, dict, dict],
               generation: Callable[['Learner'], runtime_lib.Generation]):
    self.config, self.model, self.codec = config, model, codec
    self.run, self.layout = run, layout
    # The update reads the reference only when beta > 0; held for nothing
    # it is a policy's copy once the first update replaced the weights.
    self.reference = reference if config.grpo.beta > 0 else None
    self.version, self.state, meta = restored
    self.bound = config.runtime.max_staleness
    self.settings = settings_lib.loss_settings(config)
    self.length = settings_lib.sequence_length(config)
    self.tally = tally_lib.Tally(config, self.version, meta)
    self.heldout = _Heldout(config, model, codec, layout)
    self.halt = threading.Event()
    self.scheduler = _scheduler(config, self.version, meta,
                                stopped=self.halt.is_set)
    self.snapshots = _snapshots(self.state, self.version, self.bound,
                                layout.rollout_replicated)
    self.buffer = runtime_lib.Buffer(
        settings_lib.runtime_settings(config).capacity,
        next_needed=self.version)
    self.base_key = jax.random.key(config.seed)
    self.generation = generation(self)
    self.published = time.perf_counter()

  def start(self) -> None:
    """Starts the generation; the first step's time counts from here."""
    self.generation.start()
    self.published = time.perf_counter()

  def stop(self, timeout: float) -> None:
    """Stops the scheduler's waits and the generation; waits `timeout` s."""
    self.halt.set()
    self.generation.stop()
    self.generation.join(timeout)

  def generate(self, k: int, v: int, params_v) -> batches.Item:
    return batches.generate_batch(
        self.config, self.model, self.base_key, k, v, params_v,
        self.scheduler.plan(k, v).difficulty, self.layout.rollout_rows,
        self.codec)

  def evaluate(self, v: int) -> dict[str, float]:
    scores = self.heldout.pass_at_1(self.state['params'])
    self.tally.evaluated(v, scores)
    return scores

  def checkpoint(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tree and metadata a checkpoint at `version` holds."""
    return (_checkpoint_tree(self.state, self.snapshots, self.version,
                             self.bound, self.layout.param_shardings),
            self.tally.meta(self.scheduler.save(self.version)))

  def train_batch(self, k: int) -> dict[str, float]:
    """Trains batch k (version k -> k + 1), publishes the new version;
    returns its metrics."""
    step = self._admit(k, self._take(k))
    self._update(k, step)
    self._publish(step)
    return self._record(step)

  def _take(self, k: int) -> batches.Item:
    self.generation.advance(k)
    # Also when batch k is already here: a stop another process told is
    # then seen at this step, not at the next wait.
    self.generation.check()
    return self.buffer.take(k, self.generation.check)

  def _admit(self, k: int, item: batches.Item) -> _Step:
    """The scheduler's admission of batch k (generated again from the
    current version if refused), its staleness checked."""
    clock = time.perf_counter()
    admitted = self.scheduler.admit(k, item.difficulty,
                                    k - item.rollout.version)
    step = _Step(item, admitted,
                 scheduler_seconds=time.perf_counter() - clock)
    if not admitted:
      # Over its budget (the budget tightened since it was planned):
      # generated again from the current version, so nothing trains
      # stale and no difficulty is skipped.
      self.tally.counters['dropped'][item.difficulty] += 1
      step.item = self.generate(k, k, self.snapshots.held()[k])
    step.staleness = k - step.item.rollout.version
    if not 0 <= step.staleness <= self.bound:
      raise RuntimeError(f'batch {k} from version '
                         f'{step.item.rollout.version}: staleness '
                         f'{step.staleness} outside [0, {self.bound}]')
    return step

  def _update(self, k: int, step: _Step) -> None:
    """One GRPO update on the batch; stops before anything non-finite is
    published or saved."""
    host_batch = learner_lib.assemble(step.item.rollout,
                                      self.settings.group_size, self.length)
    step.batch = jax.device_put(
        _weighted(host_batch, self.scheduler.loss_weight(
            step.item.difficulty)), self.layout.learner_rows)
    begin = time.perf_counter()
    params, opt_state, m = self.layout.update(
        self.state['params'], self.state['opt_state'], step.batch,
        self.state['params'] if self.reference is None else self.reference)
    step.metrics = jax.device_get(m)
    step.busy = time.perf_counter() - begin
    bad = sorted(key for key, x in step.metrics.items()
                 if not np.all(np.isfinite(x)))
    if bad:
      self.run.stop_nonfinite(
          k + 1, 'loss' if 'loss' in bad else f'train/{bad[0]}',
          can_skip=False)
    self.state['params'], self.state['opt_state'] = params, opt_state
    self.version = k + 1

  def _publish(self, step: _Step) -> None:
    """Tells the scheduler what the update saw, then publishes the new
    version to the generation."""
    version, item, params = self.version, step.item, self.state['params']
    self.scheduler.remember(item.difficulty, step.batch)
    if self.scheduler.needs_curvature(version):
      clock = time.perf_counter()
      step.curvatures = self.scheduler.curvatures(self.model, params, version)
      step.curvature_seconds = time.perf_counter() - clock
    now = clock = time.perf_counter()
    step.scheduler_scalars = self.scheduler.observe(
        version, difficulty=item.difficulty, rewards=item.rollout.rewards,
        rows=len(item.rollout.rewards), generation_seconds=item.seconds,
        step_seconds=now - self.published, regenerated=not step.admitted,
        curvatures=step.curvatures)
    step.scheduler_seconds += time.perf_counter() - clock
    self.snapshots.publish(version, jax.device_put(
        params, self.layout.rollout_replicated))
    self.published = time.perf_counter()

  def _record(self, step: _Step) -> dict[str, float]:
    self.tally.count(step.item, step.staleness, step.busy,
                     step.scheduler_seconds, step.curvature_seconds)
    scalars = self.tally.scalars(step.item, step.staleness, step.metrics,
                                 step.scheduler_scalars, step.curvatures)
    scalars.update({'buffer': float(len(self.buffer)),
                    'actor_failures': float(self.generation.failures)})
    return scalars

  def log(self, scalars: dict[str, float]) -> None:
    """Evaluates when due; writes the metrics and the progress line."""
    self.tally.log(self.version, scalars, self.run.writer, self.evaluate)


def _restore(config, run: resumable.Run, tx, layout: programs.Layout,
             sft_params) -> tuple[Any, tuple[int, dict, dict]]:
  """(the first policy, (version, state, metadata) to start from)."""
  params = jax.device_put(sft_params, layout.param_shardings)
  fresh = {'params': params, 'opt_state': jax.jit(
      tx.init, out_shardings=sharding_lib.optimizer_state_shardings(
          tx, params, layout.param_shardings, layout.learner_mesh))(params),
           'history': [params] * config.runtime.max_staleness}
  found = run.restore(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      fresh))
  if found is not None:
    logging.info('Resuming at version %d of %d (batches generated but not '
                 'trained were dropped)', found[0], config.num_versions)
  return params, found or (0, fresh, {})


def _learner(config, run: resumable.Run, job: Job | None
             ) -> Learner | dict[str, Any]:
  """The learner, restored; or the results of a finished run."""
  sft_config, model, sft_params, codec = sft.load_policy(config.sft_workdir)
  settings_lib.check_policy(config, sft_config, model.max_len)
  # The warm start (the first policy and GRPO's reference) is pinned by
  # content: `sft_workdir` may move, but another policy there is refused
  # on resume and on a finished rerun.
  run.pin({'config.sft_workdir': checksums.digest(sft_params)})
  finished = run.finished(config.num_versions)
  if finished is not None:
    return finished
  tx = settings_lib.optimizer(config)
  layout = programs.layout(config, model, tx, sft_params, job)
  params, restored = _restore(config, run, tx, layout, sft_params)
  run.finite = resumable.Finite(programs.policy_finite, 'policy state',
                                can_skip=False)
  # The learner holds what it needs: a name kept here would hold the warm
  # start's host copy, the first policy (the reference, unless beta = 0)
  # and, on resume, a fresh optimizer state through the run (up to 4 GiB
  # of the real Gemma's).
  return Learner(config, model, codec, run, layout, reference=params,
                 restored=restored,
                 generation=generation_lib.local_actors if job is None
                 else generation_lib.rollout_processes(job, run))


def train(config, run: resumable.Run, job: Job | None = None
          ) -> dict[str, Any]:
  """Trains the run's versions on this process's learner (the lead of a
  job's learner group with `job`); returns the results."""
  learner = _learner(config, run, job)
  if not isinstance(learner, Learner):
    return learner
  if learner.version == 0 and not learner.tally.curve:
    run.writer.write(0, learner.evaluate(0))
  learner.start()
  try:
    with run.stopping():
      for k in range(learner.version, config.num_versions):
        learner.log(learner.train_batch(k))
        run.end_step(learner.version, learner.checkpoint)
  finally:
    learner.stop(config.runtime.shutdown_timeout)
  results = learner.tally.results()
  if learner.scheduler.diagnostics():
    results['gas'] = learner.scheduler.diagnostics()
  results['params_sha256'] = tally_lib.fingerprint(learner.state['params'])
  run.finish(results, learner.checkpoint)
  tally_lib.plot(learner.tally.curve, config, fileio.join(run.workdir, PLOT))
  return results
