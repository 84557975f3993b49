"""`launch.rl --multihost` on loopback: rollout and learner processes of one job.

Each job is 2 or 3 real `python -m launch.rl` processes (4 CPU devices
each) meeting through jax.distributed on 127.0.0.1: processes 0..R-1
generate, the others learn (one, or two: the learner group); weights and
batches cross by `jax.device_put` (train.rl.transport). The one-process runs they are
compared with use 8 devices, 4 of them generating, so that every program
runs on a mesh of the same size either way.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import launch_runs

REPO_ROOT = launch_runs.REPO_ROOT
# GAS's curvature estimate is off: it runs on the learner as in one process
# (test_rl_run's GAS runs compare it), and its compile (9 s on the
# learner, which never writes the compile cache) was a quarter of a run.
GAS = ('--config.scheduler=gas', '--config.gas.latency_source=model',
       '--config.gas.curvature_every=0')
# 6: the kill and SIGTERM tests stop a job once version 2 is saved
# (checkpoint_every=2) and resume it for the rest (8 before).
VERSIONS = 6


@pytest.fixture(scope='module')
def sft_workdir(sft_policy_run):
  return sft_policy_run[0]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _args(workdir, sft_workdir, staleness, *overrides):
  return ['-m', 'launch.rl',
          f'--config=configs/rl.py:runlocal,staleness={staleness}',
          f'--config.sft_workdir={sft_workdir}', f'--workdir={workdir}',
          '--config.difficulties=(1,2)',
          f'--config.num_versions={VERSIONS}', *overrides]


def _config(sft_workdir, staleness, *overrides):
  """What `_args` gives one process (its '--config.a.b=v' flags), as a
  config."""
  # pylint: disable=g-import-not-at-top
  from configs import rl as rl_config
  from tests import config_edits
  # pylint: enable=g-import-not-at-top
  config = rl_config.get_config(f'runlocal,staleness={staleness}')
  config.sft_workdir = str(sft_workdir)
  config.difficulties = (1, 2)
  config.num_versions = VERSIONS
  return config_edits.apply_flags(config, overrides)


def _env():
  env = dict(os.environ, PYTHONFAULTHANDLER='1')
  env['XLA_FLAGS'] = ' '.join(
      f for f in env.get('XLA_FLAGS', '').split()
      if not f.startswith('--xla_force_host_platform_device_count'))
  return env


def _start(workdir, sft_workdir, processes, staleness, *overrides,
           rollouts=None):
  """The job's processes, started (stdout and stderr piped); `rollouts` of
  them generate (default: all but one)."""
  rollouts = processes - 1 if rollouts is None else rollouts
  ports = [_free_port() for _ in range(processes + 1)]
  procs = []
  for i in range(processes):
    cmd = [sys.executable, *_args(
        workdir, sft_workdir, staleness, '--config.cpu_devices=4',
        f'--config.rollout_processes={rollouts}', '--multihost',
        f'--coordinator_address=127.0.0.1:{ports[0]}',
        f'--num_processes={processes}', f'--process_id={i}',
        f'--transfer_address=127.0.0.1:{ports[i + 1]}',
        '--heartbeat_timeout_seconds=60',
        '--config.runtime.peer_timeout=5', *overrides)]
    procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(),
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  return procs


def _finish(procs, timeout=300):
  return launch_runs.communicate_all(procs, timeout)


def _results(workdir):
  with open(os.path.join(workdir, 'results.json')) as f:
    return json.load(f)


def _multi(workdir, sft_workdir, processes, staleness, *overrides,
           rollouts=None):
  ends = _finish(_start(workdir, sft_workdir, processes, staleness,
                        *overrides, rollouts=rollouts))
  for code, _, err in ends:
    assert code == 0, err[-3000:]
  return _results(workdir), ends


_SINGLE = {}


def _single(tmp_path_factory, sft_workdir, staleness, *overrides,
            workdir=False):
  """The one-process deterministic run of the same config (once each):
  its results (and its workdir, with `workdir`)."""
  key = (staleness, overrides)
  if key not in _SINGLE:
    path = tmp_path_factory.mktemp('single')
    # In this process: the reference's policy, curve and histogram are
    # what its process boundary does not change (a launcher's run was 8-11
    # s of CPU, its start a third of it). The multi-process runs are the
    # launcher's.
    # pylint: disable=g-import-not-at-top
    from train.rl import run
    # pylint: enable=g-import-not-at-top
    run.train_and_evaluate(_config(sft_workdir, staleness, *overrides),
                           str(path))
    _SINGLE[key] = (_results(path), path)
  return _SINGLE[key] if workdir else _SINGLE[key][0]


DETERMINISTIC = ('--config.runtime.deterministic=True',)
# The flags of the fixed-s runs here, the learner group's and the kill
# tests': with one flag set, they share one one-process reference run
# (`_single`); the checkpoints change nothing in the policy.
GROUP = DETERMINISTIC + ('--config.checkpoint_every=2',)


# The default suite's multi-process = one process bit for bit: 2 processes
# (1 rollout, 1 learner), fixed s = 2, one job (the learner's kill -9 test,
# which also ends equal to the one-process run, is 3 jobs and slow). The
# others are slow: the same admission and transport with more processes
# or GAS's schedule.
@pytest.mark.parametrize('processes,staleness,scheduler', [
    pytest.param(3, 0, 'gas', marks=pytest.mark.slow),
    pytest.param(2, 2, 'fixed'),
    pytest.param(3, 2, 'fixed', marks=pytest.mark.slow),
    pytest.param(2, 0, 'gas', marks=pytest.mark.slow)])
def test_a_deterministic_run_equals_one_process_bit_for_bit(
    sft_workdir, tmp_path, tmp_path_factory, processes, staleness,
    scheduler):
  extra = (DETERMINISTIC + GAS) if scheduler == 'gas' else GROUP
  multi, ends = _multi(tmp_path / 'multi', sft_workdir, processes,
                       staleness, *extra)
  single = _single(tmp_path_factory, sft_workdir, staleness, *extra)
  assert multi['params_sha256'] == single['params_sha256']
  assert multi['curve'][-1] == {**single['curve'][-1],
                                'wall': multi['curve'][-1]['wall']}
  assert multi['staleness_histogram'] == single['staleness_histogram']
  # Every batch came from a rollout process, none from the learner.
  sent = [int(out.split('sent ')[1].split()[0]) for _, out, _ in ends[:-1]]
  assert sum(sent) >= VERSIONS
  # Nothing of the run in the rollout processes' output but their line.
  assert all(out.startswith('rollout process') for _, out, _ in ends[:-1])


@pytest.mark.slow
def test_a_free_run_keeps_its_staleness_bound_on_three_processes(
    sft_workdir, tmp_path):
  results, _ = _multi(tmp_path, sft_workdir, 3, 1)
  histogram = {int(k): n for k, n in results['staleness_histogram'].items()}
  assert max(histogram) <= 1 and sum(histogram.values()) == VERSIONS


def _latest_checkpoint(workdir) -> int:
  path = os.path.join(workdir, 'checkpoints')
  return max((int(d) for d in (os.listdir(path) if os.path.isdir(path)
                               else ()) if d.isdigit()), default=-1)


def _wait_for_version_2(procs, workdir):
  """Until the job saved version 2; on a failure or a hang, the stacks of
  every process (faulthandler) in the test's failure."""
  deadline = time.monotonic() + 240
  while _latest_checkpoint(workdir) < 2:
    if time.monotonic() > deadline or any(p.poll() is not None
                                          for p in procs):
      for p in procs:
        if p.poll() is None:
          p.send_signal(signal.SIGABRT)  # faulthandler prints the stacks.
      time.sleep(2)
      ends = _finish(procs, timeout=30)
      pytest.fail('no checkpoint: ' + '\n'.join(
          f'--- process {i} exit {code}:\n{err[-6000:]}'
          for i, (code, _, err) in enumerate(ends)))
    time.sleep(0.05)


