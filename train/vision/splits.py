"""Stratified, fixed-seed train/validation/test splits of an in-project data set."""

from collections.abc import Callable

import numpy as np


def stratified(labels: np.ndarray, held_out: Callable[[int], tuple[int, int]],
               seed: int) -> dict[str, np.ndarray]:
  """Sorted indices of each split, drawn per class from one seeded permutation.

  Args:
    labels: the label of every example.
    held_out: a class's size -> (test, validation) examples it gives.
    seed: the permutation's seed (the splits are the same on every machine).
  """
  rng = np.random.default_rng(seed)
  parts = {'train': [], 'validation': [], 'test': []}
  for label in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == label))
    n_test, n_val = held_out(len(members))
    parts['test'].append(members[:n_test])
    parts['validation'].append(members[n_test:n_test + n_val])
    parts['train'].append(members[n_test + n_val:])
  return {name: np.sort(np.concatenate(p)) for name, p in parts.items()}
