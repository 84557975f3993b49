r"""Tables and a plot of a sweep's final metrics: mean +- std over seeds.

  python -m launch.report workdirs/smoke [more sweep roots or run dirs] \
    [--metric=test_accuracy] [--out=DIR]

Writes `report.md`, `report.csv` and `report.png` (`--metric` against the
first swept key, one line per setting of the others, error bars one std)
into `--out` (default: the first directory); see `train.jobs.sweep_report`.
"""

import os
import sys

from absl import app
from absl import flags

from train.jobs import entry
from train.jobs import sweep_report
from train.errors import UsageError

_METRIC = flags.DEFINE_string('metric', 'test_accuracy',
                              'Metric for the plot (y axis).')
_OUT = flags.DEFINE_string('out', None, 'Output directory.')


def main(argv):
  dirs = argv[1:]
  if not dirs:
    print('error: WORKDIR: give one or more sweep roots or run directories',
          file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  missing = [d for d in dirs if not os.path.isdir(d)]
  if missing:
    print(f'error: WORKDIR={missing[0]!r}: no such directory', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  out = _OUT.value or dirs[0]
  try:
    found = sweep_report.write_report(dirs, _METRIC.value, out)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  print(found['table'], end='')
  print(f'wrote {out}/report.md, report.csv, report.png')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, None))
