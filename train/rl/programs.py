"""An RL run's compiled programs and where its policy lives.

The learner's update, compiled ahead of time on the learner mesh as
`launch.compile` compiles it (`programs`), or, with a learner over
several processes, the group's update that the lead runs with its
followers (`train.rl.learner_group`); `layout` says where the published
versions and the batches' rows live.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np

from train.lm import trainer as lm_trainer
from train.rl import learner as learner_lib
from train.rl import learner_group
from train.rl import processes as processes_lib
from train.rl import rollout as rollout_lib
from train.rl import settings as settings_lib
from train.rl import tasks
from train.rl.job import Job
from train.training import aot
from train.training import sharding as sharding_lib
from train.training import steps


def update_program(config, model, tx, lsettings, params, learner_mesh
                   ) -> aot.Program:
  """The learner's update on abstract `params` (with their shardings)."""
  param_shardings, rows = settings_lib.learner_shardings(config, model,
                                                         learner_mesh)
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
      length=settings_lib.sequence_length(config), batch_sharding=rows,
      rules=settings_lib.learner_layout(config)[2])


def programs(config: ml_collections.ConfigDict,
             policy_config: ml_collections.ConfigDict, devices: list
             ) -> list[tuple[str, Mesh, Any, list[aot.Program]]]:
  """For `launch.compile`: the learner's update on the learner mesh and
  the rollout's generation (prefill and KV-cached decoding of the longest
  answer, with behaviour log-probabilities) on the rollout mesh, for the
  policy `policy_config` describes, on shapes only. Returns (name, mesh,
  rules, programs) per mesh."""
  settings_lib.check_config(config, devices, require_sft=False)
  model = lm_trainer.create_model(policy_config)
  settings_lib.check_policy(config, policy_config, model.max_len)
  rollout_mesh, learner_mesh = settings_lib.meshes(config, devices)
  params = nn.meta.unbox(lm_trainer.abstract_variables(model))['params']
  update = update_program(config, model, settings_lib.optimizer(config),
                          settings_lib.loss_settings(config), params,
                          learner_mesh)
  top = max(config.difficulties)
  rows = config.prompts_per_batch * config.grpo.group_size
  return [('learner', learner_mesh, settings_lib.learner_layout(config)[2],
           [update]),
          ('rollout', rollout_mesh, (('batch', 'data'),),
           [rollout_lib.sample_program(
               model, params, rows, tasks.max_prompt_tokens(config.family,
                                                            top),
               tasks.max_answer_tokens(config.family, top),
               config.temperature, rollout_mesh)])]


# Every float of the policy and optimizer state finite (before a save; a
# finite loss can still leave inf in the parameters, e.g. an infinite
# learning rate).
policy_finite = jax.jit(lambda tree: steps.tree_is_finite(
    (tree['params'], tree['opt_state'])))


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the policy lives and the learner's compiled update."""
  rollout_replicated: NamedSharding
  rollout_rows: NamedSharding
  learner_mesh: Mesh
  learner_rows: NamedSharding
  param_shardings: Any
  # (params, opt_state, batch, reference) -> (params, opt_state, metrics)
  update: Any


def group_program(config, model, tx, params, roles: processes_lib.Roles
                  ) -> learner_group.Group:
  """The learner group's mesh and update (on every learner process)."""
  axes, shape, rules = settings_lib.learner_layout(config)
  devices = [d for d in jax.devices() if d.process_index in roles.learners]
  mesh = sharding_lib.make_mesh(shape, axes, devices, field='learner_mesh')
  param_shardings, rows = settings_lib.learner_shardings(config, model,
                                                         mesh)
  learner_group.check_replicated(
      param_shardings, config.prompts_per_batch * config.grpo.group_size,
      mesh)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), params, param_shardings)
  opt_shardings = sharding_lib.optimizer_state_shardings(
      tx, abstract, param_shardings, mesh)
  update = update_program(config, model, tx,
                          settings_lib.loss_settings(config), params,
                          mesh).lower().compile()
  local = NamedSharding(Mesh(np.array(jax.local_devices()), ('data',)), P())
  return learner_group.Group(mesh, param_shardings, opt_shardings, rows,
                             local, update)


def lead_update(group: learner_group.Group, job: Job):
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


def layout(config, model, tx, params, job: Job | None = None) -> Layout:
  """Where the policy lives, and the learner's update (the group's, for
  a lead with followers)."""
  rollout_mesh, learner_mesh = settings_lib.meshes(config)
  param_shardings, learner_rows = settings_lib.learner_shardings(
      config, model, learner_mesh)
  if job is not None and job.roles.followers:
    update = lead_update(
        group_program(config, model, tx, params, job.roles), job)
  else:
    # Compiled ahead of time under the learner's mesh and rules, as
    # `launch.compile` compiles it.
    update = update_program(config, model, tx,
                            settings_lib.loss_settings(config), params,
                            learner_mesh).lower().compile()
  if settings_lib.multi_process(config):
    # The learner process has no rollout mesh: its published versions stay
    # on its devices (the transport sends them), and a batch generated
    # again after admission refused it is generated on the learner mesh.
    return Layout(NamedSharding(learner_mesh, P()), learner_rows,
                  learner_mesh, learner_rows, param_shardings, update)
  return Layout(NamedSharding(rollout_mesh, P()),
                NamedSharding(rollout_mesh, P('data')), learner_mesh,
                learner_rows, param_shardings, update)
