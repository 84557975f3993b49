"""The steering study's report: its tables (markdown), its JSON and its band plot.

Built from the evaluations of several LMs (`studies.steering.intervals`
holds the statistics): accuracy at matched KL with 95% intervals per task
and method, each method's gain over the unsteered model and paired
differences between methods (items paired), the gate x geometry
ablation, the gate's trigger rate against accuracy (one evaluation per
gate threshold beta), and the generations' measures at matched KL.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from train.analysis import stats
from train.steering import pareto
from studies.steering import intervals

GENERATION_MEASURES = (('positive_share', 'positive share', 100.0, 1),
                       ('gen_ce', 'CE of the generations (unsteered model)',
                        1.0, 3),
                       ('distinct_2', 'distinct-2', 100.0, 1),
                       ('repetition_3', '3-gram repetition', 100.0, 1))


def _dicts(cells: Sequence[intervals.Cell]) -> list[dict[str, Any]]:
  return [c._asdict() for c in cells]


def build(runs: Sequence[intervals.Results],
          beta_runs: dict[float, Sequence[intervals.Results]] | None = None,
          targets: Sequence[float] = intervals.TARGET_KLS,
          num_samples: int = 2000) -> dict[str, Any]:
  """Every table's figures, JSON-ready (cells as dicts)."""
  methods = [m for m in intervals.methods_of(runs[0]) if m != 'none']
  intervals.check_runs(runs, methods)
  meta = runs[0]['meta']
  tasks = list(meta['tasks'])
  out: dict[str, Any] = {
      'targets': list(targets), 'lms': len(runs),
      'item_sets': list(meta['mc_seeds']), 'items': dict(meta['tasks']),
      'methods': methods, 'accuracy': {}, 'unsteered': {}, 'gain': {},
      'paired': {},
      'ablation': {}, 'gate': [], 'generation': {},
      'kl_max': {m: [max(r['kl'] for r in run['rows'] if r['method'] == m)
                     for run in runs] for m in methods}}
  for task in tasks:
    out['accuracy'][task] = {
        m: _dicts(intervals.matched(runs, m, task, targets,
                                    num_samples=num_samples)) for m in methods}
    out['unsteered'][task] = _dicts(intervals.matched(
        runs, 'none', task, targets[:1], num_samples=num_samples))[0]
    # Does steering move the task at all? Each method against the unsteered
    # model on the same items (the unsteered model's interval alone is too
    # wide to tell a small gain from none).
    out['gain'][task] = {
        m: _dicts(intervals.paired(runs, m, 'none', task, targets,
                                   num_samples=num_samples)) for m in methods}
    out['paired'][task] = {
        f'{a} - {b}': _dicts(intervals.paired(runs, a, b, task, targets,
                                              num_samples=num_samples))
        for a, b in intervals.PAIRS if a in methods and b in methods}
    if all(m in methods for m in intervals.ABLATION.values()):
      out['ablation'][task] = {
          k: _dicts(v) for k, v in intervals.ablation(
              runs, task, targets, num_samples=num_samples).items()}
  gated = {float(meta['beta']): runs} if 'spherical_gate' in methods else {}
  gated.update({float(b): r for b, r in (beta_runs or {}).items()})
  for beta in sorted(gated):
    rs = gated[beta]
    intervals.check_runs(rs, ('spherical_gate',))
    rates = np.array([[np.mean([r['trigger_rate'] for r in run['rows']
                                if r['method'] == 'spherical_gate'])]
                      for run in rs])
    out['gate'].append({
        'beta': beta,
        'trigger_rate': _dicts(intervals.over_lms(rates, num_samples))[0],
        'accuracy': {t: _dicts(intervals.matched(
            rs, 'spherical_gate', t, targets, num_samples=num_samples))
                     for t in tasks}})
  # A run with generation off (a choices-only ablation) has no such rows.
  measured = [key for key, *_ in GENERATION_MEASURES
              if all(key in row for r in runs for row in r['rows'])]
  for m in ['none'] + methods if measured else ():
    out['generation'][m] = {
        key: _dicts(intervals.over_lms(
            intervals.scalar_at_kl(runs, m, key, targets), num_samples))
        for key in measured}
  return out


def _fmt(cell: dict[str, Any], scale: float = 100.0, digits: int = 1,
         missing: str = 'not reached') -> str:
  return intervals.Cell(**cell).format(scale, digits, missing)