def _kill_9_after_a_checkpoint(procs, workdir, victim: int, role: str,
                               group: tuple[int, ...] = ()):
  """Kills process `victim` once version 2 is saved; checks that the others
  stop in one line naming it, exit 1 and keep the checkpoint. A process of
  `group` (the victim's learner group, which sums with it through gloo)
  may instead end by SIGABRT before the heartbeat names the victim: seen
  once in about ten runs, under the full suite's load, with nothing but
  "Fatal Python error: Aborted" from it (our reading: gloo aborting on the
  closed connection of a sum under way). Another process must still say
  so in one line."""
  _wait_for_version_2(procs, workdir)
  procs[victim].send_signal(signal.SIGKILL)
  ends = _finish([p for i, p in enumerate(procs) if i != victim])
  reported = [line for code, _, err in ends for line in err.splitlines()
              if line.startswith(f'error: process {victim} ({role}) stopped '
                                 'responding')]
  # The process that found it first says so in one line and exits 1; any
  # other ends as soon as it learns the job stopped.
  assert reported, ends[0][2][-3000:]
  assert reported[0].endswith(
      's ago; stopping the job. The checkpoints written so far are intact: '
      'run the same command on every process to resume.')
  others = [i for i in range(len(procs)) if i != victim]
  assert all(code == 1 or (code == -signal.SIGABRT and i in group)
             for i, (code, _, _) in zip(others, ends)), [
                 (code, [l[:100] for l in err.splitlines() if 'rror' in l][-3:])
                 for code, _, err in ends]
  assert _latest_checkpoint(workdir) >= 2


