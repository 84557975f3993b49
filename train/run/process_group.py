"""Which processes a run spans: the whole JAX job, or this process alone.

A training run spans every process of its job (`launch.train --multihost`):
process 0 holds the workdir's lock and writes its logs and results, the
mesh covers every process's devices, checkpoints and stops are agreed by
all. The learner of a multi-process RL job (`launch.rl --multihost`) is
one process of a job whose other processes generate: it runs the same
core alone, inside `alone()`. There, this process is the writer, meshes
default to its own devices, and nothing waits for the other processes
(their collectives would hang: they never call them).
"""

from collections.abc import Iterator
import contextlib
from typing import Any

import jax

_ALONE = [False]


@contextlib.contextmanager
def alone() -> Iterator[None]:
  """Inside the block, runs see this process as their only one."""
  previous, _ALONE[0] = _ALONE[0], True
  try:
    yield
  finally:
    _ALONE[0] = previous


def is_alone() -> bool:
  """Whether a run spans this process only, though the job has others."""
  return _ALONE[0] and jax.process_count() > 1


def count() -> int:
  """The processes a run spans."""
  return 1 if _ALONE[0] else jax.process_count()


def is_writer() -> bool:
  """Whether this process writes the run's files (lock, logs, results)."""
  return _ALONE[0] or jax.process_index() == 0


def devices() -> list[Any]:
  """The devices a run's meshes cover by default."""
  return list(jax.local_devices() if _ALONE[0] else jax.devices())
