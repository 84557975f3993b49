"""A learner over several processes: one SPMD update over the group's devices.

With `rollout_processes = R` of N processes, processes R..N-1 learn. The
first of them, the lead, runs the learner exactly as a one-process
learner does (`train.rl.run`): it takes the batches, asks the scheduler,
evaluates, publishes the versions, serves the weights and writes the
checkpoints, all on its own devices. Only the update spans the group: a
program over every learner process's devices (the batch's rows split
over them, so each process computes the gradient of its share and the
sum crosses processes), called by each learner process in the same order.

The policy and the optimizer state are replicated on the group's devices
(data parallel), so each learner process holds all of both, and the
lead's own view of them (on its devices alone) is the same buffers as
the group's: `local_view` and `global_view` convert without a copy. That
is why the lead alone can checkpoint, evaluate and publish, and why the
checkpoint format is the one-learner one (whole arrays, written by the
lead alone; `train.run.workdir_run` picks it): a run resumes on any
split. A policy sharded over the group (FSDP) is refused; it would need
the group to gather before each of those.

The others follow: the lead sends them the state it starts from
(`state`, after a restore or a fresh start) and, before each update, the
batch (`step`), by the job's transport (`train.rl.transport`); each
follower places it and joins the update. The decisions (admission, the
loss weight, regenerating a refused batch) are the lead's, taken before
it sends, so every process computes the same step. A follower never
touches the workdir.

Numerics: the cross-process sum of the update runs through the CPU
client's collectives (gloo on loopback, ICI/DCN or NCCL on pods), which
add in another order than one process does: a learner over two processes
agrees with a one-process learner to rounding, not bit for bit; it is
bit for bit equal to itself (same split) after a kill and resume.
"""

import dataclasses
import queue
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from train.errors import ConfigError


def local_view(tree: Any, sharding: NamedSharding) -> Any:
  """Arrays replicated over the group, as arrays over this process's
  devices (`sharding`, replicated); no copy."""
  devices = list(sharding.mesh.devices.flat)

  def one(x):
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [by_device[d] for d in devices])
  return jax.tree.map(one, tree)


def global_view(tree: Any, shardings: Any) -> Any:
  """This process's replicated arrays as the group's (`shardings`,
  replicated over the group's devices); no copy."""

  def one(x, s):
    by_device = {sh.device: sh.data for sh in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, s, [by_device[d] for d in s.mesh.devices.flat
                     if d.process_index == jax.process_index()])
  return jax.tree.map(one, tree, shardings)


@dataclasses.dataclass(frozen=True)
class Group:
  """The group's mesh and compiled update, the same on every learner
  process.

  Attributes:
    mesh: the learner mesh over the group's devices.
    param_shardings: the policy's (replicated) on `mesh`.
    opt_shardings: the optimizer state's on `mesh`.
    rows: the batch rows' sharding on `mesh`.
    local: replicated over this process's devices.
    update: the compiled (params, opt_state, batch, reference) ->
      (params, opt_state, metrics) on `mesh`.
  """
  mesh: Mesh
  param_shardings: Any
  opt_shardings: Any
  rows: NamedSharding
  local: NamedSharding
  update: Any

  def step(self, params, opt_state, host_batch, reference):
    """One update from this process's views; returns their successors
    (and the metrics) in this process's view."""
    batch = jax.tree.map(
        lambda h: jax.make_array_from_callback(h.shape, self.rows,
                                               lambda idx: h[idx]),
        host_batch)
    out = self.update(global_view(params, self.param_shardings),
                      global_view(opt_state, self.opt_shardings), batch,
                      reference)
    return local_view(out, self.local)

  def group_reference(self, reference) -> Any:
    return global_view(reference, self.param_shardings)


def wait_ready(tree: Any, check: Callable[[], None]) -> Any:
  """`tree` once computed, running `check` meanwhile: a step over the
  group waits on every learner process, and one that died leaves it
  waiting (the collectives have no deadline of their own), so `check`
  names the dead process and ends the wait in one line."""
  leaves = jax.tree.leaves(tree)
  while not all(x.is_ready() for x in leaves):
    check()
    time.sleep(0.005)
  return tree


def check_replicated(shardings: Any, rows: int, mesh: Mesh) -> None:
  """ConfigError unless the policy is replicated over the group and the
  batch's rows split evenly over its devices."""
  sharded = [s for s in jax.tree.leaves(shardings)
             if not s.is_fully_replicated]
  if sharded:
    raise ConfigError(
        'learner_mesh', 'shards the policy',
        'a learner over several processes keeps the policy replicated '
        '(data parallel over the learner processes): drop the rules that '
        'shard parameters, or use one learner process')
  if rows % mesh.devices.size:
    raise ConfigError(
        'prompts_per_batch', rows,
        f'prompts_per_batch * grpo.group_size = {rows} rows must split '
        f'evenly over the learner group\'s {mesh.devices.size} devices')


class Inbox:
  """What a follower receives from the lead, in the order it was sent."""

  def __init__(self):
    self._queue: queue.Queue = queue.Queue()

  def receive(self, kind: str, meta: dict, src: int,
              arrays: list[jax.Array]) -> None:
    """The transport's callback."""
    self._queue.put((kind, meta, src, [np.asarray(a) for a in arrays]))

  def next(self, check: Callable[[], None]
           ) -> tuple[str, dict, int, list[np.ndarray]] | None:
    """The next message, or None after 50 ms without one (then `check`
    runs: it raises what ended the job)."""
    try:
      return self._queue.get(timeout=0.05)
    except queue.Empty:
      check()
      return None
