"""Sweeps: expansion, validation, shell quoting, the TPU/xpk dry runs, a local sweep and its report."""

import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from configs import sweeps
from train.jobs import sweep_report as report
from train.jobs import sweep_plan
from train.jobs import sweep_runs
from tests.conftest import REPO_ROOT
from train.errors import UsageError

DANGEROUS = "'; rm -rf ~"


def _config_file(tmp_path, sweep_body: str) -> str:
  """A config module that reuses digits and defines its own sweeps."""
  path = tmp_path / 'cfg.py'
  path.write_text(textwrap.dedent('''
      from configs import digits
      from configs import sweeps

      def get_config(arg=None):
        return digits.get_config(arg)

      def get_sweep(name):
        return sweeps.select(name, {TABLE})
      ''').replace('{TABLE}', sweep_body))
  return str(path)


def _check_report_files(root):
  """The two learning rates' table, CSV and plot in `root`, and a metric
  the runs did not log refused."""
  table = open(os.path.join(root, 'report.md')).read().splitlines()
  assert table[0].startswith('| optimizer.learning_rate | seeds | ')
  assert len(table) == 2 + 2
  rows = list(csv.DictReader(open(os.path.join(root, 'report.csv'))))
  assert [r['optimizer.learning_rate'] for r in rows] == ['0.05', '0.2']
  assert os.path.getsize(os.path.join(root, 'report.png')) > 1000
  with pytest.raises(UsageError, match="--metric='bleu': not among"):
    report.write_report([root], 'bleu', root)


def test_product_zipped_combine_and_select():
  assert sweeps.product({'a': [1, 2], 'b': ['x', 'y', 'z']}) == [
      {'a': 1, 'b': 'x'}, {'a': 1, 'b': 'y'}, {'a': 1, 'b': 'z'},
      {'a': 2, 'b': 'x'}, {'a': 2, 'b': 'y'}, {'a': 2, 'b': 'z'}]
  assert sweeps.zipped({'a': [1, 2], 'b': [3, 4]}) == [{'a': 1, 'b': 3},
                                                        {'a': 2, 'b': 4}]
  assert sweeps.combine([{'m': 0}], sweeps.product({'s': [0, 1]})) == [
      {'m': 0, 's': 0}, {'m': 0, 's': 1}]
  with pytest.raises(ValueError, match='differ in length'):
    sweeps.zipped({'a': [1], 'b': [1, 2]})
  with pytest.raises(ValueError, match="axis 'a' needs a non-empty list"):
    sweeps.product({'a': []})
  with pytest.raises(ValueError, match="unknown sweep; valid choices: 'a', 'b'"):
    sweeps.select('c', {'b': list, 'a': list})


def test_digits_sweep_expands_in_order_with_its_overrides():
  runs = sweep_plan.plan('configs/digits.py', 'sam_rho', '/r')
  assert len(runs) == 5 * 3
  assert [(r.overrides['optimizer.sam.rho'], r.overrides['seed'])
          for r in runs[:4]] == [(0.02, 0), (0.02, 1), (0.02, 2), (0.05, 0)]
  first = runs[0]
  assert first.workdir == '/r/enabled=True,rho=0.02,seed=0'
  assert first.argv == (
      'python3', '-m', 'launch.train', '--config=configs/digits.py',
      '--workdir=/r/enabled=True,rho=0.02,seed=0',
      '--config.optimizer.sam.enabled=True',
      '--config.optimizer.sam.rho=0.02', '--config.seed=0')
  assert len({r.workdir for r in runs}) == len(runs)


@pytest.mark.parametrize('body,message', [
    ("{'s': lambda: [{'optimizer.rhoo': 1.0}]}",
     r"--sweep=s \(run 0\)='optimizer.rhoo': config.optimizer has no field "
     r"'rhoo'; valid choices: .*'learning_rate'"),
    ("{'s': lambda: [{'seed': 0}, {'nosuch.field': 1}]}",
     r"--sweep=s \(run 1\)='nosuch.field': config has no field 'nosuch'"),
    ("{'s': lambda: [{'optimizer.learning_rate': 'fast'}]}",
     r"'optimizer.learning_rate': cannot take 'fast'"),
    ("{'s': lambda: [{'seed': 0}, {'seed': 0}]}",
     'runs 0 and 1 have the same overrides'),
    ("{'t': lambda: []}", r"--sweep='s': unknown sweep; valid choices: 't'"),
])
def test_bad_sweeps_fail_before_anything_runs(tmp_path, body, message):
  with pytest.raises(UsageError, match=message):
    sweep_plan.plan(_config_file(tmp_path, body), 's', str(tmp_path / 'r'))
  assert not os.path.exists(tmp_path / 'r')


