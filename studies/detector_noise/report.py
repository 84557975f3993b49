"""The detector-noise table: detection and false-alarm rates, from the runs.

`summarize` pools `noisy_runs.study`'s rows over rho and seeds, `table`
writes the README's table from that; `dump` and `load` store and read
the rows as JSON (`results/detector_noise.json` holds the README's run),
so the table rebuilds without running SAM again.
"""

import json

import numpy as np

from studies.detector_noise.noisy_runs import DETECTORS
from studies.detector_noise.noisy_runs import KINDS
from train.analysis import stats


def summarize(rows) -> dict:
  """Per detector, kind and level, pooled over rho and seeds."""
  summary = {}
  for (name, kind, level, _), r in rows.items():
    s = summary.setdefault((name, kind, level),
                           dict(flagged=0, runs=0, total=0, ratios=[]))
    for flagged, near, ratio in zip(r['flagged'], r['near_stall'],
                                    r['ratio_ema']):
      s['total'] += 1
      if kind in ('stall', 'scaled') and not near:
        continue  # Knocked out of the stall by the noise: not a stall.
      s['runs'] += 1
      s['flagged'] += int(flagged)
      s['ratios'].append(ratio)
  return summary


def table(summary, levels) -> str:
  head = ['noise (per coordinate, x stall \\|grad f\\|)', 'detector',
          'runs that stalled', 'stalls flagged', 'loss x 1e-4 stalls flagged',
          'warm-start runs flagged (false)', 'convex runs flagged (false)',
          'ratio EMA at end, stalls (median [5%, 95%])',
          'ratio EMA, convergent runs (5% quantile)']
  rows = []

  def rate(s):
    return f'{s["flagged"]}/{s["runs"]}' if s['runs'] else '-'

  def quantiles(values, qs):
    return [float(np.quantile(values, q)) for q in qs] if values else []

  for level in levels:
    for name in DETECTORS:
      s = {k: summary[(name, k, level)] for k in KINDS}
      stall_q = quantiles(s['stall']['ratios'], (0.5, 0.05, 0.95))
      convergent = s['warm']['ratios'] + s['quadratic']['ratios']
      conv_q = quantiles(convergent, (0.05,))
      rows.append([
          f'{level:g}', name, f'{s["stall"]["runs"]}/{s["stall"]["total"]}',
          rate(s['stall']), rate(s['scaled']), rate(s['warm']),
          rate(s['quadratic']),
          (f'{stall_q[0]:.3f} [{stall_q[1]:.3f}, {stall_q[2]:.3f}]'
           if stall_q else '-'),
          f'{conv_q[0]:.3f}' if conv_q else '-'])
  return stats.markdown_table(head, rows, '-' * len(head)) + '\n'


def dump(rows, path: str) -> None:
  """The rows as JSON, keyed 'detector/kind/level/rho'."""
  with open(path, 'w') as fp:
    json.dump({'/'.join(map(str, k)): v for k, v in rows.items()}, fp)


def load(path: str):
  """(rows, levels in the order run) from `dump`'s JSON."""
  with open(path) as fp:
    stored = json.load(fp)
  rows, levels = {}, []
  for key, value in stored.items():
    name, kind, level, rho = key.split('/')
    rows[(name, kind, float(level), float(rho))] = value
    if float(level) not in levels:
      levels.append(float(level))
  return rows, levels
