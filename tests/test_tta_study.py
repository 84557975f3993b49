"""studies.tta: the README's three commands at runlocal size (slow), their
tables rebuilt from the stored raw errors; the rates and norm grids and
tables with the runs stood in for; and bad flags and a held workdir
refused in one line before anything is trained (subprocesses: the
studies' absl flags share names)."""

import json
import os
import shutil

import numpy as np
import pytest

from studies.tta import grids
from studies.tta import report
from tests import launch_runs
from tests import tta_source


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


# Slow: test_the_rates_and_norm_grids_run_what_their_tables_show checks
# the grids' runs and the tables in this process with the runs stood in
# for; test_tta_loop adapts for real.
@pytest.mark.slow
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


def _fake_error(config) -> float:
  """A stand-in run's error, made from the settings the grid gave it: a
  run of the wrong seed, rate, schedule, batch size, order or method
  shows in the numbers."""
  return (10.0 * config.seed + 100.0 * config.method.learning_rate
          + (1.0 if config.method.schedule == 'conga' else 0.0)
          + config.batch_size / 64 + (20.0 if config.order == 'by_class'
                                      else 0.0)
          + {'source': 0.0, 'bn_stats': 2.0, 'tent': 3.0}[config.method.name])


def _stand_in_runs(monkeypatch, error=_fake_error):
  """Replaces the study's source trainings and adaptation runs (a run's
  error: `error(config)`); returns the lists they record (workdir, config)
  into."""
  sources, runs = [], []

  def train(config, workdir):
    sources.append((workdir, config))
    return {'test_accuracy': 0.5}

  def adapt(config, workdir):
    runs.append((workdir, config))
    return {'mean_error': error(config)}

  monkeypatch.setattr(grids.trainer, 'train_and_evaluate', train)
  monkeypatch.setattr(grids.adapt, 'adapt_and_evaluate', adapt)
  return sources, runs


def _cell(values) -> str:
  """'mean ± sample std' to one digit, computed here with numpy."""
  return f'{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f}'


def _row(table: str, *first: str) -> list[str]:
  rows = [[c.strip() for c in line.strip('|').split('|')]
          for line in table.splitlines()]
  return next(r for r in rows if r[:len(first)] == list(first))


