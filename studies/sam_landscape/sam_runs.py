r"""SAM's hallucinated minimizers on a 2-D landscape, the detector, and the warm-start.

  python -m launch.sam_landscape --workdir=workdirs/sam_landscape

Runs `geom.sam.sam` (with its detector) on `geom.landscapes.valley_with_bump`
from (0, 1) for every rho in a grid and every warm-start length, and writes
to the workdir: `landscape_table.md` (one row per rho and warm-start:
where SAM ends, f - f_min, |grad f(x)|, |grad f(x+)|, how many steps the
detector flagged, the outcome), `landscape.json`, and `landscape.png`
(contours, trajectories, the flagged points and their x+).

Outcomes: `hallucinated` (converged, |grad f| >= 1, |grad f(x+)| <= 1e-4),
`valley` (f - f_min < 2e-2; SAM with a constant rho keeps circling the
minimum, so it need not converge there), else `other`.
"""

import json
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from geom import landscapes
from geom import sam
from train import stats

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/sam_landscape',
                               'Where the table, JSON and PNG go.')
_RHOS = flags.DEFINE_list('rhos', ['0', '0.2', '0.4', '0.6', '0.8', '1.0',
                                   '1.2', '1.4'], 'SAM radii.')
_WARMUPS = flags.DEFINE_list('warmups', ['0', '10', '20', '50', '100'],
                             'Warm-start lengths (plain steps before SAM).')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Steps per run.')
_LR = flags.DEFINE_float('lr', 0.01, 'Learning rate of the base SGD.')

f = landscapes.valley_with_bump
grad_f = jax.grad(f)
# Thresholds that define the outcomes (see the module docstring).
MOVE_TOL, GRAD_HALLUCINATED, PERTURBED_TOL, VALLEY_TOL = 1e-4, 1.0, 1e-4, 2e-2


def simulate(rho, warmup_steps, *, steps: int = 2000, lr: float = 0.01,
             response: str = 'flag', restart_steps: int = 100,
             start=landscapes.START, keep_path: bool = False) -> dict:
  """Runs SAM with the detector; jit- and vmap-friendly in rho and warm-up."""
  tx = sam.sam(optax.sgd(lr), rho=rho, warmup_steps=warmup_steps,
               response=response, restart_steps=restart_steps)
  x0 = jnp.asarray(start, jnp.float32)

  def body(carry, _):
    x, state = carry
    updates, state = tx.update(grad_f(x), state, x, grad_fn=grad_f)
    x = optax.apply_updates(x, updates)
    return (x, state), (x, state.detector.flagged)

  (x, state), (path, flagged) = jax.lax.scan(body, (x0, tx.init(x0)), None,
                                             length=steps)
  g = grad_f(x)
  x_plus = x + rho * g / (jnp.linalg.norm(g) + 1e-12)
  diag = sam.diagnostics(state)
  out = dict(
      x=x, f_gap=f(x) - landscapes.MIN_VALUE, grad_norm=jnp.linalg.norm(g),
      x_plus=x_plus, perturbed_grad_norm=jnp.linalg.norm(grad_f(x_plus)),
      moved=jnp.linalg.norm(x - path[-101]),
      flagged_steps=diag['hallucination_steps'],
      first_flag=jnp.where(flagged.any(), jnp.argmax(flagged), -1))
  if keep_path:
    out.update(path=path, flagged=flagged)
  return out


def outcome(r: dict) -> str:
  if (r['moved'] < MOVE_TOL and r['grad_norm'] >= GRAD_HALLUCINATED
      and r['perturbed_grad_norm'] <= PERTURBED_TOL):
    return 'hallucinated'
  if r['f_gap'] < VALLEY_TOL:
    return 'valley'
  return 'other'


def sweep(rhos, warmups, *, steps, lr, response='flag'):
  """{(rho, warmup): result as floats} over the grid (vmapped over rho)."""
  run = jax.jit(jax.vmap(
      lambda rho, w: simulate(rho, w, steps=steps, lr=lr, response=response),
      in_axes=(0, None)))
  rho_arr = jnp.asarray(rhos, jnp.float32)
  results = {}
  for w in warmups:
    out = jax.device_get(run(rho_arr, jnp.int32(w)))
    for i, rho in enumerate(rhos):
      r = {k: np.asarray(v[i]).tolist() for k, v in out.items()}
      r['outcome'] = outcome(r)
      results[(float(rho), int(w))] = r
  return results


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


def plot(results, path, *, steps, lr, rho=0.8, warm=50):
  from train import plots  # pylint: disable=g-import-not-at-top
  plt = plots.pyplot()
  X, Y, Z = landscapes.grid()
  fig, ax = plt.subplots(figsize=(7.5, 6.5))
  ax.contour(X, Y, Z, levels=np.linspace(0, 4, 33), cmap='viridis',
             linewidths=0.7)
  runs = [(0.0, 0, 'grey', 'gradient descent (rho = 0)'),
          (rho, 0, 'tab:red', f'SAM rho = {rho}: stalls (hallucinated)'),
          (rho, warm, 'tab:orange',
           f'SAM rho = {rho} after {warm} plain steps')]
  for r, w, color, label in runs:
    out = jax.device_get(simulate(r, w, steps=steps, lr=lr, keep_path=True))
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
  plt.close(fig)


def main(argv):
  del argv
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  rhos = [float(r) for r in _RHOS.value]
  warmups = [int(w) for w in _WARMUPS.value]
  kw = dict(steps=_STEPS.value, lr=_LR.value)
  results = sweep(rhos, warmups, **kw)
  restart = sweep(rhos, [0], response='warm_restart', **kw)
  text = table(results, restart)
  with open(os.path.join(workdir, 'landscape_table.md'), 'w') as fp:
    fp.write(text)
  with open(os.path.join(workdir, 'landscape.json'), 'w') as fp:
    json.dump({f'rho={r},warmup={w}': v for (r, w), v in results.items()}, fp,
              indent=1)
  plot(results, os.path.join(workdir, 'landscape.png'), **kw)
  print(text)
  print(f'wrote {workdir}/landscape_table.md, landscape.json, landscape.png')


if __name__ == '__main__':
  app.run(main)
