"""The RL study's tables and plot, from every run's results (`study.json`).

`table` is `study.md`: pass@1 per difficulty at the end, mean ± std over
seeds, samples/s and wall time; with GAS runs also each run's trained
difficulty mix, mean staleness per difficulty, and GAS's final alpha,
budgets and dropped / deferred batches. `plot` is `study.png`: mean
pass@1 against wall time and against trained samples, mean over seeds.
"""

import statistics

import numpy as np

from studies.rl_staleness import runs as runs_lib
from train.analysis import plots
from train.analysis import stats


def _percent(values: list[float]) -> str:
  return stats.mean_std(values, 100.0)


def table(study: runs_lib.Study, raw: dict[str, dict]) -> str:
  seeds = range(study.seeds)
  first = raw['sync|0']
  difficulties = sorted(first['pass_at_1'], key=int)
  head = (['run'] + [f'{d} digits' for d in difficulties]
          + ['mean', 'samples/s', 'x sync', 'wall s'])
  start = [statistics.mean(raw[f'sync|{s}']['initial_pass_at_1'][d]
                           for s in seeds) for d in difficulties]
  rows = [['warm start'] + [
      _percent([raw[f'sync|{s}']['initial_pass_at_1'][d] for s in seeds])
      for d in difficulties] + [f'{100 * statistics.mean(start):.1f}', '-',
                                '-', '-']]
  for label, *_ in runs_lib.runs(study):
    runs = [raw[f'{label}|{s}'] for s in seeds]
    ratio = [r['samples_per_second'] / raw[f'sync|{s}']['samples_per_second']
             for s, r in zip(seeds, runs)]
    rows.append([label] + [_percent([r['pass_at_1'][d] for r in runs])
                           for d in difficulties] + [
        _percent([r['mean_pass_at_1'] for r in runs]),
        stats.mean_std([r['samples_per_second'] for r in runs]),
        stats.mean_std(ratio),
        stats.mean_std([r['wall_seconds'] for r in runs])])
  lines = [stats.markdown_table(head, rows)]
  if study.gas:
    lines += ['', _schedule_table(study, raw, difficulties)]
  return '\n'.join(lines)


def _schedule_table(study: runs_lib.Study, raw: dict[str, dict],
                    difficulties: list[str]) -> str:
  """Per run, mean over seeds: the trained difficulty mix (%), the mean
  staleness per difficulty, batches dropped by admission, and GAS's final
  alpha, budgets and deferred dispatches."""
  seeds = range(study.seeds)
  head = (['run'] + [f'mix d{d} %' for d in difficulties]
          + [f'staleness d{d}' for d in difficulties]
          + ['dropped', 'deferred', 'alpha', 'budgets'])
  table_rows = []
  for label, *_ in runs_lib.runs(study):
    rows = [raw[f'{label}|{s}'] for s in seeds]
    cells = [label]
    for d in difficulties:
      share = [r['difficulty_mix'][d] / r['versions'] for r in rows]
      cells.append(f'{100 * statistics.mean(share):.0f}')
    for d in difficulties:
      means = []
      for r in rows:
        hist = r['staleness_by_difficulty'][d]
        n = sum(hist.values())
        if n:
          means.append(sum(int(i) * c for i, c in hist.items()) / n)
      cells.append(f'{statistics.mean(means):.2f}' if means else '-')
    cells.append(f'{statistics.mean(sum(r["dropped"].values()) for r in rows):.1f}')
    if 'gas' in rows[0]:
      gas = [r['gas'] for r in rows]
      cells.append(f'{statistics.mean(sum(g[f"deferred/d{d}"] for d in difficulties) for g in gas):.0f}')
      cells.append(stats.mean_std([g['alpha'] for g in gas]))
      cells.append('/'.join(
          f'{statistics.mean(g[f"budget/d{d}"] for g in gas):.1f}'
          for d in difficulties))
    else:
      cells += ['-', '-', '-']
    table_rows.append(cells)
  return stats.markdown_table(head, table_rows)


def plot(study: runs_lib.Study, raw: dict[str, dict], path: str) -> None:
  """pass@1 (mean over difficulties, then each difficulty) against wall
  time and trained samples, mean over seeds."""
  difficulties = sorted(raw['sync|0']['pass_at_1'], key=int)
  keys = ['eval/pass_at_1'] + [f'eval/pass_at_1_d{d}' for d in difficulties]
  titles = ['mean over difficulties'] + [f'{d} digits' for d in difficulties]
  fig, axes = plots.subplots(len(keys), 2, figsize=(11, 3.2 * len(keys)),
                             sharey='row')
  for label, *_ in runs_lib.runs(study):
    curves = [raw[f'{label}|{s}']['curve'] for s in range(study.seeds)]
    n = min(len(c) for c in curves)
    wall = np.mean([[p['wall'] for p in c[:n]] for c in curves], 0)
    versions = np.array([p['version'] for p in curves[0][:n]])
    samples = versions * (raw[f'{label}|0']['samples']
                          / raw[f'{label}|0']['versions'])
    style = 'k-' if label == 'sync' else '-'
    for row, key in enumerate(keys):
      mean = np.mean([[p[key] for p in c[:n]] for c in curves], 0)
      axes[row, 0].plot(wall, 100 * mean, style, label=label, marker='.')
      axes[row, 1].plot(samples, 100 * mean, style, label=label, marker='.')
  for row, title in enumerate(titles):
    axes[row, 0].set_ylabel(f'pass@1 %, {title}')
    for ax in axes[row]:
      ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel('wall time (s, mean over seeds)')
  axes[-1, 1].set_xlabel('trained samples')
  axes[0, 1].legend(fontsize=7)
  fig.suptitle(f'greedy pass@1 on held-out problems, mean of '
               f'{study.seeds} seeds')
  plots.save_png(fig, path)
