"""studies.tta: the README's three commands at runlocal size, their tables
rebuilt from the stored raw errors, and bad flags and a held workdir
refused in one line before anything is trained (subprocesses: the
studies' absl flags share names)."""

import json
import os

import pytest

from studies.tta import grids
from studies.tta import report
from tests import launch_runs


def _study(workdir, *flags, timeout=120):
  return launch_runs.run_module('studies.tta', f'--workdir={workdir}', *flags,
                                timeout=timeout)


def test_the_readme_commands_run_at_runlocal_size(tmp_path):
  # One workdir for the three studies, as the README's commands share
  # workdirs/tta_study: the BatchNorm source trains once.
  workdir = tmp_path / 'study'
  small = ('--runlocal', '--seeds=1')
  commands = {
      'rates': ('--methods=tent', '--rates=1e-2'),
      'table': ('--protocols=episodic', '--severities=5',
                '--mean_protocols='),
      'norm': ('--norms=batch,group', '--norm_batch_sizes=8',
               '--norm_methods=tent'),
  }
  studies = {
      'rates': grids.Study(str(workdir), seeds=1, methods=('tent',),
                           rates=(1e-2,)),
      'table': grids.Study(str(workdir), seeds=1, protocols=('episodic',),
                           severities=(5,), mean_protocols=()),
      'norm': grids.Study(str(workdir), seeds=1, norms=('batch', 'group'),
                          norm_batch_sizes=(8,), norm_methods=('tent',)),
  }
  for name, flags in commands.items():
    result = _study(workdir, f'--study={name}', *small, *flags, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(workdir / f'{name}.json') as f:
      raw = json.load(f)
    with open(workdir / f'{name}.md') as f:
      text = f.read()
    assert text.strip() in result.stdout
    # The stored raw errors are the table's record: it rebuilds from them.
    table = getattr(report, name)(studies[name], raw)
    assert table + '\n' == text
    assert all(0 <= e <= 100 for e in raw.values()), raw
  assert sorted(raw) == sorted(
      f'{norm}|{method}|8|{order}|0' for norm in ('batch', 'group')
      for method in ('source', 'tent') for order in grids.ORDERS)
  assert os.path.getsize(workdir / 'rates.png') > 1000
  # The table's BatchNorm source is the norm study's: trained once.
  assert sorted(p for p in os.listdir(workdir) if p.startswith('source_')) == [
      'source_0', 'source_group_0']


@pytest.mark.parametrize('flag, expected', [
    ('--methods=tent,foo', "error: --methods='foo': unknown; valid choices: "
     "'tent', 'eata', 'sar'"),
    ('--severities=5,9', "error: --severities='9': must be an integer in 1-5"),
    ('--seeds=0', 'error: --seeds=0: must be an integer >= 1'),
    ('--rates=1e-3,inf', "error: --rates='inf': must be a number > 0"),
    ('--norm_methods=source', "error: --norm_methods='source': unknown"),
    ('--protocols=', "error: --protocols='': is empty"),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, flag, expected):
  result = _study(tmp_path / 'study', flag)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
  assert not os.path.exists(tmp_path / 'study')


def test_a_held_workdir_is_one_line_and_exit_75(tmp_path):
  workdir = tmp_path / 'study'
  workdir.mkdir()
  result = launch_runs.run_while_held(
      str(workdir), lambda: _study(workdir, '--seeds=1'))
  assert result.returncode == 75, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and 'in use by another run' in lines[0], (
      result.stderr)
  assert sorted(os.listdir(workdir)) == ['.lock']
