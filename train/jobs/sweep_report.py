"""A sweep's final metrics as tables and a plot: mean +- std over seeds.

`launch.report` (its command line) calls `write_report`. Reads each sweep
root's `sweep.json` (written by `launch.sweep`) and each run's
`final_metrics.json` (`results.json` for RL runs, as the manifest says); a
directory without `sweep.json` counts as one run. Runs are grouped by their
overrides other than `seed`; every numeric final metric gets mean and
standard deviation (ddof 1) over a group's seeds. Unfinished runs are
listed, not averaged.
"""

import csv
import io
import json
import math
import os
import statistics

from train import fileio
from train.analysis import plots
from train.analysis import stats
from train.errors import UsageError

SEED_KEY = 'seed'


def collect(dirs: list[str]) -> tuple[list[dict], list[str]]:
  """Finished runs as {'name', 'overrides', 'metrics'}, and unfinished names."""
  runs, unfinished = [], []
  for d in dirs:
    manifest = os.path.join(d, 'sweep.json')
    if os.path.exists(manifest):
      with open(manifest) as f:
        entries = json.load(f)['runs']
    else:
      entries = [{'name': os.path.basename(os.path.abspath(d)),
                  'overrides': {}, 'workdir': d}]
    for e in entries:
      path = os.path.join(e['workdir'],
                          e.get('results', 'final_metrics.json'))
      if not os.path.exists(path):
        unfinished.append(e['name'])
        continue
      try:
        with open(path) as f:
          saved = json.load(f)
      except ValueError:  # Torn by hand or by a disk: the run must redo it.
        unfinished.append(e['name'])
        continue
      # null is a non-finite value (a diverged run): it counts, as NaN.
      metrics = {k: math.nan if v is None else v for k, v in saved.items()
                 if (v is None or isinstance(v, (int, float)))
                 and k != 'step'}
      runs.append({'name': e['name'], 'overrides': e['overrides'],
                   'metrics': metrics})
  return runs, unfinished


def swept_keys(runs: list[dict]) -> list[str]:
  """Override keys whose value differs between runs (seed excluded), in order."""
  keys = list(dict.fromkeys(k for r in runs for k in r['overrides']))
  return [k for k in keys if k != SEED_KEY and len(
      {json.dumps(r['overrides'].get(k)) for r in runs}) > 1]


def aggregate(runs: list[dict]) -> tuple[list[str], list[dict]]:
  """Groups by swept values: {'setting': {key: value}, 'n', 'mean', 'std'}."""
  keys = swept_keys(runs)
  groups: dict[str, dict] = {}
  for r in runs:
    setting = {k: r['overrides'].get(k) for k in keys}
    g = groups.setdefault(json.dumps(setting), {'setting': setting,
                                                'values': {}})
    for m, v in r['metrics'].items():
      g['values'].setdefault(m, []).append(float(v))
  out = []
  for g in groups.values():
    n = max(len(v) for v in g['values'].values())
    out.append({
        'setting': g['setting'], 'n': n,
        'mean': {m: statistics.fmean(v) for m, v in g['values'].items()},
        'std': {m: statistics.stdev(v) if len(v) > 1 else 0.0
                for m, v in g['values'].items()}})
  return keys, out


def markdown(keys: list[str], groups: list[dict], metrics: list[str]) -> str:
  head = [*keys, 'seeds', *(f'{m} (mean +- std)' for m in metrics)]
  rows = []
  for g in groups:
    cells = [json.dumps(g['setting'][k]) if isinstance(
        g['setting'][k], str) else str(g['setting'][k]) for k in keys]
    cells.append(str(g['n']))
    cells += [f'{g["mean"][m]:.4f} +- {g["std"][m]:.4f}'
              if m in g['mean'] else '-' for m in metrics]
    rows.append(cells)
  return stats.markdown_table(head, rows, '-' * len(head)) + '\n'


def csv_text(keys: list[str], groups: list[dict], metrics: list[str]) -> str:
  buffer = io.StringIO()
  writer = csv.writer(buffer)
  writer.writerow([*keys, 'seeds', *(f'{m}_{s}' for m in metrics
                                     for s in ('mean', 'std'))])
  for g in groups:
    writer.writerow([g['setting'][k] for k in keys] + [g['n']] + [
        g[s].get(m, math.nan) for m in metrics for s in ('mean', 'std')])
  return buffer.getvalue()


def write_report(dirs: list[str], metric: str, out: str) -> dict:
  """Writes report.md/.csv/.png into `out`; returns what it found."""
  runs, unfinished = collect(dirs)
  if not runs:
    raise UsageError('WORKDIR', dirs, 'holds no finished run '
                     '(final_metrics.json)')
  metrics = sorted({m for r in runs for m in r['metrics']})
  if metric not in metrics:
    raise UsageError('--metric', metric, 'not among the final metrics',
                     metrics)
  keys, groups = aggregate(runs)
  text = markdown(keys, groups, metrics)
  if unfinished:
    text += f'\nUnfinished (not included): {", ".join(unfinished)}\n'
  os.makedirs(out, exist_ok=True)
  fileio.write_text_atomic(os.path.join(out, 'report.md'), text)
  fileio.write_text_atomic(os.path.join(out, 'report.csv'),
                           csv_text(keys, groups, metrics))
  plots.plot_sweep(groups, keys, metric, os.path.join(out, 'report.png'))
  return {'keys': keys, 'groups': groups, 'unfinished': unfinished,
          'table': text}
