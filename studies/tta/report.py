"""The TTA study's tables and its rates plot, from the grids' raw errors.

Every function takes the `studies.tta.grids.Study` that measured `raw`
and the raw errors themselves (`<study>.json`), so a stored study's
tables rebuild without running anything.
"""

import statistics

from studies.tta import grids
from train.analysis import plots
from train.analysis import stats


def table(study: grids.Study, raw: dict[str, float]) -> str:
  seeds = range(study.seeds)
  severities = study.severities
  averaged = [p for p in study.protocols if p in study.mean_protocols]
  head = ['method'] + [f'{p} sev 5' for p in study.protocols] + [
      f'{p} sev {severities[0]}-{severities[-1]}' for p in averaged]
  rows = []
  for label, _, _ in grids.TABLE_ROWS:
    cells = [label]
    for protocol in study.protocols:
      cells.append(stats.mean_std([raw[f'{label}|{protocol}|5|{s}']
                                   for s in seeds]))
    for protocol in averaged:
      cells.append(stats.mean_std([
          statistics.mean(raw[f'{label}|{protocol}|{v}|{s}']
                          for v in severities) for s in seeds]))
    rows.append(cells)
  return stats.markdown_table(head, rows)


def _rates_summary(study: grids.Study, raw: dict[str, float]) -> dict:
  """Per `method|schedule`: the mean error at each rate, and per seed the
  spread over the grid (worst minus best) and the best."""
  seeds, grid = range(study.seeds), study.rates
  summary = {}
  for method in study.methods:
    for schedule in ('fixed', 'conga'):
      at = lambda r, s: raw[f'{method}|{schedule}|{r:g}|{s}']  # pylint: disable=cell-var-from-loop
      summary[f'{method}|{schedule}'] = {
          'means': [statistics.mean(at(r, s) for s in seeds) for r in grid],
          'cells': [stats.mean_std([at(r, s) for s in seeds]) for r in grid],
          # The spread per seed, then its mean and deviation over seeds.
          'spreads': [max(at(r, s) for r in grid) - min(at(r, s) for r in grid)
                      for s in seeds],
          'bests': [min(at(r, s) for r in grid) for s in seeds]}
  return summary


def rates(study: grids.Study, raw: dict[str, float]) -> str:
  head = ['method', 'schedule'] + [f'{r:g}' for r in study.rates] + [
      'best', 'worst - best']
  summary = _rates_summary(study, raw)
  rows = []
  for method in study.methods:
    for schedule in ('fixed', 'conga'):
      one = summary[f'{method}|{schedule}']
      rows.append([method, schedule, *one['cells'],
                   stats.mean_std(one['bests']),
                   stats.mean_std(one['spreads'])])
  return stats.markdown_table(head, rows, 'll' + 'r' * (len(head) - 2))


def norm(study: grids.Study, raw: dict[str, float]) -> str:
  seeds, sizes = range(study.seeds), study.norm_batch_sizes
  head = ['norm', 'method'] + [f'batch {b}, {o}' for o in grids.ORDERS
                               for b in sizes]
  rows = []
  for norm_name in study.norms:
    for method in ['source'] + list(study.norm_methods):
      if f'{norm_name}|{method}|{sizes[0]}|shuffled|0' not in raw:
        continue
      rows.append([norm_name, method] + [
          stats.mean_std([raw[f'{norm_name}|{method}|{b}|{o}|{s}']
                          for s in seeds])
          for o in grids.ORDERS for b in sizes])
  return stats.markdown_table(head, rows, 'll' + 'r' * (len(head) - 2))


def plot_rates(study: grids.Study, raw: dict[str, float], path: str) -> None:
  """Mean error against the base rate, fixed vs CONGA, one panel per
  method (README: results/tta_rates.png)."""
  summary = _rates_summary(study, raw)
  names = study.methods
  fig, axes = plots.subplots(1, len(names),
                             figsize=(4.5 * len(names), 3.8), sharey=True)
  axes_list = list(axes) if len(names) > 1 else [axes]
  for ax, method in zip(axes_list, names):
    for schedule, style in (('fixed', 'o-'), ('conga', 's-')):
      ax.plot(study.rates, summary[f'{method}|{schedule}']['means'], style,
              label=schedule)
    ax.set_xscale('log')
    ax.set_xlabel('base learning rate')
    ax.set_title(f'{method}, {study.protocol}, severity 5')
    ax.grid(alpha=0.3)
    ax.legend()
  axes_list[0].set_ylabel(f'error % (mean of {study.seeds} seeds)')
  plots.save_png(fig, path)