# Process 0 is excluded: jax.distributed's coordination service runs in it,
# and its death ends every other process at once with JAX's own message
# (test_multihost checks that one for launch.train).
# Both slow (3 jobs each): the default suite stops a job and resumes it
# exactly (the follower's SIGTERM test), compares a multi-process run with
# one process bit for bit (above), and refuses the other back-end's
# checkpoints in the run core (test_a_checkpoint_..._other_kind_of_run).
@pytest.mark.parametrize('processes,victim', [
    pytest.param(3, 1, marks=pytest.mark.slow, id='rollout'),
    pytest.param(2, 1, marks=pytest.mark.slow, id='learner')])
def test_kill_9_of_a_process_stops_the_job_in_one_line_and_it_resumes(
    sft_workdir, tmp_path, tmp_path_factory, processes, victim):
  extra = GROUP
  workdir = tmp_path / 'run'
  procs = _start(workdir, sft_workdir, processes, 2, *extra)
  role = 'learner' if victim == processes - 1 else 'rollout'
  _kill_9_after_a_checkpoint(procs, workdir, victim, role)
  # Resumed on the other split (3 -> 2 processes, 2 -> 3): the learner's
  # checkpoint holds whole arrays and no rollout process keeps state.
  resumed, ends = _multi(workdir, sft_workdir, 5 - processes, 2, *extra)
  single, single_workdir = _single(tmp_path_factory, sft_workdir, 2, *extra,
                                   workdir=True)
  assert resumed['params_sha256'] == single['params_sha256']
  assert resumed['versions'] == VERSIONS
  assert resumed['curve'][-1] == {**single['curve'][-1],
                                  'wall': resumed['curve'][-1]['wall']}
  # The batches after the resume came from rollout processes, which print
  # nothing of the run but their line.
  sent = [int(out.split('sent ')[1].split()[0]) for _, out, _ in ends[:-1]]
  assert sum(sent) >= 1
  assert all(out.startswith('rollout process') for _, out, _ in ends[:-1])
  if processes == 2:
    # The one-process run's workdir is not resumed by a multi-process job.
    refused = _finish(_start(single_workdir, sft_workdir, 2, 2, *extra))
    learner_err = refused[-1][2]
    assert refused[-1][0] == 2, learner_err[-2000:]
    assert learner_err.strip().splitlines()[-1].startswith(
        'error: config.rollout_processes=1: ') and 'one-process run' in (
            learner_err), learner_err[-2000:]
    # The rollout process ends as the learner did, in one line naming it.
    assert refused[0][0] == 2, refused[0][2][-2000:]
    assert launch_runs.error_lines(subprocess.CompletedProcess(
        [], 2, '', refused[0][2])) == [
            'error: process 1 (learner) stopped the job: '
            + learner_err.strip().splitlines()[-1][len('error: '):]]
    assert _results(single_workdir) == single
  # One process does not read a multi-process run's checkpoints, nor the
  # other way round: one line each, nothing changed.
  before = sorted(os.listdir(workdir / 'checkpoints'))
  proc = subprocess.run(
      [sys.executable, *_args(workdir, sft_workdir, 2, *extra)],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(
      'error: config.rollout_processes=None: ') and 'multi-process run' in (
          proc.stderr), proc.stderr[-2000:]
  assert sorted(os.listdir(workdir / 'checkpoints')) == before


def _train_metrics(workdir) -> dict[int, dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {r['step']: r for r in map(json.loads, f) if 'train/loss' in r}


# 1 rollout + 2 learner processes, deterministic, s = 2 (flags: GROUP).
_GROUP = {}


def _group(tmp_path_factory, sft_workdir):
  """The uninterrupted run of 1 rollout + 2 learner processes (once): its
  results and the processes' ends."""
  if not _GROUP:
    _GROUP['workdir'] = tmp_path_factory.mktemp('group')
    _GROUP['run'] = _multi(_GROUP['workdir'], sft_workdir, 3, 2, *GROUP,
                           rollouts=1)
  return _GROUP['run']


def test_a_learner_over_two_processes_trains_like_one(sft_workdir,
                                                      tmp_path_factory):
  """1 rollout + 2 learner processes: each update spans both learners."""
  extra = GROUP
  whole, ends = _group(tmp_path_factory, sft_workdir)
  # Their last line (gloo, the collectives on CPU, prints to stdout too).
  assert ends[2][1].splitlines()[-1].startswith(
      f'learner process 2: joined {VERSIONS} updates'), ends[2][1][-2000:]
  assert ends[0][1].splitlines()[-1].startswith('rollout process 0: sent ')
  # The group's sums cross processes (another order than one process
  # adds in): the same run as one learner process to rounding.
  single, single_workdir = _single(tmp_path_factory, sft_workdir, 2, *extra,
                                   workdir=True)
  assert whole['params_sha256'] != single['params_sha256']
  mine, theirs = _train_metrics(_GROUP['workdir']), _train_metrics(
      single_workdir)
  assert sorted(mine) == sorted(theirs) == list(range(1, VERSIONS + 1))
  for step, row in mine.items():
    other = theirs[step]
    assert row['reward'] == other['reward'], step  # The same samples.
    assert row['train/grad_norm'] == pytest.approx(
        other['train/grad_norm'], rel=1e-4), step
    assert row['train/loss'] == pytest.approx(other['train/loss'],
                                              abs=1e-5), step
  assert whole['staleness_histogram'] == single['staleness_histogram']


def test_a_checkpoint_is_refused_by_the_other_kind_of_run(
    sft_workdir, tmp_path_factory):
  """A one-process run's workdir (Orbax checkpoints) is not resumed by a
  multi-process learner, nor a multi-process run's (local checkpoints) by
  one process: one line each, nothing changed. The run core's check on
  the module's two finished runs (the learner's kill -9 test, slow, sees
  the same lines from the launchers)."""
  # pylint: disable=g-import-not-at-top
  from train import errors
  from train.rl import run
  from train.rl import settings
  from train.run import workdir_run
  # pylint: enable=g-import-not-at-top
  single, single_workdir = _single(tmp_path_factory, sft_workdir, 2, *GROUP,
                                   workdir=True)
  _group(tmp_path_factory, sft_workdir)
  multi_workdir = _GROUP['workdir']
  listing = lambda w: sorted(os.listdir(os.path.join(w, 'checkpoints')))
  before = listing(single_workdir), listing(multi_workdir)
  learner = _config(sft_workdir, 2, *GROUP, '--config.rollout_processes=1')
  with pytest.raises(errors.UsageError) as e:
    workdir_run.check_backend(learner, str(single_workdir), settings.SPLIT,
                              part=True)
  assert str(e.value) == (
      f'config.rollout_processes=1: {single_workdir} holds the checkpoints '
      'of a one-process run; resume it with one process (no --multihost), '
      'or give a new workdir'), str(e.value)
  with pytest.raises(errors.UsageError) as e:
    run.train_and_evaluate(_config(sft_workdir, 2, *GROUP),
                           str(multi_workdir))
  assert str(e.value).startswith(
      f'config.rollout_processes=None: {multi_workdir} holds the '
      'checkpoints of a multi-process run (launch.rl --multihost); '), str(
          e.value)
  assert '\n' not in str(e.value)
  assert (listing(single_workdir), listing(multi_workdir)) == before
  assert _results(single_workdir) == single


# Slow: the follower's SIGTERM test below stops and resumes this split
# exactly (a kill -9 of an RL process is in `make test-all` only: the
# kill tests above are slow too).
@pytest.mark.slow
def test_kill_9_of_a_follower_stops_the_job_and_the_split_resumes_exactly(
    sft_workdir, tmp_path, tmp_path_factory):
  # Kill -9 of the follower in the middle of the run: one line, nothing
  # lost; the same split resumes to the uninterrupted run's policy.
  whole, _ = _group(tmp_path_factory, sft_workdir)
  workdir = tmp_path / 'killed'
  _kill_9_after_a_checkpoint(
      _start(workdir, sft_workdir, 3, 2, *GROUP, rollouts=1), workdir, 2,
      'learner', group=(1,))
  resumed, _ = _multi(workdir, sft_workdir, 3, 2, *GROUP, rollouts=1)
  assert resumed['params_sha256'] == whole['params_sha256']
  assert resumed['curve'][-1] == {**whole['curve'][-1],
                                  'wall': resumed['curve'][-1]['wall']}


def test_sigterm_to_a_follower_stops_the_job_saved_and_it_resumes_exactly(
    sft_workdir, tmp_path, tmp_path_factory):
  """SIGTERM to the learner that follows the lead (process 2 of 1 rollout
  + 2 learner processes): it tells the lead, which saves at the end of its
  step; every process then exits 0 (SIGTERM is how schedulers preempt)
  with the lead's one line, and the same command resumes exactly."""
  workdir = tmp_path / 'stopped'
  procs = _start(workdir, sft_workdir, 3, 2, *GROUP, rollouts=1)
  _wait_for_version_2(procs, workdir)
  procs[2].send_signal(signal.SIGTERM)
  ends = _finish(procs)
  assert [code for code, _, _ in ends] == [0, 0, 0], [
      err[-2000:] for _, _, err in ends]
  step = _latest_checkpoint(workdir)
  assert 2 <= step < VERSIONS
  line = (f'stopped by SIGTERM at step {step}; checkpoint saved. Run the '
          'same command again to resume.')
  assert [err.strip().splitlines()[-1] for _, _, err in ends] == [line] * 3
  resumed, _ = _multi(workdir, sft_workdir, 3, 2, *GROUP, rollouts=1)
  whole, _ = _group(tmp_path_factory, sft_workdir)
  assert resumed['params_sha256'] == whole['params_sha256']
  assert resumed['curve'][-1] == {**whole['curve'][-1],
                                  'wall': resumed['curve'][-1]['wall']}
  records = [json.loads(l)['step']
             for l in open(workdir / 'metrics.jsonl')]
  assert records == sorted(set(records))  # No record twice after the resume.


def test_a_bucket_url_workdir_is_refused_before_anything_is_written():
  # pylint: disable=g-import-not-at-top
  from train.errors import UsageError
  from train.rl import settings
  from train.run import workdir_path
  with pytest.raises(UsageError, match=r"^--workdir='gs://b/rl': the "
                     'learner of a multi-process run writes its '
                     'checkpoints alone'):
    workdir_path.check_local('gs://b/rl', settings.SPLIT.holder)
  workdir_path.check_local('/tmp/rl', settings.SPLIT.holder)


def test_a_refusal_ends_every_process_with_its_code_and_line(
    sft_workdir, tmp_path):
  # The learner (process 1) finds the workdir held: the rollout process
  # ends as it does, before either read or wrote anything.
  holder = launch_runs.hold_workdir(str(tmp_path))
  try:
    ends = _finish(_start(tmp_path, sft_workdir, 2, 0), timeout=120)
  finally:
    holder.kill()
    holder.wait()
  busy = f"--workdir='{tmp_path}': in use by another run (host "
  lines = [[l for l in err.splitlines() if l.strip()] for _, _, err in ends]
  assert [code for code, _, _ in ends] == [75, 75], lines
  assert [len(l) for l in lines] == [1, 1], lines
  assert lines[1][0].startswith(f'error: {busy}'), lines
  assert lines[0][0].startswith(
      f'error: process 1 (learner) stopped the job: {busy}'), lines
  assert os.listdir(tmp_path) == ['.lock']
