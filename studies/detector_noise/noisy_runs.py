"""SAM with its detector on the 2-D landscape under minibatch-like noise.

The runs behind `python -m studies.detector_noise` (whose docstring
describes the noise model and the four kinds of run), importable without
its flags: `run(kind, rho, sigma, key, detector, steps)` is jit- and
vmap-friendly, `noiseless_stalls(rhos, steps)` gives each rho's stall
point and its |grad f|, `PREVIOUS` is the detector's earlier default
configuration (the one its thresholds were changed from; README.md
compares them), and `study` runs every detector, kind, noise level, rho
and seed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from geom import hallucination
from geom import landscapes
from geom import sam

__all__ = ['DETECTORS', 'KINDS', 'PREVIOUS', 'STALL_RADIUS',
           'noiseless_stalls', 'run', 'study']

LR = 0.01
WARM_STEPS = 100
STALL_RADIUS = 0.15
SCALE = 1e-4
QUADRATIC = (4.0, 1.0)  # The convex run's diagonal Hessian.
PREVIOUS = hallucination.DetectorConfig(
    ratio_threshold=0.1, min_grad_fraction=0.0, min_grad_norm=1e-3)
KINDS = ('stall', 'warm', 'quadratic', 'scaled')
DETECTORS = {'default': hallucination.DetectorConfig(), 'previous': PREVIOUS}


def _quadratic(x):
  return 0.5 * jnp.sum(jnp.asarray(QUADRATIC) * x ** 2)


def run(kind: str, rho: float, sigma: float, key: jax.Array,
        detector: hallucination.DetectorConfig, steps: int) -> dict:
  """One noisy SAM run; jit- and vmap-friendly in rho, sigma and key."""
  f = _quadratic if kind == 'quadratic' else landscapes.valley_with_bump
  scale = SCALE if kind == 'scaled' else 1.0
  tx = sam.sam(optax.sgd(LR / scale), rho=rho,
               warmup_steps=WARM_STEPS if kind == 'warm' else 0,
               detector=detector)
  x0 = jnp.asarray((1.0, 1.0) if kind == 'quadratic' else landscapes.START,
                   jnp.float32)

  def body(carry, k):
    x, state = carry
    xi = jax.random.normal(k, (2,))
    grad = lambda y: scale * (jax.grad(f)(y) + sigma * xi)
    updates, state = tx.update(grad(x), state, x, grad_fn=grad)
    x = optax.apply_updates(x, updates)
    return (x, state), x

  (x, state), path = jax.lax.scan(body, (x0, tx.init(x0)), jax.random.split(
      key, steps))
  d = sam.diagnostics(state)
  return dict(x=x, tail_mean=path[-200:].mean(0),
              flagged_steps=d['hallucination_steps'],
              ratio_ema=d['grad_ratio_ema'])


@functools.partial(jax.jit, static_argnums=1)
def _noiseless_stall(rho: jax.Array, steps: int):
  # One program for every rho (traced); (x*, |grad f(x*)|).
  x = run('stall', rho, 0.0, jax.random.key(0),
          hallucination.DetectorConfig(), steps)['x']
  return x, jnp.linalg.norm(jax.grad(landscapes.valley_with_bump)(x))


def noiseless_stalls(rhos, steps: int) -> dict:
  """rho -> (x*, |grad f(x*)|) of SAM's noiseless stall."""
  out = {}
  for rho in rhos:
    x, g = _noiseless_stall(jnp.float32(rho), steps)
    out[rho] = (np.asarray(x), float(g))
  return out


def study(levels, rhos, seeds: int, steps: int) -> dict:
  """{(detector, kind, level, rho): per-seed flags, stall and ratio}."""
  stalls = noiseless_stalls(rhos, steps)
  keys = jax.random.split(jax.random.key(1), seeds)
  rows = {}
  for name, detector in DETECTORS.items():
    for kind in KINDS:
      fn = jax.jit(jax.vmap(
          lambda rho, sigma, k, kind=kind, detector=detector: run(
              kind, rho, sigma, k, detector, steps),
          in_axes=(None, None, 0)))
      for level in levels:
        for rho in rhos:
          x_star, g_star = stalls[rho]
          out = jax.device_get(fn(jnp.float32(rho),
                                  jnp.float32(level * g_star), keys))
          flagged = np.asarray(out['flagged_steps']) > 0
          near = np.linalg.norm(np.asarray(out['tail_mean']) - x_star,
                                axis=1) < STALL_RADIUS
          rows[(name, kind, level, rho)] = dict(
              flagged=flagged.tolist(), near_stall=near.tolist(),
              ratio_ema=np.asarray(out['ratio_ema']).tolist(),
              sigma=level * g_star, stall_grad_norm=g_star)
  return rows
