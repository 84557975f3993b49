"""studies/local_sweeps: the README's sweep command plans the runs its
report table lists (12: four learning rates x seeds 0 to 2), and its
report command reads that sweep's workdir. The sweep machinery itself
runs at smoke size in test_sweep.py (the full sweep takes 3 minutes)."""

import os
import re
import shlex

from train.jobs import sweep_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOM = os.path.join(ROOT, 'studies', 'local_sweeps')


def _readme():
  with open(os.path.join(ROOM, 'README.md')) as f:
    return f.read()


def _commands(text):
  """The README's indented commands, continuation lines joined, as argv."""
  joined = re.sub(r'\\\n\s*', '', text)
  return [shlex.split(line.strip()) for line in joined.splitlines()
          if line.startswith('    python -m ')]


def _flags(argv):
  return dict(a[2:].split('=', 1) for a in argv if a.startswith('--'))


def test_the_readme_sweep_plans_the_runs_of_its_table(tmp_path):
  text = _readme()
  sweep, report = _commands(text)
  assert sweep[:3] == ['python', '-m', 'launch.sweep']
  flags = _flags(sweep)
  runs = sweep_plan.plan(flags['config'], flags['sweep'], str(tmp_path))
  table = [line.split(' | ') for line in text.splitlines()
           if re.match(r'\| [0-9.]+ \| ', line)]
  assert len(table) == 4
  assert sorted({r.overrides['optimizer.learning_rate'] for r in runs}) == [
      float(row[0].strip('| ')) for row in table]
  assert sorted(r.overrides['seed'] for r in runs) == [0] * 4 + [1] * 4 + [
      2] * 4
  assert all(row[1] == '3' for row in table)  # Seeds per row.
  assert runs[0].argv[2] == 'launch.train'
  assert report[:3] == ['python', '-m', 'launch.report']
  assert report[3] == flags['workdir']


def test_the_readme_plot_is_stored():
  assert '](results/digits_lr_sweep.png)' in _readme()
  with open(os.path.join(ROOM, 'results', 'digits_lr_sweep.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
