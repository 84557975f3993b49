"""launch.tta_study refuses bad flags and a held workdir in one line, before
it trains anything (subprocesses: the launchers' absl flags share names).
The studies themselves run for RESULTS.md (see its commands)."""

import os

import pytest

from tests import launch_runs


def _study(workdir, *flags):
  return launch_runs.run_module('launch.tta_study', f'--workdir={workdir}', *flags)


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
