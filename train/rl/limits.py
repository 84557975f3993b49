"""Bounds on an RL run's sizes, checked before anything is allocated.

Each config field that sets how much the run holds has a bound of its own
(`check_sizes`), so that no value a user types takes the host down before
the memory estimate can weigh it; the bounds are listed in docs/limits.md.
`check_memory` then estimates the run's peak from the policy's size and
the fields that multiply it, and refuses a run whose estimate exceeds
the memory the host has free, naming the field to lower.
"""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import ml_collections

from train.run import checkpointing
from train.errors import ConfigError, UsageError
from train.lm import models
from train.lm import trainer as lm_trainer

# Kept policies: the learner keeps the last s versions for the actors and
# saves them in every checkpoint, each a full copy of the policy with its
# own arrays; the GAS scheduler keeps a state per version within s. This
# repository's sweeps and studies use 0..4; 64 leaves room.
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
               'the learner keeps and checkpoints that many past '
               f'policies (at most {MAX_STALENESS}, and at most '
               f'num_versions={config.num_versions})', low=0)
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


# What the process holds besides the arrays counted below (Python, the
# libraries, XLA's compiled programs and the warm start's restore), from
# the real Gemma's run (BENCHMARKS.md).
OVERHEAD_BYTES = 1 << 30
GIB = 2.0 ** 30


@dataclasses.dataclass(frozen=True)
class Estimate:
  """An RL run's estimated peak in bytes, by what holds it.

  Attributes:
    held: what the run holds throughout: the learner's policy and Adam
      moments, the reference (beta > 0), the kept versions on each rollout
      device, and the overhead.
    phases: the most each phase adds at once: 'update' (the new policy
      and moments beside the old, the gradient, the logits of a batch),
      'checkpoint' (the kept versions on the learner, a host copy of the
      saved state), 'generation' (a version being published, the actors'
      and the evaluation's logits).
    fields: the bytes each lowerable field is responsible for, for the
      refusal to name the largest.
  """
  held: int
  phases: dict[str, int]
  fields: dict[str, int]

  @property
  def peak(self) -> int:
    return self.held + max(self.phases.values())


def estimate(config: ml_collections.ConfigDict, policy_bytes: int,
             vocab: int, length: int) -> Estimate:
  """The peak of a one-process run on a host whose devices share its
  memory (CPU), for a policy of `policy_bytes`, `vocab` logits a token and
  `length` tokens a sequence."""
  p, s = policy_bytes, config.runtime.max_staleness
  copies = config.rollout_devices  # Each rollout device its replica.
  logits = lambda rows: rows * length * vocab * 4
  rows = config.prompts_per_batch * config.grpo.group_size
  # Forward logits, their log-softmax and its gradient: three of a batch's.
  update_logits = 3 * logits(rows)
  eval_rows = min(256, config.eval_examples)  # rollout.pass_at_1's chunk.
  actor_logits = config.runtime.num_actors * 3 * logits(rows) // length
  reference = p if config.grpo.beta > 0 else 0
  held = 3 * p + reference + copies * (s + 1) * p + OVERHEAD_BYTES
  phases = {'update': 4 * p + update_logits,
            'checkpoint': s * p + (3 + s) * p,
            'generation': copies * p + actor_logits
                          + 3 * logits(eval_rows) // length}
  fields = {'runtime.max_staleness': (copies + 2) * s * p,
            'rollout_devices': (copies - 1) * (s + 2) * p,
            'prompts_per_batch': update_logits + actor_logits,
            'runtime.num_actors': actor_logits,
            'eval_examples': 3 * logits(eval_rows) // length}
  return Estimate(held, phases, fields)


def available_bytes() -> int:
  """The memory this host can give without swapping: MemAvailable (free
  pages and the reclaimable cache), else the free pages."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')


def check_memory(config: ml_collections.ConfigDict, policy_bytes: int,
                 vocab: int, length: int, available: int | None = None
                 ) -> Estimate:
  """ConfigError naming the field that holds the most of the estimated
  peak (or the policy, `sft_workdir`, when nothing lowerable does) unless
  it fits in `available` bytes (default: what the host has free)."""
  found = estimate(config, policy_bytes, vocab, length)
  available = available_bytes() if available is None else available
  if found.peak <= available:
    return found
  field, most = max(found.fields.items(), key=lambda kv: kv[1])
  phase = max(found.phases, key=found.phases.get)
  need = (f'estimated peak {found.peak / GIB:.1f} GiB (a policy of '
          f'{policy_bytes / GIB:.2f} GiB: {found.held / GIB:.1f} GiB held, '
          f'{found.phases[phase] / GIB:.1f} GiB more in its {phase}) exceeds '
          f'the {available / GIB:.1f} GiB this host has free')
  if found.peak - most > available:  # Lowering the field would not do.
    raise ConfigError('sft_workdir', config.sft_workdir,
                      f'{need}; a smaller policy, or a host with more memory')
  value = config
  for part in field.split('.'):
    value = value[part]
  raise ConfigError(field, value, f'{need}; lower it (it holds '
                    f'{most / GIB:.1f} GiB of that)')


def policy_size(sft_workdir: str) -> tuple[int, int] | None:
  """(parameter bytes, vocabulary) of the policy an SFT workdir's newest
  checkpoint describes, from its saved config alone (shapes, nothing
  allocated); None where that config does not build a model (restoring
  the policy reports why, in its own words)."""
  found = checkpointing.newest_meta(sft_workdir)
  if found is None or 'config' not in found[1]:
    return None
  try:
    config = ml_collections.ConfigDict(json.loads(found[1]['config']))
    model = lm_trainer.create_model(config)
    vocab = models.vocab_size(config)
  except (UsageError, ValueError, KeyError, TypeError, AttributeError):
    return None
  params = nn.meta.unbox(lm_trainer.abstract_variables(model))['params']
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)), vocab


def check_host_memory(config: ml_collections.ConfigDict, length: int) -> None:
  """`check_memory` for a one-process run on CPU, whose simulated devices
  share the host's memory, with its SFT policy's size (`length`: tokens a
  sequence). Accelerators hold the arrays in their own memory, and the
  processes of a multi-process run each hold a part: neither is estimated
  here."""
  if (config.get('rollout_processes') is not None
      or jax.default_backend() != 'cpu'):
    return
  size = policy_size(config.sft_workdir)
  if size is not None:
    check_memory(config, *size, length)
