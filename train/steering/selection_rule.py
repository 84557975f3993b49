"""The rule that picks a steering method's setting from its validation sweeps.

Plain numpy on the numbers `train.steering.selection` records in
selection.json, so that the choice can be recomputed from the file.

A candidate is one (layer, direction method) with its sweep over the
candidate alphas: per alpha the validation KL(unsteered || steered) per
token of held-out text, and per task the validation accuracy; the
unsteered model's accuracy per task is the point KL = 0.

- `candidate_score`: the accuracy at matched KL, interpolated linearly in
  KL between the sweep points around each target KL
  (`matched_kl.scores_at_kl`, the study's reading: the mean of the
  interpolated items is the interpolated mean), averaged over the tasks
  and over the targets the sweep reaches (a target beyond the sweep's
  largest KL is not reached: nothing is extrapolated).
- `best`: the candidate reaching the most targets wins (the comparison
  happens at those KLs), then the highest score; ties go to the first in
  order.
- `alpha_grid`: the winner's alphas that bracket the targets it reaches,
  in order of validation KL: from the largest KL below the smallest
  target (none where the unsteered point brackets it) to the smallest KL
  at or above the largest reached target, every alpha in between, and
  one more above, because the test text's KL is not the validation
  text's.
"""

from collections.abc import Sequence
import math
from typing import Any, NamedTuple

import numpy as np

from train.steering import matched_kl


class Score(NamedTuple):
  """A candidate's standing: how many targets its sweep reaches, and its
  mean accuracy at matched KL over the tasks and those targets (NaN when
  it reaches none)."""
  reached: int
  score: float

  def key(self) -> tuple[int, float]:
    """Larger is better."""
    return self.reached, (-math.inf if math.isnan(self.score)
                          else self.score)


def matched_accuracy(kl: Sequence[float], accuracy: Sequence[float],
                     unsteered: float, targets: Sequence[float]
                     ) -> np.ndarray:
  """(T,) accuracy at each target KL (NaN beyond the sweep)."""
  return matched_kl.scores_at_kl(
      np.asarray(kl, np.float64), np.asarray(accuracy, np.float64)[:, None],
      np.asarray(targets, np.float64), np.array([unsteered]))[:, 0]


def candidate_score(candidate: dict[str, Any], unsteered: dict[str, float],
                    targets: Sequence[float]) -> Score:
  """`candidate`: {'kl': [A], 'accuracy': {task: [A]}}; `unsteered`:
  {task: accuracy}."""
  per_task = np.array([
      matched_accuracy(candidate['kl'], acc, unsteered[task], targets)
      for task, acc in candidate['accuracy'].items()])  # (tasks, T)
  reached = np.all(np.isfinite(per_task), axis=0)
  if not reached.any():
    return Score(0, math.nan)
  return Score(int(reached.sum()), float(per_task[:, reached].mean()))


def best(scores: Sequence[Score]) -> int:
  """The index of the winning candidate (the first of equals)."""
  if not scores:
    raise ValueError('scores: no candidate')
  keys = [s.key() for s in scores]
  return keys.index(max(keys))


def alpha_grid(alphas: Sequence[float], kl: Sequence[float],
               targets: Sequence[float]) -> list[float]:
  """The alphas of the strength grid (see the module docstring), in
  increasing order."""
  if len(alphas) != len(kl) or not alphas:
    raise ValueError(f'alphas {list(alphas)} and kl {list(kl)}: need one '
                     'KL per alpha, at least one')
  order = sorted(range(len(alphas)), key=lambda i: (kl[i], alphas[i]))
  ranked = [kl[i] for i in order]
  reached = [t for t in targets if t <= ranked[-1]]
  if not reached:  # Nothing reaches a target: the whole sweep, to look at.
    return sorted(alphas)
  below = [k for k, v in enumerate(ranked) if v < min(reached)]
  lo = below[-1] if below else next(
      k for k, v in enumerate(ranked) if v >= min(reached))
  hi = next(k for k, v in enumerate(ranked) if v >= max(reached))
  return sorted(alphas[i] for i in order[lo:hi + 2])
