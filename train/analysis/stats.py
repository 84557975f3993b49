"""Statistics and tables of the studies: mean ± std, markdown tables, and
hierarchical (multi-level) bootstrap intervals for a mean over nested units.

`mean_std` and `markdown_table` format what the study launchers and
reports write to RESULTS.md.

The bootstrap:

A study's per-item scores are nested: items within an item set, item sets
within a trained model (seed). The spread a reader needs covers every
level: another model seed, another item set, other items. The bootstrap
here resamples each level with replacement, top down (Davison & Hinkley,
1997, section 3.8; "resampling at every stage"): pick seeds, then within
each picked seed pick its item sets, then within each its items; the
statistic is the mean of the means at each level, so that every seed
weighs the same whatever its number of items.

Data is a nested list whose leaves are 1-D arrays of item scores (0/1
correctness, a paired difference between two methods on the same items,
an accuracy interpolated at a matched KL, ...):

  data = [[items_seed0_set0, items_seed0_set1], [items_seed1_set0, ...]]
  m = nested_mean(data)
  lo, hi = interval(data, num_samples=2000, seed=0)

Paired comparisons: pass the per-item difference of two methods scored on
the same items; the items are then resampled together for both methods.

Resampling three seeds is coarse (only 10 distinct multisets), so an
interval over seeds says how far the few seeds agree, not a population
coverage; the study text says so where it matters.
"""

from collections.abc import Sequence
import functools
import math
import statistics
from typing import Any, NamedTuple

import numpy as np

from train.errors import UsageError

Nested = Any  # A 1-D array of item scores, or a list of Nested.

# A study's tables give the mean over its seeds: one seed is the least that
# gives one (the spread then reads as absent, not as 0; RESULTS.md's
# studies use 3 or more, the tests' small runs 1).
MIN_SEEDS = 1
# A study plans one run per seed up front (and a sweep one process each):
# past this, a mistyped count would plan millions before the first run.
MAX_SEEDS = 1000
_SEEDS_NEEDED = (f'a study needs at least {MIN_SEEDS} seed for its means (2 '
                 'for a spread; its results use 3 or more)')


class Interval(NamedTuple):
  mean: float  # The nested mean of the data itself.
  low: float
  high: float


def mean_std(values: Sequence[float], scale: float = 1.0,
             digits: int = 1, notation: str = 'f') -> str:
  """'mean ± sample std' of `scale * values` ('-' if none; the value alone
  if one), `digits` after the point in fixed ('f') or scientific ('e')
  notation."""
  if notation not in ('f', 'e'):
    raise ValueError(f"notation={notation!r}: valid choices: 'f', 'e'")
  values = [scale * v for v in values]
  if not values:
    return '-'
  if len(values) == 1:
    return f'{values[0]:.{digits}{notation}}'
  return (f'{statistics.mean(values):.{digits}{notation}} ± '
          f'{statistics.stdev(values):.{digits}{notation}}')


