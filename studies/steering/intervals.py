"""The steering study's statistics: methods compared at matched KL, with intervals.

Input: one evaluation (`train.steering.evaluation.evaluate`'s results.json:
`{'meta', 'rows'}`) per trained LM, each over the same item sets
(`mc_seeds`) and alpha sweep. Each row holds, per task, every item's 0/1
correctness per item set, and the KL of the steered model to the
unsteered one on held-out text.

- Accuracy at matched KL (`matched`): each (LM, item set)'s per-item
  correctness is interpolated in KL along the method's alpha sweep
  (`matched_kl.scores_at_kl`, the unsteered row as KL 0), then averaged
  with a hierarchical bootstrap over LMs, item sets within an LM and items
  within a set (`train.analysis.stats`). A target KL that some LM's sweep does
  not reach gives no figure: the cell says how many LMs reached it.
- Paired differences (`paired`): the per-item difference of two methods
  at the same KL, on the same items, bootstrapped the same way; an
  interval that excludes 0 is a difference the seeds and items support.
- The gate x geometry ablation (`ablation`): with the four cells addition,
  addition_gate, spherical, spherical_gate, the gate's effect averaged
  over the geometry, the rotation's averaged over the gate, and their
  interaction, each per item, with intervals.
- Per-LM scalars at matched KL (`scalar_at_kl`: the generations' positive
  share and cross-entropy, the trigger rate), with intervals over LMs
  only: three LMs give a coarse interval (10 distinct resamples), which
  the study text says.

Everything here is plain numpy on loaded results: tested on constructed
data against direct computations (`tests/test_steering_study.py`).
"""

from collections.abc import Sequence
import math
from typing import Any, NamedTuple

import numpy as np

from train.analysis import stats
from train.steering import matched_kl

TARGET_KLS = (0.05, 0.1, 0.2, 0.33, 0.5)
# The 2 x 2: (gate, geometry) -> method.
ABLATION = {(False, 'addition'): 'addition', (True, 'addition'): 'addition_gate',
            (False, 'rotation'): 'spherical',
            (True, 'rotation'): 'spherical_gate'}
EFFECTS = ('gate', 'rotation', 'interaction')
PAIRS = (('spherical_gate', 'addition'), ('spherical_gate', 'addition_renorm'),
         ('spherical_gate', 'spherical'), ('addition_gate', 'addition'),
         ('spherical_gate', 'addition_gate'), ('spherical', 'addition'))

Results = dict[str, Any]  # One evaluation's results.json.


class Cell(NamedTuple):
  """A mean and its 95% bootstrap interval; NaN where `reached` < `of`
  (the target KL lies beyond some LM's sweep)."""
  mean: float
  low: float
  high: float
  reached: int
  of: int

  def format(self, scale: float = 100.0, digits: int = 1,
             missing: str = 'not reached') -> str:
    if self.reached < self.of:
      return f'{missing} ({self.reached}/{self.of} LMs)'
    f = f'{{:.{digits}f}}'
    return (f'{f.format(self.mean * scale)} '
            f'[{f.format(self.low * scale)}, {f.format(self.high * scale)}]')


def methods_of(results: Results) -> list[str]:
  return list(dict.fromkeys(r['method'] for r in results['rows']))


def _rows(results: Results, method: str) -> list[dict]:
  rows = [r for r in results['rows'] if r['method'] == method]
  if not rows:
    raise ValueError(f'method={method!r}: not in the evaluation (it has '
                     f'{", ".join(methods_of(results))})')
  return rows


def _base(results: Results) -> dict:
  return _rows(results, 'none')[0]


def item_scores_at_kl(results: Results, method: str, task: str,
                      targets: Sequence[float],
                      score: str = 'mean') -> list[np.ndarray]:
  """Per item set, the (T, N) correctness of `method` interpolated at the
  target KLs (NaN rows beyond the sweep)."""
  rows = _rows(results, method)
  key = f'{task}_correct_{score}'
  base = np.asarray(_base(results)[key], np.float64)  # (S, N)
  kl = np.array([r['kl'] for r in rows])
  correct = np.asarray([r[key] for r in rows], np.float64)  # (A, S, N)
  if method == 'none':
    return [np.broadcast_to(b, (len(targets), b.size)).copy() for b in base]
  return [matched_kl.scores_at_kl(kl, correct[:, s], targets, base[s])
          for s in range(correct.shape[1])]


def _cells(per_lm: list[list[np.ndarray]], num_samples: int,
           seed: int) -> list[Cell]:
  """per_lm[l][s]: (T, N) item scores; one Cell per target."""
  num_targets = per_lm[0][0].shape[0]
  cells = []
  for t in range(num_targets):
    data = [[s[t] for s in sets] for sets in per_lm]
    reached = sum(all(np.all(np.isfinite(x)) for x in sets) for sets in data)
    if reached < len(data):
      cells.append(Cell(math.nan, math.nan, math.nan, reached, len(data)))
      continue
    iv = stats.interval(data, num_samples=num_samples, seed=seed + t)
    cells.append(Cell(iv.mean, iv.low, iv.high, reached, len(data)))
  return cells


