"""The order in which a test stream shows its samples: episodic, continual, mixed.

A stream is planned once, from the config, as a list of batches of
(corruption, sample) pairs; the plan is deterministic in the seed, so a run
that resumes at batch k sees exactly the batches it would have seen.

- 'episodic': one corruption after another, the model reset to the source
  before each (the TENT paper's protocol).
- 'continual': the same sequence without resets (CoTTA's protocol): the
  model carries what it adapted to from one corruption to the next.
- 'mixed': the samples of all corruptions shuffled together, no resets
  (mixed domains, as in the SAR and ROID papers).

`order='by_class'` sorts each corruption's samples by label (for 'mixed',
all samples): batches then hold few classes, the label shift under which
batch statistics fail (SAR's "online imbalanced label distribution").
Within a class, and with `order='shuffled'`, samples come in a seeded
random order. The last batch of a corruption (or of a mixed stream) may be
smaller than `batch_size`.
"""

import dataclasses

import numpy as np

PROTOCOLS = ('episodic', 'continual', 'mixed')
ORDERS = ('shuffled', 'by_class')


@dataclasses.dataclass(frozen=True)
class Batch:
  """One batch of a stream.

  Attributes:
    corruption: (n,) index into the stream's corruptions of each sample.
    sample: (n,) index of each sample within its corruption's set.
    reset: whether the model returns to the source before this batch.
  """
  corruption: np.ndarray
  sample: np.ndarray
  reset: bool


def _ordered(n: int, labels: np.ndarray, order: str,
             rng: np.random.Generator) -> np.ndarray:
  perm = rng.permutation(n)
  if order == 'by_class':
    perm = perm[np.argsort(labels[perm], kind='stable')]
  return perm


def plan(protocol: str, labels: list[np.ndarray], batch_size: int,
         seed: int, order: str = 'shuffled') -> list[Batch]:
  """The batches of a stream over corruptions whose labels are `labels`.

  Args:
    protocol: one of `PROTOCOLS`.
    labels: per corruption, the labels of its samples (only read for
      `order='by_class'`; their lengths give the set sizes).
    batch_size: samples per batch (> 0).
    seed: the shuffling seed.
    order: one of `ORDERS`.
  """
  if protocol not in PROTOCOLS:
    raise ValueError(f'protocol={protocol!r}; valid: {", ".join(PROTOCOLS)}')
  if order not in ORDERS:
    raise ValueError(f'order={order!r}; valid: {", ".join(ORDERS)}')
  if batch_size <= 0:
    raise ValueError(f'batch_size={batch_size}: must be > 0')
  rng = np.random.default_rng(seed)
  batches = []
  if protocol == 'mixed':
    corruption = np.concatenate(
        [np.full(len(l), c, np.int32) for c, l in enumerate(labels)])
    sample = np.concatenate([np.arange(len(l), dtype=np.int32)
                             for l in labels])
    all_labels = (np.concatenate(labels) if labels
                  else np.zeros((0,), np.int32))
    perm = _ordered(len(sample), all_labels, order, rng)
    for start in range(0, len(perm), batch_size):
      take = perm[start:start + batch_size]
      batches.append(Batch(corruption[take], sample[take], start == 0))
    return batches
  for c, l in enumerate(labels):
    perm = _ordered(len(l), l, order, rng).astype(np.int32)
    for start in range(0, len(perm), batch_size):
      reset = start == 0 and (protocol == 'episodic' or c == 0)
      batches.append(Batch(np.full(len(perm[start:start + batch_size]), c,
                                   np.int32), perm[start:start + batch_size],
                           reset))
  return batches
