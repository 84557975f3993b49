"""Bounds on an RL run's sizes, checked before anything is allocated.

Each config field that sets how much the run holds has a bound of its own
(`check_sizes`), so that no value a user types takes the host down before
the memory estimate can weigh it; the bounds are listed in docs/limits.md.
`check_memory` then estimates the run's peak from the policy's size and
the fields that multiply it, and refuses a run whose estimate exceeds
the memory the host has free, naming the field to lower.
"""

import dataclasses
import math
import os

import ml_collections

from train.errors import ConfigError

# Kept policies: the learner keeps the last s versions for the actors and
# saves them in every checkpoint, each a full copy of the policy with its
# own arrays; the GAS scheduler keeps a state per version within s. The
# staleness studied is 0..8 (AReaL's and GAS's); 64 leaves room.
MAX_STALENESS = 64
# Learner updates: Adam's step count is an int32.
MAX_NUM_VERSIONS = 2**31 - 1
# Evaluations over the run (num_versions / eval_every): the pass@1 curve is
# kept in every checkpoint's metadata and in results.json.
MAX_EVALUATIONS = 10_000
# Generation threads: each holds a batch in flight, on the same devices.
MAX_NUM_ACTORS = 64
# Finished batches held before the learner takes them (host arrays).
MAX_BUFFER_CAPACITY = 1024
# GRPO's gradient steps per batch: each is unrolled in the update program
# (its compile time and size grow with it); recipes use 1 to 4.
MAX_ITERATIONS = 16
# Entries of `difficulties` (repeats weigh a difficulty up).
MAX_DIFFICULTY_ENTRIES = 64
# Sequences a batch (prompts x group), and held-out problems a difficulty.
MAX_BATCH_ROWS = 1 << 16
MAX_EVAL_EXAMPLES = 100_000


def _bounded_int(config: ml_collections.ConfigDict, field: str, top: int,
                 why: str, low: int = 1) -> None:
  value = config
  for part in field.split('.'):
    value = value[part]
  if (isinstance(value, bool) or not isinstance(value, int)
      or not low <= value <= top):
    raise ConfigError(field, value,
                      f'must be an integer in [{low}, {top}]: {why}')


def check_sizes(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the first size field past its bound (see the
  module's constants for why each is what it is)."""
  _bounded_int(config, 'num_versions', MAX_NUM_VERSIONS,
               "Adam's step count is an int32")
  _bounded_int(config, 'runtime.max_staleness',
               min(MAX_STALENESS, config.num_versions),
               f'at most num_versions ({config.num_versions}) and '
               f'{MAX_STALENESS}: the learner keeps and checkpoints that '
               'many past policies', low=0)
  _bounded_int(config, 'runtime.num_actors', MAX_NUM_ACTORS,
               'each actor holds a batch in flight')
  if config.runtime.get('buffer_capacity') is not None:
    _bounded_int(config, 'runtime.buffer_capacity', MAX_BUFFER_CAPACITY,
                 'finished batches held (unset: max_staleness + '
                 'num_actors)')
  _bounded_int(config, 'grpo.iterations', MAX_ITERATIONS,
               'each is unrolled in the update program')
  evaluations = config.num_versions // config.eval_every
  if evaluations > MAX_EVALUATIONS:
    least = -(-config.num_versions // MAX_EVALUATIONS)
    raise ConfigError('eval_every', config.eval_every,
                      f'gives {evaluations} evaluations of num_versions='
                      f'{config.num_versions}; at most {MAX_EVALUATIONS} '
                      f'(eval_every >= {least}): the pass@1 curve is kept '
                      'in every checkpoint')
  if len(config.difficulties) > MAX_DIFFICULTY_ENTRIES:
    raise ConfigError('difficulties', f'{len(config.difficulties)} entries',
                      f'must have at most {MAX_DIFFICULTY_ENTRIES}')
  rows = config.prompts_per_batch * config.grpo.group_size
  if rows > MAX_BATCH_ROWS:
    raise ConfigError('prompts_per_batch', config.prompts_per_batch,
                      f'times grpo.group_size ({config.grpo.group_size}) '
                      f'must be at most {MAX_BATCH_ROWS} sequences a batch')
  _bounded_int(config, 'eval_examples', MAX_EVAL_EXAMPLES,
               'held-out problems per difficulty')
