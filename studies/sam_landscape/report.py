"""The landscape study's table and plot, and its results as JSON.

`table(results, restart)` is the README's table; `load(path)` reads the
results that `python -m studies.sam_landscape` stored (`results/landscape.json`
holds the README's run), so the table rebuilds without running SAM again.
The plot reruns three trajectories (`sam_runs.simulate`): the stored
results hold end points, not paths.
"""

import json
import re

import jax
import numpy as np

from geom import landscapes
from studies.sam_landscape import sam_runs
from train.analysis import stats

_KEY = re.compile(r'rho=([^,]+),warmup=(\d+)')


def table(results, restart) -> str:
  head = ['rho', 'warm-start', 'end point', 'f - f_min',
          '\\|grad f(x)\\|', '\\|grad f(x+)\\|', 'flagged steps (first)',
          'outcome']
  rows = []
  for (rho, w), r in sorted(results.items()):
    first = f' ({r["first_flag"]})' if r['first_flag'] >= 0 else ''
    rows.append([
        f'{rho:g}', w, f'({r["x"][0]:+.3f}, {r["x"][1]:+.3f})',
        f'{r["f_gap"]:.2e}', f'{r["grad_norm"]:.3g}',
        f'{r["perturbed_grad_norm"]:.1e}',
        f'{int(r["flagged_steps"])}{first}', r['outcome']])
  restart_head = ['rho', 'end point', 'f - f_min', 'flagged steps', 'outcome']
  restart_rows = [[f'{rho:g}', f'({r["x"][0]:+.3f}, {r["x"][1]:+.3f})',
                   f'{r["f_gap"]:.2e}', int(r['flagged_steps']), r['outcome']]
                  for (rho, _), r in sorted(restart.items())]
  lines = [stats.markdown_table(head, rows, '-' * len(head)),
           '', "With response='warm_restart' (100 plain steps after a flag), "
           'no warm-start:', '',
           stats.markdown_table(restart_head, restart_rows,
                                '-' * len(restart_head))]
  return '\n'.join(lines) + '\n'


def dump(results, restart, path: str) -> None:
  """Both grids as JSON, keyed 'rho=R,warmup=W' under each response."""
  def keyed(grid):
    return {f'rho={r},warmup={w}': v for (r, w), v in grid.items()}
  with open(path, 'w') as fp:
    json.dump({'flag': keyed(results), 'warm_restart': keyed(restart)}, fp,
              indent=1)


def load(path: str):
  """(results, restart) as `sam_runs.sweep` returned them, from `dump`."""
  with open(path) as fp:
    stored = json.load(fp)

  def grid(keyed):
    out = {}
    for key, value in keyed.items():
      rho, warmup = _KEY.fullmatch(key).groups()
      out[(float(rho), int(warmup))] = value
    return out
  return grid(stored['flag']), grid(stored['warm_restart'])


def plot(results, path, *, steps, lr, rho=0.8, warm=50):
  from train.analysis import plots  # pylint: disable=g-import-not-at-top
  X, Y, Z = landscapes.grid()
  fig, ax = plots.subplots(figsize=(7.5, 6.5))
  ax.contour(X, Y, Z, levels=np.linspace(0, 4, 33), cmap='viridis',
             linewidths=0.7)
  runs = [(0.0, 0, 'grey', 'gradient descent (rho = 0)'),
          (rho, 0, 'tab:red', f'SAM rho = {rho}: stalls (hallucinated)'),
          (rho, warm, 'tab:orange',
           f'SAM rho = {rho} after {warm} plain steps')]
  for r, w, color, label in runs:
    out = jax.device_get(sam_runs.simulate(r, w, steps=steps, lr=lr,
                                           keep_path=True))
    p = np.asarray(out['path'])
    ax.plot(p[:, 0], p[:, 1], color=color, lw=1.5, label=label,
            ls='--' if w else '-')
    flagged = np.asarray(out['flagged'])
    if flagged.any():
      ax.plot(p[flagged, 0], p[flagged, 1], 'x', color=color, ms=7,
              label='steps the detector flagged')
  for (r, w), res in results.items():
    if w == 0 and res['outcome'] == 'hallucinated':
      x, xp = res['x'], res['x_plus']
      ax.plot([x[0], xp[0]], [x[1], xp[1]], ':', color='tab:red', lw=0.8)
      ax.plot(*x, 'o', color='tab:red', ms=4)
  for c in landscapes.CRITICAL_POINTS:
    ax.plot(c.x, c.y, {'minimum': 'k*', 'maximum': 'k^',
                       'saddle': 'ks'}[c.kind], ms=9, label=c.kind)
  ax.plot(*landscapes.START, 'ko', mfc='none', ms=8, label='start')
  ax.set_title('SAM on a valley with a bump: hallucinated minimizers\n'
               '(dots: stall points for every rho that stalls; dotted: '
               'x -> x+)')
  ax.set_xlabel('x')
  ax.set_ylabel('y')
  ax.legend(loc='lower right', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
