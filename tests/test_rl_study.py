"""studies.rl_staleness and studies.gas: the READMEs' commands at runlocal
size, their tables rebuilt from the stored results, and bad flags and a
held workdir refused in one line before anything is trained
(subprocesses: the studies' absl flags share names)."""

import json
import os
import shutil

import pytest

from studies.rl_staleness import report
from studies.rl_staleness import runs
from tests import launch_runs

_SMALL = ('--runlocal', '--seeds=1', '--num_versions=2')


def _study(module, workdir, *flags, timeout=120):
  return launch_runs.run_module(module, f'--workdir={workdir}', *flags,
                                timeout=timeout)


def _stored(workdir):
  with open(os.path.join(workdir, 'study.json')) as f:
    raw = json.load(f)
  with open(os.path.join(workdir, 'study.md')) as f:
    return raw, f.read()


def _files(root):
  """{path: modification time} of every file below `root` but the lock
  (which reading a finished run takes)."""
  return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, files in os.walk(root) for f in files if f != '.lock'}


def test_the_readme_commands_run_at_runlocal_size(tmp_path):
  # The GAS room's command, then the staleness room's stress command in a
  # workdir of its own with the warm start copied in (the README's runs
  # linked it; a workdir now refuses a link that leaves it).
  workdir = str(tmp_path / 'study')
  result = _study('studies.gas', workdir, '--bounds=1',
                  '--corrections=decoupled', '--gas=full', '--gas_bound=2',
                  *_SMALL, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  raw, text = _stored(workdir)
  assert sorted(raw) == ['GAS full, s_base=2|0', 'async s=1, decoupled|0',
                         'sync|0']
  study = runs.Study(workdir, seeds=1, bounds=(1,),
                     corrections=('decoupled',), gas=('full',), gas_bound=2,
                     num_versions=2, runlocal=True)
  # The stored results are the study's record: the tables rebuild from them.
  assert report.table(study, raw) + '\n' == text
  assert '| GAS full, s_base=2 |' in text and 'alpha' in text
  assert os.path.getsize(os.path.join(workdir, 'study.png')) > 1000

  stress = tmp_path / 'stress'
  stress.mkdir()
  shutil.copytree(os.path.join(workdir, 'sft_0'), stress / 'sft_0')
  before = _files(stress / 'sft_0')
  overrides = ('optimizer.learning_rate=1e-4', 'runtime.deterministic=True')
  result = _study('studies.rl_staleness', stress, '--bounds=2',
                  '--corrections=none', '--set=' + ','.join(overrides),
                  *_SMALL, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  raw, text = _stored(stress)
  assert sorted(raw) == ['async s=2, none|0', 'sync|0']
  study = runs.Study(str(stress), seeds=1, bounds=(2,),
                     corrections=('none',), num_versions=2,
                     overrides=overrides, runlocal=True)
  assert report.table(study, raw) + '\n' == text
  assert 'alpha' not in text
  # The copied warm start was read, not trained again.
  assert _files(stress / 'sft_0') == before
  config, _ = runs.rl_config(study, 0, 2, 'none')
  assert config.optimizer.learning_rate == 1e-4
  assert config.runtime.deterministic is True


# Each of these started training a warm start (or, --seeds=0, exited 0 with
# empty tables).
@pytest.mark.parametrize('module, flag, expected', [
    ('studies.rl_staleness', '--bounds=1,-1',
     "error: --bounds='-1': must be an integer >= 1"),
    ('studies.rl_staleness', '--corrections=tis,foo',
     "error: --corrections='foo': unknown; valid choices: 'none', 'tis', "
     "'decoupled'"),
    ('studies.rl_staleness', '--seeds=0',
     'error: --seeds=0: must be an integer >= 1'),
    # Through the runs' own config check, as the study builds them.
    ('studies.rl_staleness', '--set=optimizer.learning_rate=1e999',
     'error: config.optimizer.learning_rate=inf: must be finite and > 0'),
    ('studies.gas', '--gas=full,foo',
     "error: --gas='foo': unknown GAS variant; valid choices: 'full'"),
    ('studies.gas', '--gas_bound=0',
     'error: --gas_bound=0: must be an integer >= 1'),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, module, flag,
                                                expected):
  result = _study(module, tmp_path / 'study', flag)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
  assert not os.path.exists(tmp_path / 'study')


def test_a_held_workdir_is_one_line_and_exit_75(tmp_path):
  # It was a WorkdirBusy traceback, exit 1.
  workdir = tmp_path / 'study'
  workdir.mkdir()
  result = launch_runs.run_while_held(
      str(workdir), lambda: _study('studies.rl_staleness', workdir,
                                   '--seeds=1'))
  assert result.returncode == 75, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and 'in use by another run' in lines[0], (
      result.stderr)
  assert sorted(os.listdir(workdir)) == ['.lock']
