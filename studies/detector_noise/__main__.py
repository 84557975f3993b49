r"""The hallucination detector under minibatch-like gradient noise: detection against false alarms.

  python -m studies.detector_noise --workdir=workdirs/detector_noise

On `geom.landscapes.valley_with_bump`, SAM without warm-start stalls at a
hallucinated minimizer for rho in [0.5, 1.2] (`studies.sam_landscape`).
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
the detector flagged at least one step. Writes `detector_noise.md`
(`report`: detection rate on stalls, false-alarm rate on convergent runs,
and quantiles of the smoothed ratio at the end of each kind of run, from
which the threshold was chosen) and `detector_noise.json` (every run).
"""

import os

from absl import app
from absl import flags

from studies.detector_noise import noisy_runs
from studies.detector_noise import report

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/detector_noise',
                               'Where the table and JSON go.')
_LEVELS = flags.DEFINE_list(
    'levels', ['0', '0.05', '0.1', '0.14', '0.2', '0.3', '0.5', '1.0'],
    'Noise per coordinate, as a fraction of the stall\'s |grad f|.')
_RHOS = flags.DEFINE_list('rhos', ['0.6', '0.8', '1.0', '1.2'], 'SAM radii.')
_SEEDS = flags.DEFINE_integer('seeds', 20, 'Seeds per setting.')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Steps per run.')


def main(argv):
  del argv
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  levels = [float(v) for v in _LEVELS.value]
  rhos = [float(r) for r in _RHOS.value]
  rows = noisy_runs.study(levels, rhos, _SEEDS.value, _STEPS.value)
  text = report.table(report.summarize(rows), levels)
  with open(os.path.join(workdir, 'detector_noise.md'), 'w') as fp:
    fp.write(text)
  report.dump(rows, os.path.join(workdir, 'detector_noise.json'))
  print(text)


if __name__ == '__main__':
  app.run(main)
