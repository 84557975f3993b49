"""A rollout process of a multi-process RL job: it generates until the run ends.

It waits until the lead learner holds the workdir, loads the SFT policy
(its own devices only), receives the versions it asks for, and runs
actor threads (`runtime.Actors`) whose batches go to the learner
(`processes.RemoteSnapshots`, `RemoteBuffer`, `remote_claim`). A signal to
it stops the whole job at one saved step (`train.run.stop_protocol`).
"""

import dataclasses
import math
import time
from typing import Any

from absl import logging
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from train.errors import RunError
from train.rl import batches
from train.rl import processes as processes_lib
from train.rl import runtime as runtime_lib
from train.rl import settings as settings_lib
from train.rl import sft
from train.rl.job import Job
from train.run import process_group
from train.run import stop_protocol


@dataclasses.dataclass(frozen=True)
class _Policy:
  """The SFT policy's model, codec and tree structure, and the rows and
  replicas of this process's mesh."""
  model: Any
  codec: Any
  treedef: Any
  replicated: NamedSharding
  rows: NamedSharding


def _load(config) -> _Policy:
  with process_group.alone():  # Read with this process's devices only.
    sft_config, model, sft_params, codec = sft.load_policy(
        config.sft_workdir)
  settings_lib.check_policy(config, sft_config, model.max_len)
  rollout_mesh, _ = settings_lib.meshes(config)
  return _Policy(model, codec, jax.tree.structure(sft_params),
                 NamedSharding(rollout_mesh, P()),
                 NamedSharding(rollout_mesh, P('data')))


def _snapshots(config, job: Job, policy: _Policy
               ) -> processes_lib.RemoteSnapshots:
  """The versions this process asks the learner for, received."""
  roles = job.roles
  settings = settings_lib.runtime_settings(config)
  snapshots = processes_lib.RemoteSnapshots(
      job.channel, roles.process,
      keep=settings.capacity + settings.max_staleness + 2,
      timeout=job.timeout)

  def receive(kind, meta, src, arrays):
    if kind != 'weights' or src != roles.learner:
      raise ValueError(f'a rollout process received {kind!r} from {src}')
    snapshots.versions.add(meta['version'], jax.tree.unflatten(
        policy.treedef, [jax.device_put(a, policy.replicated)
                         for a in arrays]))

  job.transport.start(receive)
  return snapshots


def _wait_start(job: Job) -> int | None:
  """The learner's start version; None if it ended first (refused, e.g. a
  damaged checkpoint, or found the run finished)."""
  with stop_protocol.before_loop():
    while (start := job.channel.try_get('start')) is None:
      if job.ended() is not None:
        return None
      job.liveness.check()
      if job.halt.wait(0.05):
        raise runtime_lib.Stopped()
  return start


def _actors(config, job: Job, policy: _Policy, snapshots, start: int
            ) -> runtime_lib.Actors:
  """Actor threads generating the batches the learner plans."""
  ch, settings = job.channel, settings_lib.runtime_settings(config)
  base_key = jax.random.key(config.seed)
  plans: dict[int, tuple[int, int]] = {}

  def plan(k: int, latest: int) -> int:
    del latest  # The learner's scheduler decides, with its own latest.
    if k not in plans:  # A restarted actor plans its batch again.
      plans[k] = tuple(ch.get(f'plan/{k}', timeout=math.inf))
      ch.delete(f'plan/{k}')  # Batch k is claimed by this process alone.
    return plans[k][1]

  def generate(k: int, v: int, params) -> batches.Item:
    return batches.generate_batch(config, policy.model, base_key, k, v,
                                  params, plans[k][0], policy.rows,
                                  policy.codec)

  def send(k: int, item: batches.Item) -> None:
    out = item.rollout
    job.transport.send(
        'batch', {'k': k, 'version': out.version,
                  'difficulty': item.difficulty, 'seconds': item.seconds},
        [getattr(out, name) for name in batches.BATCH_ARRAYS],
        job.roles.learner)

  claim = processes_lib.remote_claim(ch, start, settings.capacity,
                                     job.halt.is_set,
                                     total=config.num_versions)
  return runtime_lib.Actors(generate, snapshots,
                            processes_lib.RemoteBuffer(send), settings,
                            start=start, plan=plan, claim=claim)


def _generate(config, job: Job, actors: runtime_lib.Actors,
              snapshots) -> dict[str, Any]:
  """Runs the actors until the learner tells the run's end."""
  follower = stop_protocol.Follower(job.channel)
  with follower.installed():
    actors.start()
    try:
      while (done := job.ended()) is None:
        actors.check()
        processes_lib.check_peers(job.transport, job.liveness, job.ended)
        follower.forward()
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
  return done


def run(config, job: Job) -> dict[str, Any]:
  """A rollout process: generates batches for the learner until it ends.

  Returns what it generated; raises the learner's stop when it stopped
  for a signal (`stop_protocol.raise_if_stopped`: the launcher exits as
  the learner did), `RunError` when the learner failed.
  """
  # Until its loop handles them, signals end this process in one line:
  # jax.distributed's notifier, which owns SIGTERM otherwise, is answered
  # only at the learner's next step (the loop's handlers replace it too).
  with stop_protocol.before_loop():
    job.wait_admitted()
  policy = _load(config)
  snapshots = _snapshots(config, job, policy)
  start = _wait_start(job)
  if start is None:
    return {'role': 'rollout', 'process': job.roles.process,
            'batches_sent': 0}
  done = _generate(config, job, _actors(config, job, policy, snapshots,
                                        start), snapshots)
  stop_protocol.raise_if_stopped(done)
  return {'role': 'rollout', 'process': job.roles.process,
          'batches_sent': job.transport.sent}