def matched(runs: Sequence[Results], method: str, task: str,
            targets: Sequence[float] = TARGET_KLS, score: str = 'mean',
            num_samples: int = 2000, seed: int = 0) -> list[Cell]:
  """Accuracy of `method` at each target KL over LMs, item sets and items."""
  return _cells([item_scores_at_kl(r, method, task, targets, score)
                 for r in runs], num_samples, seed)


def _combine(runs, weights: Sequence[tuple[str, float]], task, targets,
             score):
  """Per LM and set, sum_m w_m * scores_m: a per-item contrast (a method
  may appear twice, e.g. a method against itself)."""
  out = []
  for r in runs:
    per_method = {m: item_scores_at_kl(r, m, task, targets, score)
                  for m, _ in weights}
    num_sets = len(next(iter(per_method.values())))
    out.append([sum(w * per_method[m][s] for m, w in weights)
                for s in range(num_sets)])
  return out


def paired(runs: Sequence[Results], a: str, b: str, task: str,
           targets: Sequence[float] = TARGET_KLS, score: str = 'mean',
           num_samples: int = 2000, seed: int = 0) -> list[Cell]:
  """Accuracy of `a` minus `b` at each target KL, items paired."""
  return _cells(_combine(runs, ((a, 1.0), (b, -1.0)), task, targets, score),
                num_samples, seed)


def ablation(runs: Sequence[Results], task: str,
             targets: Sequence[float] = TARGET_KLS, score: str = 'mean',
             num_samples: int = 2000, seed: int = 0) -> dict[str, list[Cell]]:
  """The 2 x 2's effects at each target KL: 'gate' = mean over geometry of
  gated - ungated; 'rotation' = mean over gate of rotation - addition;
  'interaction' = (gate's effect on the rotation) - (on addition)."""
  m = ABLATION
  contrasts = {
      'gate': ((m[True, 'addition'], 0.5), (m[False, 'addition'], -0.5),
               (m[True, 'rotation'], 0.5), (m[False, 'rotation'], -0.5)),
      'rotation': ((m[False, 'rotation'], 0.5), (m[False, 'addition'], -0.5),
                   (m[True, 'rotation'], 0.5), (m[True, 'addition'], -0.5)),
      'interaction': ((m[True, 'rotation'], 1.0), (m[False, 'rotation'], -1.0),
                      (m[True, 'addition'], -1.0), (m[False, 'addition'], 1.0)),
  }
  return {name: _cells(_combine(runs, w, task, targets, score), num_samples,
                       seed)
          for name, w in contrasts.items()}


def _float(value) -> float:
  return math.nan if value is None else float(value)  # JSON's null: NaN.


def scalar_at_kl(runs: Sequence[Results], method: str, key: str,
                 targets: Sequence[float] = TARGET_KLS) -> np.ndarray:
  """(L, T): a per-row scalar (e.g. 'positive_share', 'gen_ce') of each LM
  interpolated at the target KLs along `method`'s sweep, the unsteered row
  as KL 0 (NaN beyond the sweep, or where a bracketing value is NaN, such
  as a positive share of texts with no sentiment word)."""
  out = []
  for r in runs:
    rows = _rows(r, method)
    if method == 'none':
      out.append(np.full(len(targets), _float(rows[0][key])))
      continue
    kl = np.array([x['kl'] for x in rows])
    vals = np.array([[_float(x[key])] for x in rows])
    out.append(matched_kl.scores_at_kl(
        kl, vals, targets, np.array([_float(_base(r)[key])]))[:, 0])
  return np.array(out)


def over_lms(values: np.ndarray, num_samples: int = 2000,
             seed: int = 0) -> list[Cell]:
  """One Cell per column of (L, T) values: the mean over LMs and its
  bootstrap interval over LMs."""
  values = np.asarray(values, np.float64)
  cells = []
  for t in range(values.shape[1]):
    col = values[:, t]
    reached = int(np.sum(np.isfinite(col)))
    if reached < len(col):
      cells.append(Cell(math.nan, math.nan, math.nan, reached, len(col)))
      continue
    iv = stats.interval(col, num_samples=num_samples, seed=seed + t)
    cells.append(Cell(iv.mean, iv.low, iv.high, reached, len(col)))
  return cells


def check_runs(runs: Sequence[Results], methods: Sequence[str]) -> None:
  """ValueError unless every run has 'none' and `methods`, the same tasks,
  item sets and alphas: the comparisons pair items across methods."""
  if not runs:
    raise ValueError('runs: no evaluation to aggregate')
  first = runs[0]['meta']
  for i, r in enumerate(runs):
    for m in ('none', *methods):
      _rows(r, m)
    for field in ('mc_seeds', 'tasks'):
      if r['meta'].get(field) != first.get(field):
        raise ValueError(f'run {i}: {field}={r["meta"].get(field)!r} differs '
                         f'from run 0\'s {first.get(field)!r}')
