r"""The hallucination detector under minibatch-like gradient noise: detection against false alarms.

  python -m launch.detector_noise --workdir=workdirs/detector_noise

On `geom.landscapes.valley_with_bump`, SAM without warm-start stalls at a
hallucinated minimizer for rho in [0.5, 1.2] (`launch.sam_landscape`).
Here every step's two gradients come from a noisy "minibatch" loss

  f_B(x) = s (f(x) + sigma <xi_B, x>),   xi_B ~ N(0, I) drawn per step,

the same xi_B at w and at w + e (one batch per SAM step, as in minibatch
SAM), so g = grad f(w) + sigma xi_B and, at a stall, |g+| / |g| is about
|sigma xi| / |grad f| instead of 0. The noise level is given per
coordinate relative to the noiseless stall's |grad f| for each rho:
sigma = level |grad f(x*_rho)|.

Runs per noise level, rho and seed:
- `stall`: SAM from (0, 1), no warm-start. Counted as a stall when the
  run's mean position over its last 200 steps lies within 0.15 of the
  noiseless stall x*_rho (the noise may also knock it out; those runs are
  reported, not counted).
- `warm`: the same after 100 plain steps (reaches the valley's minimum):
  a convergent run under the same noise.
- `quadratic`: SAM on 0.5 x^T diag(4, 1) x from (1, 1) under the same
  sigma: convex, where no flag is ever right.
- `scaled`: the stall with the loss (and the noise) multiplied by
  s = 1e-4 and the learning rate by 1e4, the same trajectory on a loss of
  another scale.

Each is run under two detector configurations: the defaults of
`geom.hallucination.DetectorConfig` and the earlier ones (ratio threshold
0.1, absolute |g| floor 1e-3, no relative test). A run is flagged when
the detector flagged at least one step. Writes `detector_noise.md` and
`.json` (detection rate on stalls, false-alarm rate on convergent runs,
and quantiles of the smoothed ratio at the end of each kind of run, from
which the threshold was chosen).
"""

import json
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from geom import hallucination
from train import stats
from train.vision.noisy_landscapes import KINDS
from train.vision.noisy_landscapes import noiseless_stalls
from train.vision.noisy_landscapes import PREVIOUS
from train.vision.noisy_landscapes import run
from train.vision.noisy_landscapes import STALL_RADIUS

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/detector_noise',
                               'Where the table and JSON go.')
_LEVELS = flags.DEFINE_list(
    'levels', ['0', '0.05', '0.1', '0.14', '0.2', '0.3', '0.5', '1.0'],
    'Noise per coordinate, as a fraction of the stall\'s |grad f|.')
_RHOS = flags.DEFINE_list('rhos', ['0.6', '0.8', '1.0', '1.2'], 'SAM radii.')
_SEEDS = flags.DEFINE_integer('seeds', 20, 'Seeds per setting.')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Steps per run.')

DETECTORS = {'default': hallucination.DetectorConfig(), 'previous': PREVIOUS}

def study(levels, rhos, seeds: int, steps: int) -> dict:
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


def summarize(rows, levels, rhos) -> dict:
  """Per detector, kind and level, pooled over rho and seeds."""
  summary = {}
  for (name, kind, level, rho), r in rows.items():
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
  del levels, rhos
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


def main(argv):
  del argv
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  levels = [float(v) for v in _LEVELS.value]
  rhos = [float(r) for r in _RHOS.value]
  rows = study(levels, rhos, _SEEDS.value, _STEPS.value)
  summary = summarize(rows, levels, rhos)
  text = table(summary, levels)
  with open(os.path.join(workdir, 'detector_noise.md'), 'w') as fp:
    fp.write(text)
  with open(os.path.join(workdir, 'detector_noise.json'), 'w') as fp:
    json.dump({'/'.join(map(str, k)): v for k, v in rows.items()}, fp)
  print(text)


if __name__ == '__main__':
  app.run(main)