def _dangerous_run(tmp_path):
  cfg = _config_file(tmp_path, "{'s': lambda: [{'dataset': %r}]}" % DANGEROUS)
  (run,) = sweep_plan.plan(cfg, 's', 'gs://bucket/root')
  return run


def test_a_hostile_value_stays_one_argument_at_every_level(tmp_path):
  run = _dangerous_run(tmp_path)
  local_line = shlex.join(sweep_plan.tpu_argv(
      run, 'pod', 'us-west4-a', 'proj', '~/geom', 'python3'))
  argv = shlex.split(local_line)  # What the local shell hands to gcloud.
  assert argv[:9] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'pod',
                      '--project', 'proj', '--zone']
  remote = argv[argv.index('--command') + 1]
  assert remote.startswith('cd ~/geom && ')
  remote_argv = shlex.split(remote.split(' && ', 1)[1])
  assert f'--config.dataset={DANGEROUS}' in remote_argv
  assert remote_argv[-1] == '--multihost'
  # And through a real shell: a stand-in interpreter prints its argv.
  echo = tmp_path / 'argv.py'
  echo.write_text('import json, sys\nprint(json.dumps(sys.argv[1:]))\n')
  command = sweep_plan.remote_command(run, str(tmp_path),
                                      f'{sys.executable}')
  command = command.replace(shlex.quote(sys.executable),
                            shlex.join([sys.executable, str(echo)]), 1)
  out = subprocess.run(['bash', '-c', command], capture_output=True,
                       text=True, check=True).stdout
  received = json.loads(out)
  assert received[received.index('launch.train') + 3] == (
      f'--config.dataset={DANGEROUS}')
  xpk = sweep_plan.xpk_argv(run, 'c', 'v5litepod-16', 2, 'geom', None,
                            'python3')
  assert f'--config.dataset={DANGEROUS}' in shlex.split(
      shlex.split(shlex.join(xpk))[-1])


def _sweep(*args, timeout=600):
  return subprocess.run([sys.executable, '-m', 'launch.sweep', *args],
                        cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=timeout)


def test_tpu_and_xpk_dry_runs_print_one_command_per_run():
  proc = _sweep('--config=configs/digits.py', '--sweep=sam_rho',
                '--workdir=gs://bucket/sam', '--target=tpu', '--tpu=my-pod',
                '--zone=us-west4-a')
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert lines[0] == '# 15 runs (dry run; add --execute to run them)'
  commands = [shlex.split(l) for l in lines[1:]]
  assert len(commands) == 15
  for cmd, run in zip(commands, sweep_plan.plan('configs/digits.py',
                                                'sam_rho', 'gs://bucket/sam')):
    assert cmd[:10] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh',
                        'my-pod', '--zone', 'us-west4-a', '--worker=all',
                        '--command']
    assert cmd[10] == ("cd ~/geom && python3 -m launch.train "
                       f"--config=configs/digits.py "
                       f"--workdir={run.workdir} "
                       + ' '.join(shlex.quote(a) for a in run.argv[5:])
                       + ' --multihost')
  proc = _sweep('--config=configs/digits.py', '--sweep=sam_rho',
                '--workdir=gs://bucket/sam', '--target=xpk',
                '--xpk_cluster=c1', '--xpk_tpu_type=v5litepod-16')
  assert proc.returncode == 0, proc.stderr
  names = [shlex.split(l)[shlex.split(l).index('--workload') + 1]
           for l in proc.stdout.strip().splitlines()[1:]]
  assert len(set(names)) == 15
  assert all(len(n) <= 40 and n == n.lower() for n in names), names


@pytest.mark.parametrize('args,message', [
    (['--sweep=sam_rho', '--target=tpu', '--zone=z'],
     'error: --tpu=None: required with --target=tpu'),
    (['--sweep=sam_rho', '--target=xpk', '--xpk_cluster=c'],
     'error: --xpk_tpu_type=None: required with --target=xpk'),
    (['--sweep=rho'], "error: --sweep='rho': unknown sweep; valid choices: "
     "'learning_rate', 'sam_rho', 'smoke'"),
    (['--sweep=sam_rho', '--target=cloud'],
     'error: flag --target=cloud: value should be one of <local|tpu|xpk>'),
])
def test_launcher_mistakes_are_one_line(tmp_path, args, message):
  proc = _sweep('--config=configs/digits.py', f'--workdir={tmp_path}/r',
                *args)
  assert proc.returncode == 2
  assert proc.stderr.strip() == message, proc.stderr
  assert not os.path.exists(tmp_path / 'r')


