"""A learner process that follows the lead: it joins every update of the group.

With more than one learner process, each update runs as one SPMD program
over the group's devices (`train.rl.learner_group`): the lead sends its
state once and each step's batch, and every follower runs the step with
it until the run ends. A signal to a follower stops the whole job at one
saved step (`train.run.stop_protocol`).
"""

from typing import Any

import jax

from train.rl import grpo
from train.rl import learner_group
from train.rl import processes as processes_lib
from train.rl import programs
from train.rl import settings as settings_lib
from train.rl import sft
from train.rl.job import Job
from train.run import process_group
from train.run import stop_protocol


class _Follower:
  """The group's update on this process, and the lead's state it runs on."""

  def __init__(self, config, job: Job):
    with process_group.alone():  # Read with this process's devices only.
      sft_config, model, sft_params, _ = sft.load_policy(config.sft_workdir)
    settings_lib.check_policy(config, sft_config, model.max_len)
    tx = settings_lib.optimizer(config)
    self.group = programs.group_program(config, model, tx, sft_params,
                                        job.roles)
    self.reference = self.group.group_reference(
        jax.device_put(sft_params, self.group.local))
    self.treedef = jax.tree.structure(
        (sft_params, jax.eval_shape(tx.init, sft_params)))
    self.state = None
    self.updates = 0

  def take(self, kind: str, arrays, check) -> None:
    """The lead's state, or a step's batch to update it with."""
    if kind == 'state':
      self.state = jax.tree.unflatten(self.treedef, [
          jax.device_put(a, self.group.local) for a in arrays])
      return
    params, opt_state, _ = learner_group.wait_ready(
        self.group.step(*self.state, grpo.Batch(*arrays), self.reference),
        check)
    self.state = (params, opt_state)
    self.updates += 1


def run(config, job: Job) -> dict[str, Any]:
  """A learner process that follows the lead until the run ends.

  Returns how many updates it joined; raises the lead's stop when it
  stopped for a signal (`stop_protocol.raise_if_stopped`), `RunError`
  when it failed.
  """
  roles = job.roles
  job.wait_admitted()
  follower = _Follower(config, job)
  inbox = learner_group.Inbox()
  job.transport.start(inbox.receive)
  stop = stop_protocol.Follower(job.channel)

  def check() -> None:
    processes_lib.check_peers(job.transport, job.liveness, job.ended)
    stop.forward()

  with stop.installed():
    while (done := job.ended()) is None:
      message = inbox.next(check)
      if message is None:
        continue
      kind, _, src, arrays = message
      if src != roles.learner or kind not in ('state', 'step'):
        raise ValueError(f'learner process {roles.process} received '
                         f'{kind!r} from process {src}')
      follower.take(kind, arrays, check)
  job.halt.set()
  stop_protocol.raise_if_stopped(done)
  return {'role': 'follower', 'process': roles.process,
          'updates': follower.updates}
