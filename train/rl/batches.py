"""An RL run's batches: batch k's prompts, its generation, its arrays in transit.

Batch k holds P prompts of one difficulty, each G times; what it holds
(its prompts, its sampling key) is a function of (seed, k) and its
difficulty alone, so it is the same batch wherever it is generated: an
actor thread, a rollout process, or the learner generating it again.
"""

import dataclasses
import time

import jax
from jax.sharding import NamedSharding
import numpy as np

from train.rl import rollout as rollout_lib
from train.rl import tasks


@dataclasses.dataclass(frozen=True)
class Item:
  """A generated batch: its rollout, difficulty and generation time."""
  rollout: rollout_lib.Rollout
  difficulty: int
  seconds: float


# A batch's arrays as they cross from a rollout process to the learner.
BATCH_ARRAYS = ('prompt', 'prompt_valid', 'completion', 'completion_mask',
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
