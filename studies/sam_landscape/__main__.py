r"""SAM's hallucinated minimizers on a 2-D landscape, the detector, and the warm-start.

  python -m studies.sam_landscape --workdir=workdirs/sam_landscape

Runs `geom.sam.sam` (with its detector) on `geom.landscapes.valley_with_bump`
from (0, 1) for every rho in a grid and every warm-start length
(`sam_runs`), and writes to the workdir: `landscape_table.md` (one row per
rho and warm-start: where SAM ends, f - f_min, |grad f(x)|, |grad f(x+)|,
how many steps the detector flagged, the outcome), `landscape.json`, and
`landscape.png` (contours, trajectories, the flagged points and their x+).
"""

import os

from absl import app
from absl import flags

from studies.sam_landscape import report
from studies.sam_landscape import sam_runs

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/sam_landscape',
                               'Where the table, JSON and PNG go.')
_RHOS = flags.DEFINE_list('rhos', ['0', '0.2', '0.4', '0.6', '0.8', '1.0',
                                   '1.2', '1.4'], 'SAM radii.')
_WARMUPS = flags.DEFINE_list('warmups', ['0', '10', '20', '50', '100'],
                             'Warm-start lengths (plain steps before SAM).')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Steps per run.')
_LR = flags.DEFINE_float('lr', 0.01, 'Learning rate of the base SGD.')


def main(argv):
  del argv
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  rhos = [float(r) for r in _RHOS.value]
  warmups = [int(w) for w in _WARMUPS.value]
  kw = dict(steps=_STEPS.value, lr=_LR.value)
  results = sam_runs.sweep(rhos, warmups, **kw)
  restart = sam_runs.sweep(rhos, [0], response='warm_restart', **kw)
  text = report.table(results, restart)
  with open(os.path.join(workdir, 'landscape_table.md'), 'w') as fp:
    fp.write(text)
  report.dump(results, restart, os.path.join(workdir, 'landscape.json'))
  report.plot(results, os.path.join(workdir, 'landscape.png'), **kw)
  print(text)
  print(f'wrote {workdir}/landscape_table.md, landscape.json, landscape.png')


if __name__ == '__main__':
  app.run(main)
