"""The curvature study's markdown report, from `measure`'s results.

`table(results)` is `results/rl_curvature.md`, and the JSON beside it
keeps the same text under 'table': the report rebuilds from the stored
numbers alone.
"""

import os
from typing import Any

from train.analysis import stats


def table(results: dict[str, Any]) -> str:
  """The markdown report of `measure`'s results."""
  st = results['settings']
  check = st['check_iters']
  head = ['warm start', 'd', 'reward', 'NLL',
          f'lambda_max (power, {st["num_iters"]})', 'rayleigh proxy']
  if check:
    head += [f'signed, {check} products', 'rel. diff']
  rows = []
  for run in results['runs']:
    name = os.path.basename(os.path.normpath(run['sft_workdir']))
    for r in run['rows']:
      cells = [name, str(r['difficulty']), f'{r["reward"]:.2f}',
               f'{r["nll"]:.3f}', f'{r["power"]:.4g}', f'{r["rayleigh"]:.4g}']
      if check:
        cells += [f'{r["check_signed"]:.4g}', f'{r["check_rel_diff"]:.1e}']
      rows.append(cells)
  lines = [stats.markdown_table(head, rows, '-' * len(head))]
  fit_head = ['warm start', 'alpha (power)', 'alpha (rayleigh)',
              *(['alpha (check)'] if check else []),
              'Spearman(power, rayleigh) over d']
  fits = []
  for run in results['runs']:
    name = os.path.basename(os.path.normpath(run['sft_workdir']))
    cells = [name, f'{run["alpha_power"]:.3f}', f'{run["alpha_rayleigh"]:.3f}']
    if check:
      cells.append(f'{run["alpha_check"]:.3f}')
    cells.append(f'{run["spearman"]:.2f}')
    fits.append(cells)
  lines += ['', stats.markdown_table(fit_head, fits, '-' * len(fit_head))]
  sec = results['seconds_per_estimate']
  lines += ['', f'Seconds per estimate (mean, compiled, {st["backend"]}): '
            f'power {sec["power"]:.3f} s, rayleigh {sec["rayleigh"]:.3f} s '
            f'({sec["power"] / max(sec["rayleigh"], 1e-12):.1f}x). '
            f'{st["prompts"]} prompts x {st["samples"]} samples per '
            f'difficulty, family {st["family"]!r}, temperature 1.0, seed '
            f'{st["seed"]}.']
  return '\n'.join(lines) + '\n'
