"""Where a learner's batches come from: actor threads, or rollout processes.

Each is a `runtime.Generation` made for a `learner_loop.Learner` (from its
snapshots, buffer and scheduler): `local_actors` generates on this
process's rollout mesh; `rollout_processes(job, run)` serves the job's
rollout processes (plans, weights, batches, a stop they tell:
`processes.LearnerServices`) and starts the learner's followers from its
state.
"""

from typing import Any, Callable

import jax
import numpy as np

from train.rl import batches
from train.rl import processes as processes_lib
from train.rl import rollout as rollout_lib
from train.rl import runtime as runtime_lib
from train.rl import settings as settings_lib
from train.rl.job import Job
from train.run import resumable


def local_actors(learner) -> runtime_lib.Actors:
  """Actor threads of this process, from the learner's version on."""
  return runtime_lib.Actors(
      learner.generate, learner.snapshots, learner.buffer,
      settings_lib.runtime_settings(learner.config), start=learner.version,
      plan=lambda k, latest: learner.scheduler.plan(k, latest).min_version)


def _deliver(learner) -> Callable[[dict, list[jax.Array]], None]:
  def deliver(meta: dict, arrays: list[jax.Array]) -> None:
    """A batch a rollout process generated (the transport's thread)."""
    k, difficulty = meta['k'], meta['difficulty']
    _, problems = batches.batch_problems(learner.config, k, difficulty)
    out = rollout_lib.Rollout(
        tuple(problems), version=meta['version'],
        **{name: np.asarray(a)
           for name, a in zip(batches.BATCH_ARRAYS, arrays)})
    learner.buffer.deliver(k, batches.Item(out, difficulty, meta['seconds']))
  return deliver


def rollout_processes(job: Job, run: resumable.Run
                      ) -> Callable[[Any], processes_lib.LearnerServices]:
  """The job's rollout processes, for the lead learner of `job`."""

  def make(learner) -> processes_lib.LearnerServices:
    services = processes_lib.LearnerServices(
        roles_=job.roles, channel_=job.channel, transport=job.transport,
        liveness=job.liveness, snapshots=learner.snapshots,
        plan=learner.scheduler.plan,
        window=settings_lib.runtime_settings(learner.config).capacity,
        leaves=jax.tree.leaves, deliver=_deliver(learner),
        request_stop=run.request_stop, start=learner.version)
    for p in job.roles.followers:  # They start from the lead's state.
      job.transport.send('state', {'version': learner.version},
                         jax.tree.leaves((learner.state['params'],
                                          learner.state['opt_state'])), p)
    return services
  return make