# Slow (`make test-all`): 5 digits runs through launch.sweep and
# launch.train. The default suite's cover: the loop and the report below
# on stand-in runs, and test_a_local_rl_sweep_finishes_skips_and_reports
# (launch.sweep end to end on one real run: done, then skipped, reported).
@pytest.mark.slow
def test_local_sweep_resumes_and_reports(tmp_path):
  root = str(tmp_path / 'smoke')
  # 10 steps, not runlocal's 40, of its MLP, not the CNN: what is checked
  # (skips, the resume, the report of what the runs wrote) depends on
  # neither, and each of the 5 runs is 1 s of CPU shorter for the steps
  # (one checkpoint, one evaluation) and 1-2 s for the model.
  config = 'configs/digits.py:runlocal,model=mlp'
  args = [f'--config={config}', '--sweep=smoke', f'--workdir={root}',
          '--parallel=2', '--set=num_steps=10']
  proc = _sweep(*args)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  runs = sweep_plan.plan(config, 'smoke', root, {'num_steps': 10})
  finals = {}
  for run in runs:
    with open(os.path.join(run.workdir, 'final_metrics.json')) as f:
      finals[run.name] = json.load(f)
  # Relaunch: finished runs are skipped; an interrupted one resumes.
  os.remove(os.path.join(runs[1].workdir, 'final_metrics.json'))
  proc = _sweep(*args)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count('[skip]') == 3
  assert f'[resume] {runs[1].name}' in proc.stdout
  with open(os.path.join(runs[1].workdir, 'final_metrics.json')) as f:
    assert json.load(f) == finals[runs[1].name]

  found = report.write_report([root], 'test_accuracy', root)
  assert found['keys'] == ['optimizer.learning_rate']
  assert found['unfinished'] == []
  for group in found['groups']:
    lr = group['setting']['optimizer.learning_rate']
    values = [finals[r.name]['test_accuracy'] for r in runs
              if r.overrides['optimizer.learning_rate'] == lr]
    assert group['n'] == 2
    assert group['mean']['test_accuracy'] == pytest.approx(
        statistics.fmean(values))
    assert group['std']['test_accuracy'] == pytest.approx(
        statistics.stdev(values))
  _check_report_files(root)


def test_an_rl_sweep_runs_launch_rl_with_its_settings():
  settings = sweep_plan.parse_settings(
      ['sft_workdir=gs://bucket/sft 1b', 'rollout_processes=3'])
  assert settings == {'sft_workdir': 'gs://bucket/sft 1b',
                      'rollout_processes': 3}
  runs = sweep_plan.plan('configs/rl.py:size=1b', 'staleness',
                         'gs://bucket/rl', settings)
  assert len(runs) == 12
  first = runs[0]
  assert first.name == 'max_staleness=0,seed=0'  # Settings do not name it.
  assert first.finished == 'results.json'
  assert first.argv == (
      'python3', '-m', 'launch.rl', '--config=configs/rl.py:size=1b',
      '--workdir=gs://bucket/rl/max_staleness=0,seed=0',
      '--config.sft_workdir=gs://bucket/sft 1b',
      '--config.rollout_processes=3', '--config.runtime.max_staleness=0',
      '--config.seed=0')
  # Every worker of the slice runs the same argv with --multihost.
  xpk = sweep_plan.xpk_argv(first, 'c1', 'v5litepod-16', 1, 'geom', None,
                            'python3')
  assert shlex.split(xpk[xpk.index('--command') + 1]) == [
      *first.argv, '--multihost']
  # Training configs keep launch.train and final_metrics.json.
  (digits,) = sweep_plan.plan('configs/digits.py', 'sam_rho', '/r')[:1]
  assert digits.argv[2] == 'launch.train'
  assert digits.finished == 'final_metrics.json'


@pytest.mark.parametrize('item,message', [
    ('rollout_process=3', "error: --set='rollout_process': config has no "
     "field 'rollout_process'"),
    ('seed', "error: --set='seed': must be field=value"),
])
def test_a_bad_setting_is_one_line_before_anything_runs(tmp_path, item,
                                                        message):
  proc = _sweep('--config=configs/rl.py', '--sweep=smoke', f'--set={item}',
                f'--workdir={tmp_path}/r')
  assert proc.returncode == 2
  assert proc.stderr.strip().startswith(message), proc.stderr
  assert not os.path.exists(tmp_path / 'r')


