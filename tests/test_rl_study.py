"""launch.rl_study refuses bad flags and a held workdir in one line, before
it trains anything (subprocesses: the launchers' absl flags share names).
The study itself runs for RESULTS.md (see its command)."""

import os

import pytest

from tests import launch_runs


def _study(workdir, *flags):
  return launch_runs.run_module('launch.rl_study', f'--workdir={workdir}', *flags)


# Each of these started training a warm start (or, --seeds=0, exited 0 with
# empty tables).
@pytest.mark.parametrize('flag, expected', [
    ('--bounds=1,-1', "error: --bounds='-1': must be an integer >= 1"),
    ('--corrections=tis,foo', "error: --corrections='foo': unknown; valid "
     "choices: 'none', 'tis', 'decoupled'"),
    ('--seeds=0', "error: --seeds=0: must be an integer >= 1"),
    # Through the runs' own config check, as the study builds them.
    ('--set=optimizer.learning_rate=1e999',  # inf as a Python literal.
     'error: config.optimizer.learning_rate=inf: must be finite and > 0'),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, flag, expected):
  result = _study(tmp_path / 'study', flag)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
  assert not os.path.exists(tmp_path / 'study')


def test_a_held_workdir_is_one_line_and_exit_75(tmp_path):
  # It was a WorkdirBusy traceback, exit 1.
  workdir = tmp_path / 'study'
  workdir.mkdir()
  result = launch_runs.run_while_held(
      str(workdir), lambda: _study(workdir, '--seeds=1'))
  assert result.returncode == 75, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and 'in use by another run' in lines[0], (
      result.stderr)
  assert sorted(os.listdir(workdir)) == ['.lock']