def t_interval(values: Sequence[float], level: float = 0.95
               ) -> tuple[float, float]:
  """Student's t interval for the mean of `values` (n - 1 degrees of
  freedom; NaN for fewer than two values): with three paired seeds it says
  which values of the mean the seeds rule out, assuming their spread is
  normal."""
  if not 0 < level < 1:
    raise ValueError(f'level={level}: must be in (0, 1)')
  n = len(values)
  if n < 2:
    return float('nan'), float('nan')
  # Here, not at the top: scipy.stats costs 0.7 s to import, and the
  # launchers that import this module for its tables never need it.
  import scipy.stats  # pylint: disable=g-import-not-at-top
  mean = statistics.mean(values)
  half = (scipy.stats.t.ppf((1 + level) / 2, n - 1)
          * statistics.stdev(values) / math.sqrt(n))
  return mean - half, mean + half


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
  """Spearman's rank correlation (ties take their mean rank; NaN when
  either side is constant or has fewer than two finite pairs)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ok = np.isfinite(a) & np.isfinite(b)
  a, b = a[ok], b[ok]

  def ranks(x):
    r = np.empty(len(x))
    r[np.argsort(x, kind='stable')] = np.arange(len(x), dtype=np.float64)
    for v in np.unique(x):
      r[x == v] = r[x == v].mean()
    return r

  if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
    return float('nan')
  return float(np.corrcoef(ranks(a), ranks(b))[0, 1])



def check_seed_count(flag: str, value: Any) -> int:
  """The seed count of a study's `--seeds=N` (seeds 0 to N-1).

  Raises:
    UsageError: `value` is not an integer in [MIN_SEEDS, MAX_SEEDS] (named
      `flag`); checked before anything is trained, since a study of no
      seeds ends in a failed mean after all its runs.
  """
  count = None
  if isinstance(value, (int, str)) and not isinstance(value, bool):
    try:
      count = int(value)
    except ValueError:
      pass
  if count is None or count < MIN_SEEDS:
    raise UsageError(flag, value, f'must be an integer >= {MIN_SEEDS}: '
                     f'{_SEEDS_NEEDED}')
  if count > MAX_SEEDS:
    raise UsageError(flag, value, f'must be at most {MAX_SEEDS} seeds')
  return count


def check_seed_list(flag: str, values: Sequence[Any]) -> list[int]:
  """The seeds of a study's list flag (`--lm_seeds=0,1,2`), as integers.

  Raises:
    UsageError: a value is not an integer in [0, 2**32) (what a config's
      seed takes), more than MAX_SEEDS are given, one repeats (a repeated
      seed would count one run twice in a mean and its spread), or fewer
      than MIN_SEEDS are given; named `flag`.
  """
  seeds = []
  for value in values:
    try:
      seed = int(value)
    except (TypeError, ValueError):
      raise UsageError(flag, value,
                       'not a number; seeds are integers >= 0') from None
    if not 0 <= seed < 2**32:
      raise UsageError(flag, value, 'seeds are integers in [0, 2**32)')
    seeds.append(seed)
    if len(seeds) > MAX_SEEDS:
      raise UsageError(flag, f'{len(values)} values',
                       f'must be at most {MAX_SEEDS} seeds')
  if len(set(seeds)) != len(seeds):
    raise UsageError(flag, ','.join(map(str, values)),
                     'has a repeated value; each seed counts once')
  if len(seeds) < MIN_SEEDS:
    raise UsageError(flag, ','.join(map(str, values)),
                     f'give at least one seed: {_SEEDS_NEEDED}')
  return seeds


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: str | None = None) -> str:
  """A GitHub markdown table; `align` is one character per column: 'l'
  (left, ':--'), 'r' (right, '--:'), 'c' (centred, ':-:') or '-' (a plain
  '---' rule cell: no alignment, the renderer's default); default: the first
  column left, the others right."""
  align = align or 'l' + 'r' * (len(header) - 1)
  if len(align) != len(header):
    raise ValueError(f'align {align!r} has {len(align)} columns, the '
                     f'header {len(header)}')
  rule = {'l': ':--', 'r': '--:', 'c': ':-:', '-': '---'}
  bad = sorted(set(align) - set(rule))
  if bad:
    raise ValueError(f'align {align!r} has {bad}; each character must be '
                     f'one of {", ".join(map(repr, rule))}')
  lines = ['| ' + ' | '.join(map(str, header)) + ' |',
           '|' + '|'.join(rule[a] for a in align) + '|']
  for row in rows:
    if len(row) != len(header):
      raise ValueError(f'row {list(row)!r} has {len(row)} cells, the '
                       f'header {len(header)}')
    lines.append('| ' + ' | '.join(map(str, row)) + ' |')
  return '\n'.join(lines)


def _check(data: Nested, where: str = 'data') -> int:
  """The depth of `data` (0: an array of items); ValueError naming the
  offending position if levels are ragged in depth or a level is empty."""
  if isinstance(data, np.ndarray) or (
      isinstance(data, Sequence) and data and
      not isinstance(data[0], (Sequence, np.ndarray))):
    items = np.asarray(data, np.float64)
    if items.ndim != 1 or items.size == 0:
      raise ValueError(f'{where}: a leaf must be a non-empty 1-D array of '
                       f'item scores, got shape {items.shape}')
    if not np.all(np.isfinite(items)):
      raise ValueError(f'{where}: item scores must be finite')
    return 0
  if not isinstance(data, Sequence) or not data:
    raise ValueError(f'{where}: a level must be a non-empty list, got '
                     f'{type(data).__name__} {data!r:.60}')
  depths = {_check(child, f'{where}[{i}]') for i, child in enumerate(data)}
  if len(depths) != 1:
    raise ValueError(f'{where}: children differ in depth {sorted(depths)}')
  return depths.pop() + 1


def nested_mean(data: Nested) -> float:
  """The mean over the top level of the means of each child, recursively."""
  _check(data)
  return float(_mean(data))


def _mean(data: Nested) -> float:
  if _is_leaf(data):
    return float(np.mean(np.asarray(data, np.float64)))
  return float(np.mean([_mean(c) for c in data]))


def _is_leaf(data: Nested) -> bool:
  return isinstance(data, np.ndarray) or not isinstance(
      data[0], (Sequence, np.ndarray))


def _leaves_as_arrays(data: Nested) -> Nested:
  if _is_leaf(data):
    return np.asarray(data, np.float64)
  return [_leaves_as_arrays(c) for c in data]


# A leaf's shape is its item count; a level's, the tuple of its children's.
Shape = int | tuple['Shape', ...]


def _shape(data: Nested) -> Shape:
  if isinstance(data, np.ndarray):
    return data.size
  return tuple(_shape(child) for child in data)


class _Draws(NamedTuple):
  """Which units one level's `n` replicates pick: a leaf's (n, size) item
  indices, or a level's (n, k) child picks with each child's own draws."""
  indices: np.ndarray
  children: tuple['_Draws', ...] = ()


def _draw(shape: Shape, n: int, rng: np.random.Generator) -> _Draws:
  if isinstance(shape, int):
    return _Draws(_frozen(rng.integers(0, shape, size=(n, shape)), shape))
  # Each replicate picks len(shape) children with replacement; a child's
  # replicate means are drawn independently for each time it is picked.
  k = len(shape)
  picks = _frozen(rng.integers(0, k, size=(n, k)), k)
  return _Draws(picks, tuple(_draw(child, int((picks == c).sum()), rng)
                             for c, child in enumerate(shape)))


def _frozen(indices: np.ndarray, high: int) -> np.ndarray:
  """`indices` (all below `high`) read-only, as int32 where they fit."""
  if high <= 2**31:
    indices = indices.astype(np.int32)  # Half the memory of a kept plan.
  indices.flags.writeable = False  # Shared by every later call (_plan).
  return indices


# The draws depend on the data's shape and the seed, not on its values: a
# report bootstraps many contrasts of one shape with the same seeds (common
# random numbers), and drawing the indices is most of a replicate's cost.
# 16 plans cover a report's targets x tasks; each holds about n x items
# indices, kept as int32 (the draws are the generator's int64s, narrowed:
# the same values), so only plans of up to CACHED_INDICES are kept (16 x
# 32 MiB at most). A study's report that draws plans just above 2**21
# drew every interval's indices afresh at that bound (16.3 s of CPU
# against 3.2 s at 2**23; docs/lab/benchmarks.md).
CACHED_INDICES = 1 << 23


def _units(shape: Shape) -> int:
  if isinstance(shape, int):
    return shape
  return len(shape) + sum(_units(child) for child in shape)


@functools.lru_cache(maxsize=16)
def _cached_plan(shape: Shape, n: int, seed: int) -> _Draws:
  return _draw(shape, n, np.random.default_rng(seed))


def _plan(shape: Shape, n: int, seed: int) -> _Draws:
  if n * _units(shape) > CACHED_INDICES:
    return _draw(shape, n, np.random.default_rng(seed))
  return _cached_plan(shape, n, seed)


def _resampled_means(data: Nested, draws: _Draws) -> np.ndarray:
  """The bootstrap replicates of the nested mean that `draws` picks:
  shape (n,)."""
  if isinstance(data, np.ndarray):
    return data[draws.indices].mean(axis=1)
  picks = draws.indices
  out = np.empty(picks.shape)
  # The draws of one child are i.i.d., so handing them to its picks in
  # any order gives the same joint distribution.
  for c, (child, child_draws) in enumerate(zip(data, draws.children)):
    out[picks == c] = _resampled_means(child, child_draws)
  return out.mean(axis=1)


def replicates(data: Nested, num_samples: int = 2000,
               seed: int = 0) -> np.ndarray:
  """`num_samples` hierarchical-bootstrap replicates of `nested_mean`."""
  _check(data)
  if num_samples < 1:
    raise ValueError(f'num_samples={num_samples}: must be >= 1')
  data = _leaves_as_arrays(data)
  return _resampled_means(data, _plan(_shape(data), num_samples, seed))


def interval(data: Nested, num_samples: int = 2000, seed: int = 0,
             level: float = 0.95) -> Interval:
  """The nested mean and its percentile bootstrap interval at `level`.

  Args:
    data: nested lists of 1-D item-score arrays (see the module docstring).
    num_samples: bootstrap replicates.
    seed: the resampling's seed (the interval is a pure function of it).
    level: coverage of the two-sided percentile interval, in (0, 1).

  Returns:
    Interval(mean, low, high).
  """
  if not 0 < level < 1:
    raise ValueError(f'level={level}: must be in (0, 1)')
  reps = replicates(data, num_samples, seed)
  tail = (1 - level) / 2
  low, high = np.quantile(reps, [tail, 1 - tail])
  return Interval(nested_mean(data), float(low), float(high))
