"""SAM with its detector on the 2-D landscape: one run, the grid, the outcome.

The runs behind `python -m studies.sam_landscape`, importable without its
flags. `simulate` runs `geom.sam.sam` (with its detector) on
`geom.landscapes.valley_with_bump`; `sweep` runs it for every rho and
warm-start length of a grid; `outcome` names what a run did:
`hallucinated` (converged, |grad f| >= 1, |grad f(x+)| <= 1e-4), `valley`
(f - f_min < 2e-2; SAM with a constant rho keeps circling the minimum, so
it need not converge there), else `other`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from geom import landscapes
from geom import sam

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