def test_the_rates_and_norm_grids_run_what_their_tables_show(
    tmp_path, monkeypatch):
  # The commands' grids and tables (the slow test above runs them), each
  # run stood in for: which runs the grids ask for, on which source and
  # settings, and the tables' cells recomputed from the runs' errors.
  sources, runs = _stand_in_runs(monkeypatch)
  root = str(tmp_path)
  study = grids.Study(root, seeds=2, methods=('tent',), rates=(1e-2, 1e-1),
                      runlocal=True)
  raw = grids.rates(study)
  assert sorted(raw) == sorted(f'tent|{schedule}|{rate:g}|{seed}'
                               for schedule in ('fixed', 'conga')
                               for rate in (1e-2, 1e-1) for seed in (0, 1))
  # The session's TTA source (tests/tta_source.py) is the study's seed 0.
  assert [w for w, _ in sources] == [os.path.join(root, 'source_0'),
                                     os.path.join(root, 'source_1')]
  assert sources[0][1].to_dict() == tta_source.config().to_dict()
  assert sources[1][1].seed == 1
  for workdir, config in runs:
    assert config.source_workdir == os.path.join(root,
                                                 f'source_{config.seed}')
    assert (config.corruptions, config.severity, config.protocol,
            config.batch_size) == ('gaussian_noise,fog,contrast', 5,
                                   'continual', 64), workdir
  assert len({w for w, _ in runs}) == len(runs) == 8  # A workdir each.
  table = report.rates(study, raw)
  error = lambda seed, rate, conga: (10 * seed + 100 * rate + conga + 1 + 3)
  for conga, schedule in ((0, 'fixed'), (1, 'conga')):
    at = {(s, r): error(s, r, conga) for s in (0, 1) for r in (1e-2, 1e-1)}
    assert _row(table, 'tent', schedule) == [
        'tent', schedule, _cell([at[0, 1e-2], at[1, 1e-2]]),
        _cell([at[0, 1e-1], at[1, 1e-1]]),
        _cell([at[0, 1e-2], at[1, 1e-2]]),  # The best rate: the lower.
        _cell([at[0, 1e-1] - at[0, 1e-2], at[1, 1e-1] - at[1, 1e-2]])]
  report.plot_rates(study, raw, str(tmp_path / 'rates.png'))
  assert os.path.getsize(tmp_path / 'rates.png') > 1000

  sources.clear()
  runs.clear()
  study = grids.Study(root, seeds=2, norms=('batch', 'group'),
                      norm_batch_sizes=(64, 8),
                      norm_methods=('bn_stats', 'tent'), runlocal=True)
  raw = grids.norm(study)
  # No BN statistics to replace without BatchNorm; the source model runs
  # once per norm and seed (batch 64, shuffled) and stands for each cell.
  assert sorted({k.rsplit('|', 3)[0] for k in raw}) == [
      'batch|bn_stats', 'batch|source', 'batch|tent', 'group|source',
      'group|tent']
  assert len(raw) == 5 * 2 * 2 * 2
  assert [w for w, _ in sources] == [
      os.path.join(root, name) for name in ('source_0', 'source_group_0',
                                            'source_1', 'source_group_1')]
  assert sources[1][1].model.norm == 'group'
  assert len(runs) == 2 * (2 + 2 * 2 * 2 + 2 * 2)
  for workdir, config in runs:
    assert (config.protocol, config.severity, config.method.schedule) == (
        'episodic', 5, 'fixed'), workdir
  table = report.norm(study, raw)
  for size in (64, 8):
    for order in grids.ORDERS:
      assert raw[f'group|source|{size}|{order}|1'] == 10 + 0.1 + 1
  cells = lambda rate, shift: [
      _cell([10 * s + 100 * rate + b / 64 + shift + o for s in (0, 1)])
      for o in (0, 20) for b in (64, 8)]
  assert _row(table, 'batch', 'bn_stats') == ['batch', 'bn_stats',
                                               *cells(1e-3, 2)]
  assert _row(table, 'group', 'tent') == ['group', 'tent', *cells(1e-3, 3)]
  assert _row(table, 'group', 'source') == ['group', 'source'] + [
      _cell([0.1 + 1, 10.1 + 1])] * 4
  assert not [l for l in table.splitlines() if '| group | bn_stats |' in l]


def _table_error(config) -> float:
  """A stand-in error for the table's runs: its row, seed, protocol and
  severity in the number."""
  row = [(m, s) for _, m, s in grids.TABLE_ROWS].index(
      (config.method.name, config.method.schedule))
  return (10.0 * config.seed + row + 0.25 * config.severity
          + {'episodic': 0.0, 'continual': 100.0}[config.protocol])


def test_the_table_grid_runs_what_its_table_shows(tmp_path, monkeypatch):
  # The table command's grid and table (its slow test runs them), each run
  # stood in for: each row on each stream at severity 5, and at every
  # severity on the averaged protocol; the cells recomputed here.
  sources, runs = _stand_in_runs(monkeypatch, _table_error)
  study = grids.Study(str(tmp_path), seeds=2, severities=(3, 5),
                      protocols=('episodic', 'continual'),
                      mean_protocols=('episodic',), runlocal=True)
  raw = grids.table(study)
  assert len(sources) == 2 and len(runs) == len(raw) == 8 * 2 * 3
  for workdir, config in runs:
    name = config.method.name
    assert config.method.learning_rate == (1e-2 if name == 'sar'
                                           else 1e-3), workdir
    assert config.source_workdir == os.path.join(str(tmp_path),
                                                 f'source_{config.seed}')
  table = report.table(study, raw)
  assert table.splitlines()[0] == (
      '| method | episodic sev 5 | continual sev 5 | episodic sev 3-5 |')
  for row, (label, _, _) in enumerate(grids.TABLE_ROWS):
    at = lambda protocol, severity, seed: (  # pylint: disable=cell-var-from-loop
        10.0 * seed + row + 0.25 * severity
        + (100.0 if protocol == 'continual' else 0.0))
    assert _row(table, label) == [
        label, _cell([at('episodic', 5, s) for s in (0, 1)]),
        _cell([at('continual', 5, s) for s in (0, 1)]),
        _cell([np.mean([at('episodic', v, s) for v in (3, 5)])
               for s in (0, 1)])]


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