def markdown(summary: dict[str, Any]) -> str:
  """The study's tables: mean [95% interval]; accuracies in %."""
  targets = summary['targets']
  kl_head = [f'KL {t:g}' for t in targets]

  def table(first: str, cells_by_name: dict[str, list[dict[str, Any]]],
            suffix: str = '', fmt: tuple[Any, ...] = ()) -> str:
    """One row per name: its cells at each target KL, `_fmt(cell, *fmt)`."""
    return stats.markdown_table(
        [first, *kl_head],
        [[f'{name}{suffix}', *(_fmt(c, *fmt) for c in cells)]
         for name, cells in cells_by_name.items()],
        '-' * (len(targets) + 1))

  lines = [f'{summary["lms"]} LMs x {len(summary["item_sets"])} item sets '
           f'(seeds {", ".join(map(str, summary["item_sets"]))}; items per '
           f'set: {", ".join(f"{t} {n}" for t, n in summary["items"].items())}'
           '). Mean [95% hierarchical bootstrap interval over LMs, item sets '
           'and items]; accuracy (mean log-prob) in %.', '']
  for task, accuracy in summary['accuracy'].items():
    base = summary['unsteered'][task]
    lines += [f'**{task}: accuracy at matched KL** (unsteered: '
              f'{_fmt(base)})', '', table('method', accuracy)]
    lines += ['', f'**{task}: gain over the unsteered model (points, items '
              'paired)**', '', table('method', summary['gain'][task],
                                     ' - none')]
    lines += ['', f'**{task}: paired differences (points)**', '',
              table('difference', summary['paired'][task])]
    if task in summary['ablation']:
      lines += ['', f'**{task}: gate x geometry (points)**: gate = mean over '
                'geometry of gated - ungated; rotation = mean over gate of '
                'rotation - addition; interaction = gate\'s effect on the '
                'rotation - on addition', '',
                table('effect', summary['ablation'][task])]
    lines.append('')
  if summary['gate']:
    head = ['beta', 'trigger rate', *(f'{task} KL {t:g}'
                                      for task in summary['accuracy']
                                      for t in targets)]
    lines += ['**The gate: trigger rate (held-out tokens) against accuracy '
              '(spherical_gate)**', '', stats.markdown_table(
                  head, [[f'{g["beta"]:g}', _fmt(g['trigger_rate'], 100.0),
                          *(_fmt(c) for task in summary['accuracy']
                            for c in g['accuracy'][task])]
                         for g in summary['gate']], '-' * len(head))]
    lines.append('')
  for key, title, scale, digits in GENERATION_MEASURES:
    if not summary['generation'] or key not in summary['generation']['none']:
      continue
    unit = ' (%)' if scale == 100.0 else ''
    lines += [f'**Generations: {title}{unit} at matched KL** (interval over '
              'LMs only; n/a: beyond some LM\'s sweep, or no sentiment word '
              'to count)', '',
              table('method', {m: g[key] for m, g
                               in summary['generation'].items()},
                    fmt=(scale, digits, 'n/a'))]
    lines.append('')
  lines += ['Largest KL each LM\'s sweep reached: ' + '; '.join(
      f'{m} {", ".join(f"{k:.2f}" for k in v)}'
      for m, v in summary['kl_max'].items()), '']
  return '\n'.join(lines)


def plot(runs: Sequence[intervals.Results], out_path: str,
         grid: Sequence[float] | None = None,
         num_samples: int = 500) -> None:
  """pareto_bands.png: accuracy at matched KL over a log grid, with bands."""
  methods = [m for m in intervals.methods_of(runs[0]) if m != 'none']
  tasks = list(runs[0]['meta']['tasks'])
  if grid is None:
    top = min(1.0, max(r['kl'] for run in runs for r in run['rows']))
    grid = np.geomspace(min(0.005, top), top, 24)
  panels, unsteered = {}, {}
  for task in tasks:
    curves = {}
    for m in methods:
      cells = intervals.matched(runs, m, task, grid, num_samples=num_samples)
      curves[m] = (np.asarray(grid), *(np.array([getattr(c, f) for c in cells])
                                       for f in ('mean', 'low', 'high')))
    panels[task] = curves
    base = intervals.matched(runs, 'none', task, grid[:1],
                             num_samples=num_samples)[0]
    unsteered[task] = (base.mean, base.low, base.high)
  pareto.plot_bands(panels, out_path, unsteered)