def test_a_local_rl_sweep_finishes_skips_and_reports(tmp_path,
                                                     sft_policy_run):
  # One RL run (a config module of one sweep run) through launch.sweep.
  sft_workdir = sft_policy_run[0]
  cfg = tmp_path / 'rl_cfg.py'
  cfg.write_text(textwrap.dedent('''
      from configs import rl

      def get_config(arg=None):
        config = rl.get_config(arg)
        config.difficulties = (1, 2)  # What the warm start learnt.
        return config

      def get_sweep(name):
        return [{'runtime.max_staleness': 1}]
      '''))
  root = str(tmp_path / 'rl')
  args = [f'--config={cfg}:runlocal', '--sweep=one', f'--workdir={root}',
          f'--set=sft_workdir={sft_workdir}']
  proc = _sweep(*args, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  (run,) = sweep_plan.plan(f'{cfg}:runlocal', 'one', root,
                           {'sft_workdir': sft_workdir})
  with open(os.path.join(run.workdir, 'results.json')) as f:
    results = json.load(f)
  assert results['versions'] > 0
  proc = _sweep(*args)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f'[skip] {run.name}: finished' in proc.stdout
  found = report.write_report([root], 'samples_per_second', root)
  assert found['unfinished'] == []
  (group,) = found['groups']
  assert group['mean']['samples_per_second'] == results['samples_per_second']


# A stand-in run (no JAX): it makes its checkpoints directory, as a
# trainer does before it finishes, counts its starts, and writes its
# final metrics, test_accuracy given on its command line.
_STAND_IN = textwrap.dedent('''
    import json, os, sys
    workdir, accuracy = sys.argv[1], float(sys.argv[2])
    os.makedirs(os.path.join(workdir, 'checkpoints'), exist_ok=True)
    with open(os.path.join(workdir, 'starts'), 'a') as f:
      f.write('x')
    with open(os.path.join(workdir, 'final_metrics.json'), 'w') as f:
      json.dump({'test_accuracy': accuracy, 'test_loss': 1 - accuracy,
                 'step': 10}, f)
    ''')


def test_the_local_loop_skips_resumes_and_reports_its_runs(
    tmp_path, capsys, monkeypatch):
  """`sweep_runs.run_local` (what launch.sweep runs locally), 2 at a time,
  on 2 learning rates x 2 seeds of stand-in runs: each starts once; on a
  relaunch the finished ones are skipped and the one without its final
  metrics (its checkpoints kept) resumes; then `write_report` of the
  manifest: groups, mean and std over seeds (numpy), report.md, .csv and
  .png, and an unknown metric refused."""
  # Forked with a pre-exec hook, a child of this process (JAX's threads)
  # could deadlock before its exec; launch.sweep's own process has no
  # JAX. That hook (the runs die with their sweep) is test_workdir_faults'.
  monkeypatch.setattr(sweep_runs, '_die_with_parent', None)
  root = str(tmp_path / 'sweep')
  stand_in = tmp_path / 'stand_in.py'
  stand_in.write_text(_STAND_IN)
  accuracy = {(0.05, 0): 0.5, (0.05, 1): 0.75, (0.2, 0): 0.25,
              (0.2, 1): 0.875}
  runs = [sweep_plan.Run(
      name=f'lr={lr},seed={seed}',
      overrides={'optimizer.learning_rate': lr, 'seed': seed},
      workdir=os.path.join(root, f'lr={lr},seed={seed}'),
      argv=('python3', str(stand_in), os.path.join(
          root, f'lr={lr},seed={seed}'), str(value)))
          for (lr, seed), value in accuracy.items()]
  sweep_runs.write_manifest(root, 'cfg.py', 'lr', runs)
  assert sweep_runs.run_local(runs, root, parallel=2) == 0
  lines = capsys.readouterr().out.splitlines()
  for r in runs:
    assert [l for l in lines if l.startswith('[') and r.name in l] == [
        f'[start] {r.name}: {shlex.join(sweep_plan.local_argv(r))}',
        f'[done] {r.name}'], lines
  assert lines[-1] == '4/4 runs finished', lines
  os.remove(os.path.join(runs[1].workdir, 'final_metrics.json'))
  assert sweep_runs.run_local(runs, root, parallel=2) == 0
  out = capsys.readouterr().out
  assert out.count('[skip]') == 3 and '[start]' not in out, out
  assert f'[resume] {runs[1].name}: ' in out, out
  starts = [open(os.path.join(r.workdir, 'starts')).read() for r in runs]
  assert starts == ['x', 'xx', 'x', 'x']

  found = report.write_report([root], 'test_accuracy', root)
  assert found['keys'] == ['optimizer.learning_rate']
  assert found['unfinished'] == []
  assert [g['setting'] for g in found['groups']] == [
      {'optimizer.learning_rate': 0.05}, {'optimizer.learning_rate': 0.2}]
  for group in found['groups']:
    lr = group['setting']['optimizer.learning_rate']
    values = [accuracy[lr, seed] for seed in (0, 1)]
    assert group['n'] == 2
    assert group['mean']['test_accuracy'] == pytest.approx(np.mean(values))
    assert group['std']['test_accuracy'] == pytest.approx(
        np.std(values, ddof=1))
    assert group['mean']['test_loss'] == pytest.approx(1 - np.mean(values))
  _check_report_files(root)
