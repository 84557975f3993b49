"""studies.tta: the README's three commands at runlocal size, their tables
rebuilt from the stored raw errors, and bad flags and a held workdir
refused in one line before anything is trained (subprocesses: the
studies' absl flags share names)."""

import json
import os
import shutil

import pytest

from studies.tta import grids
from studies.tta import report
from tests import launch_runs


def _study(workdir, *flags, timeout=120):
  return launch_runs.run_module('studies.tta', f'--workdir={workdir}', *flags,
                                timeout=timeout)


_SMALL = ('--runlocal', '--seeds=1')


def _run_and_rebuild(workdir, name, flags, study):
  """Runs the README's `--study=name` command at runlocal size with `flags`;
  returns its raw errors after checking that its table rebuilds from
  them (the stored `<name>.json` is the study's record)."""
  result = _study(workdir, f'--study={name}', *_SMALL, *flags, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(workdir / f'{name}.json') as f:
    raw = json.load(f)
  with open(workdir / f'{name}.md') as f:
    text = f.read()
  assert text.strip() in result.stdout
  assert getattr(report, name)(study, raw) + '\n' == text
  assert raw and all(0 <= e <= 100 for e in raw.values()), raw
  return raw


def test_the_rates_and_norm_commands_run_at_runlocal_size(tmp_path,
                                                          tta_source_run):
  # One workdir, as the README's commands share workdirs/tta_study: the
  # BatchNorm source trains once. Methods without gradients in the norm
  # study keep the cost down (the table's runs are the slow test below).
  # The source of seed 0 is the session's (tests/tta_source.py, the
  # study's config, also test_tta_loop's): the study still trains it,
  # finding it finished (the table command's slow test trains its own).
  workdir = tmp_path / 'study'
  shutil.copytree(tta_source_run, workdir / 'source_0')
  raw = _run_and_rebuild(
      workdir, 'rates', ('--methods=tent', '--rates=1e-2'),
      grids.Study(str(workdir), seeds=1, methods=('tent',), rates=(1e-2,)))
  assert sorted(raw) == ['tent|conga|0.01|0', 'tent|fixed|0.01|0']
  assert os.path.getsize(workdir / 'rates.png') > 1000
  # Batches of 64 (the study's first size), not 8: a third of the CPU of
  # its three runs (24 batches each, not 189), and still a label shift
  # (by_class: 67% error against 26% shuffled).
  raw = _run_and_rebuild(
      workdir, 'norm', ('--norms=batch', '--norm_batch_sizes=64',
                        '--norm_methods=bn_stats'),
      grids.Study(str(workdir), seeds=1, norms=('batch',),
                  norm_batch_sizes=(64,), norm_methods=('bn_stats',)))
  assert sorted(raw) == sorted(
      f'batch|{method}|64|{order}|0' for method in ('source', 'bn_stats')
      for order in grids.ORDERS)
  # The source model does not depend on the order; BN statistics do.
  assert (raw['batch|source|64|shuffled|0']
          == raw['batch|source|64|by_class|0'])
  assert (raw['batch|bn_stats|64|by_class|0']
          > raw['batch|bn_stats|64|shuffled|0'])
  # The norm study's BatchNorm source is the rates study's: trained once.
  assert sorted(p for p in os.listdir(workdir) if p.startswith('source_')
                and not p.startswith('source_fixed')) == ['source_0']


@pytest.mark.slow
def test_the_table_command_runs_at_runlocal_size(tmp_path):
  workdir = tmp_path / 'study'
  raw = _run_and_rebuild(
      workdir, 'table', ('--protocols=episodic', '--severities=5',
                         '--mean_protocols='),
      grids.Study(str(workdir), seeds=1, protocols=('episodic',),
                  severities=(5,), mean_protocols=()))
  assert sorted(raw) == sorted(f'{label}|episodic|5|0'
                               for label, _, _ in grids.TABLE_ROWS)


_BAD_FLAGS = [
    ('--methods=tent,foo', "error: --methods='foo': unknown; valid choices: "
     "'tent', 'eata', 'sar'"),
    ('--severities=5,9', "error: --severities='9': must be an integer in 1-5"),
    ('--seeds=0', 'error: --seeds=0: must be an integer >= 1'),
    ('--rates=1e-3,inf', "error: --rates='inf': must be a number > 0"),
    ('--norm_methods=source', "error: --norm_methods='source': unknown"),
    ('--protocols=', "error: --protocols='': is empty"),
]


@pytest.fixture(scope='module')
def bad_flag_runs(tmp_path_factory):
  """{flag: (the study's result with it, its workdir)}: each run its own
  process, forked from one that imported the study once
  (launch_runs.run_module_each; a process's imports cost more CPU than the
  check)."""
  flags = [flag for flag, _ in _BAD_FLAGS]
  return dict(zip(flags, launch_runs.run_study_each(
      tmp_path_factory, 'studies.tta', [[flag] for flag in flags])))


@pytest.mark.parametrize('flag, expected', _BAD_FLAGS)
def test_bad_flags_are_one_line_before_any_work(bad_flag_runs, flag,
                                                 expected):
  result, workdir = bad_flag_runs[flag]
  assert result.returncode == 2, result.stderr[-2000:]
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
  assert not os.path.exists(workdir)


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
