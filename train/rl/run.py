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

The workdir goes to the run core (`train.run.workdir_run.open_run`),
which checks it, picks its checkpoints (Orbax's for one process, the
learner's own for a multi-process job) and holds it with the trainer's
guarantees (`train.run.resumable`): one run at a time (a lock), the
config checked against the checkpoint's on resume, the SFT policy pinned
by content, verified checkpoints every `checkpoint_every` versions,
SIGTERM/SIGINT (to any process of a multi-process job:
`train.run.stop_protocol`) save one and stop. A checkpoint holds the
learner (weights, optimizer state, version), the counters behind the
metrics, and the weights of the last s versions, so that in
`runtime.deterministic` mode a resumed run generates every later batch
from the same version as an uninterrupted one and ends bit for bit the
same. Batches generated but not yet trained
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

The parts: settings and layout (`train.rl.settings`), compiled programs
(`train.rl.programs`), batches (`train.rl.batches`), the learner's loop
(`train.rl.learner_loop`, counting in `train.rl.tally`) and where its
batches come from (`train.rl.generation`); a multi-process job's control
plane (`train.rl.job`) and its other roles (`train.rl.rollout_process`,
`train.rl.follower`).
"""

from typing import Any

import ml_collections

from train.rl import control
from train.rl import follower
from train.rl import learner_loop
from train.rl import processes as processes_lib
from train.rl import rollout_process
from train.rl import settings as settings_lib
from train.rl.job import Job
from train.run import stop_protocol
from train.run import workdir_run
# What launchers, tests, studies and benchmarks name here.
# pylint: disable=unused-import,g-multiple-import
from train.rl.batches import batch_problems, generate_batch
from train.rl.learner_loop import PLOT, RESULTS
from train.rl.programs import programs
from train.rl.settings import (
    MAY_CHANGE, TASK, check_config, check_policy, learner_layout,
    loss_settings, meshes, multi_process, optimizer, runtime_settings,
    sequence_length)
from train.rl.tally import fingerprint
# pylint: enable=unused-import,g-multiple-import


def _open(config, workdir: str, part: bool = False):
  return workdir_run.open_run(
      config, workdir, results_name=RESULTS, split=settings_lib.SPLIT,
      check_config=lambda *saved: settings_lib.check_resume(config, *saved),
      part=part)


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
    The run core's stop (`train.run.stop_protocol`): SIGTERM or SIGINT
      arrived (at any process of a job); a checkpoint was saved first.
  """
  if not multi_process(config):
    check_config(config)  # Refuses rollout_processes on one process.
  roles = processes_lib.roles(config)
  if roles is None:
    with _open(config, workdir) as run:
      return learner_loop.train(config, run)
  return _in_job(config, workdir, Job(config, roles))


def _lead(config, workdir: str, job: Job) -> dict[str, Any]:
  """The lead learner: it holds the workdir alone; the job's other
  processes never touch it."""
  with _open(config, workdir, part=True) as run:
    job.tell('admitted', True)
    results = learner_loop.train(config, run, job)
  job.tell('done', {'ok': True})
  return results


def _in_job(config, workdir: str, job: Job) -> dict[str, Any]:
  """This process's role in a multi-process job, and the job's end."""
  roles = job.roles
  try:
    # Under the job's channel: a process that refuses (its SFT workdir
    # missing on its host, say) tells the others.
    check_config(config)
    if roles.is_follower:
      return follower.run(config, job)
    if not roles.is_learner:
      return rollout_process.run(config, job)
    return _lead(config, workdir, job)
  except BaseException as e:
    # Every process ends with the refusing one's exit status and line:
    # the learner tells the run's end, any other process the learner.
    # The echo of another's refusal is not told again.
    if stop_protocol.is_stop(e):
      if roles.is_learner:
        job.tell('done', stop_protocol.ended_by(e))
      raise
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
