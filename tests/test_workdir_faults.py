"""Fault injection on a workdir: what an unlucky or careless user does to it.

Each case ends in the right result or in one clear line and a non-zero
exit; nothing in the workdir is lost. The reference is a finished small
run (40 steps, checkpoints at 20 and 40); damaged copies of it must resume
to the same parameters, bit for bit.
"""

import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import digits
from train.jobs import sweep_plan
from train.jobs import sweep_runs
from train.jobs import trainers
from tests import checkpoint_damage
from tests import config_edits
from tests import launch_runs
from train.run import checkpointing
from train.run import disk_space
from train import errors
from train.run import preemption
from train.run import workdir_lock
from train.vision import experiment
from train.vision import trainer

EXIT_USAGE, EXIT_NO_CHECKPOINT, EXIT_DISK_FULL, EXIT_BUSY = 2, 4, 5, 75


# Most tests that compare no state with the reference (signals, sweeps) run
# the MLP of runlocal (Dense-BN-ReLU, sharded over the model axis like the
# CNN): the same loop, checkpoints and launcher at half the CPU per run.
MLP = 'runlocal,model=mlp'


def _config(arg='runlocal', **changes):
  config = digits.get_config(arg)
  for key, value in changes.items():
    config[key] = value
  return config


@pytest.fixture(scope='module')
def reference(digits_runlocal_run):
  """The finished runlocal run (`_config()`), copied before any damage."""
  return digits_runlocal_run


def _copy(source, target, *, keep_steps=(20, 40), final=True):
  shutil.copytree(source, target)
  for step in (20, 40):
    if step not in keep_steps:
      shutil.rmtree(os.path.join(target, 'checkpoints', str(step)))
  if not final:
    os.remove(os.path.join(target, trainer.FINAL_METRICS))
  return str(target)


def _state(workdir, step, arg='runlocal', **changes):
  exp = experiment.build(_config(arg, **changes), workdir)
  with checkpointing.Checkpoints(workdir, every_steps=1, keep=10) as ckpts:
    state, _ = ckpts.restore(step, exp.abstract_state)
  return jax.device_get(state)


def _snapshot(root):
  """Every file's bytes, but the lock's (it names its latest holder)."""
  return checkpoint_damage.snapshot(root, skip=(workdir_lock.LOCK_FILE,))


def _error_line(result) -> str:
  """The run's one `error:` line (asserting there is exactly one, and no
  traceback)."""
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  lines = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


def _read_json(path):
  with open(path) as f:
    return json.load(f)


# --- One run per workdir -----------------------------------------------------

def test_a_second_run_on_a_held_workdir_names_the_holder_and_changes_nothing(
    reference, tmp_path):
  workdir = _copy(reference[0], tmp_path / 'run', final=False)
  holder = launch_runs.hold_workdir(workdir)
  try:
    before = _snapshot(workdir)
    result = launch_runs.run(workdir, '--config.seed=1', timeout=120)
    assert result.returncode == EXIT_BUSY
    line = _error_line(result)
    assert line.startswith(f'error: --workdir={workdir!r}: in use by another '
                           f'run (host {socket.gethostname()}, pid '
                           f'{holder.pid}, started ')
    assert _snapshot(workdir) == before
    assert workdir_lock.holder(workdir)['pid'] == holder.pid
  finally:
    holder.kill()  # kill -9: the kernel drops the lock with the process.
    holder.wait()
  assert workdir_lock.holder(workdir) is None
  result = launch_runs.run(workdir, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (_read_json(os.path.join(workdir, trainer.FINAL_METRICS))
          == reference[1])


def test_a_lock_that_is_a_directory_is_one_line_and_changes_nothing(
    tmp_path):
  # It was an IsADirectoryError traceback.
  os.makedirs(tmp_path / workdir_lock.LOCK_FILE / 'x')
  with pytest.raises(errors.UsageError) as e:
    trainers.train_and_evaluate(_config(), str(tmp_path))
  assert str(e.value) == (
      f'--workdir={str(tmp_path)!r}: its lock file '
      f'{tmp_path / workdir_lock.LOCK_FILE} is a directory, not a file (made '
      'by hand?); move it aside')
  assert sorted(os.listdir(tmp_path)) == [workdir_lock.LOCK_FILE]
  assert os.listdir(tmp_path / workdir_lock.LOCK_FILE) == ['x']


# --- Resume checks the config ------------------------------------------------

# The trainer's refusal, end to end; which changes are refused and how each
# field is named is the core's (test_resume_check).
CHANGES = ({'batch_size': 32, 'optimizer.learning_rate': 0.05},
           ['config.batch_size 64 -> 32',
            'config.optimizer.learning_rate 0.1 -> 0.05'])


def _refusal(workdir, changes) -> str:
  """The UsageError of a run of `_config()` with `changes` on `workdir`, in
  this process: the launcher prints it as its one `error:` line and exits
  2 (test_a_finished_run_is_not_reported_for_another_config runs it)."""
  config = config_edits.apply(_config(), changes)
  with pytest.raises(errors.UsageError) as e:
    trainers.train_and_evaluate(config, workdir)
  text = str(e.value)
  assert '\n' not in text, text
  return text


def test_resume_with_a_changed_config_refuses_naming_each_field(
    reference, tmp_path):
  changes, named = CHANGES
  workdir = _copy(reference[0], tmp_path / 'run', keep_steps=(20,),
                  final=False)
  before = _snapshot(workdir)
  text = _refusal(workdir, changes)
  assert 'holds a run (checkpoint at step 20) with a different config' in text
  listed = text.split('different config: ')[1].split('. These fields')[0]
  assert listed.split('; ') == named
  assert _snapshot(workdir) == before


def test_a_finished_run_is_not_reported_for_another_config(reference,
                                                           tmp_path):
  # Through the launcher: one line and exit 2, no result printed.
  workdir = _copy(reference[0], tmp_path / 'run')
  result = launch_runs.run(workdir, '--config.seed=1', timeout=120)
  assert result.returncode == EXIT_USAGE
  assert 'config.seed 0 -> 1' in _error_line(result)
  assert 'test accuracy' not in result.stdout


def test_num_steps_below_the_latest_checkpoint_is_refused(reference,
                                                          tmp_path):
  workdir = _copy(reference[0], tmp_path / 'run')
  before = _snapshot(workdir)
  assert _refusal(workdir, {'num_steps': 30}).startswith(
      'config.num_steps=30: below the latest checkpoint of '
      f'{workdir} (step 40)')
  assert _snapshot(workdir) == before


@pytest.fixture(scope='module')
def resumed_from_20(reference, tmp_path_factory):
  """(workdir, launcher result) of a copy of the reference whose checkpoint
  at step 40 has a flipped bit, resumed with changes a resume allows: it
  must skip step 40, resume from 20 and end at the reference's parameters.
  One launcher run (7 s of CPU) for the two tests that resume from step 20
  (the allowed changes, the flipped bit), each checking its part."""
  workdir = _copy(reference[0], tmp_path_factory.mktemp('resumed') / 'run',
                  final=False)
  checkpoint_damage.damage('flipped_bit', workdir, 40)
  result = launch_runs.run(workdir, '--config.log_every=5',
                           '--config.eval_every=40',
                           '--config.keep_checkpoints=5', timeout=300)
  return workdir, result


def test_allowed_changes_resume_to_the_same_parameters(reference,
                                                       resumed_from_20):
  workdir, result = resumed_from_20
  assert result.returncode == 0, result.stderr[-3000:]
  checkpoint_damage.assert_same_tree(_state(workdir, 40), _state(reference[0], 40))


# --- Verified checkpoints ----------------------------------------------------


def test_a_flipped_bit_in_the_latest_checkpoint_resumes_bit_exactly(
    reference, resumed_from_20):
  workdir, result = resumed_from_20
  assert result.returncode == 0, result.stderr[-3000:]
  warnings = [l for l in result.stderr.splitlines()
              if 'Skipping the damaged checkpoint at step 40' in l]
  assert len(warnings) == 1
  assert 'Resumed from the checkpoint at step 20' in result.stderr
  checkpoint_damage.assert_same_tree(_state(workdir, 40), _state(reference[0], 40))
  assert (_read_json(os.path.join(workdir, trainer.FINAL_METRICS))
          == reference[1])


def test_no_good_checkpoint_is_one_line_and_changes_nothing(reference,
                                                            tmp_path):
  workdir = _copy(reference[0], tmp_path / 'run', final=False)
  checkpoint_damage.damage('truncated', workdir, 40)
  checkpoint_damage.damage('torn_meta', workdir, 20)
  before = _snapshot(workdir)
  result = launch_runs.run(workdir, timeout=120)
  assert result.returncode == EXIT_NO_CHECKPOINT
  line = _error_line(result)
  assert line.startswith('error: no usable checkpoint in ')
  assert 'step 40: does not load' in line
  assert 'step 20: metadata does not load' in line
  assert _snapshot(workdir) == before


# --- Logs that survive a crash -----------------------------------------------


# Slow: the metrics log cut back to the checkpoint's records and an
# unreadable results file evaluated again without a doubled final record
# are the core's (test_resumable); a damaged line dropped on resume is
# test_metrics_log.
@pytest.mark.slow
def test_torn_metrics_and_final_metrics_are_repaired_on_resume(reference,
                                                               tmp_path):
  workdir = _copy(reference[0], tmp_path / 'run', keep_steps=(20,),
                  final=False)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'ab') as f:
    f.write(b'{"step": 23, "train_lo\xff' + b'\0' * 512)  # Not UTF-8.
  result = launch_runs.run(workdir, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f, open(
      os.path.join(reference[0], 'metrics.jsonl')) as g:
    assert f.read() == g.read()

  final = os.path.join(workdir, trainer.FINAL_METRICS)
  with open(final, 'w') as f:
    f.write('{"step": 40, "test_acc')
  result = launch_runs.run(workdir, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert _read_json(final) == reference[1]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f, open(
      os.path.join(reference[0], 'metrics.jsonl')) as g:
    assert f.read() == g.read()  # The final record is not doubled.


# --- Other inputs --------------------------------------------------------------


def test_an_empty_workdir_is_refused_before_anything_is_written():
  before = sorted(os.listdir(launch_runs.REPO_ROOT))
  result = launch_runs.run('', timeout=120)
  assert result.returncode == EXIT_USAGE
  assert _error_line(result) == (
      "error: --workdir='': empty (an unset variable?); give a directory")
  assert sorted(os.listdir(launch_runs.REPO_ROOT)) == before


@pytest.mark.parametrize('damage', ['truncated', 'garbage'])
def test_a_damaged_data_file_is_one_line_naming_it(reference, tmp_path,
                                                   damage):
  del reference  # Its run built the digits data in $TFDS_DATA_DIR.
  data_dir = str(tmp_path / 'data')
  shutil.copytree(os.path.join(os.environ['TFDS_DATA_DIR'], 'digits'),
                  os.path.join(data_dir, 'digits'))
  victim = next(os.path.join(d, f) for d, _, files in os.walk(data_dir)
                for f in files if f.startswith('digits-train.array_record'))
  if damage == 'truncated':
    os.truncate(victim, os.path.getsize(victim) // 2)
  else:
    with open(victim, 'r+b') as f:
      f.seek(os.path.getsize(victim) // 2)
      f.write(bytes(random.Random(0).randrange(256) for _ in range(4096)))
  workdir = str(tmp_path / 'run')
  want = (f"cannot read digits split 'train': damaged data file(s) {victim} "
          '(')
  if damage == 'truncated':  # Through the launcher: one line, exit 6.
    result = launch_runs.run(workdir, f'--config.data_dir={data_dir}',
                             timeout=120)
    assert result.returncode == errors.DamagedDataFile.exit_code == 6
    assert _error_line(result).startswith('error: ' + want)
  else:  # In this process: the error the launcher prints.
    with pytest.raises(errors.DamagedDataFile) as e:
      trainers.train_and_evaluate(_config(data_dir=data_dir), workdir)
    assert str(e.value).startswith(want) and '\n' not in str(e.value)
  assert not disk_space.completed_steps(os.path.join(workdir, 'checkpoints'))


@pytest.fixture
def small_tmpfs(tmp_path):
  """A 3 MiB tmpfs (about three checkpoints of the small run), if this
  machine lets the tests mount one (root, outside restrictive containers)."""
  mount = tmp_path / 'tmpfs'
  mount.mkdir()
  made = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=3m', 'tmpfs',
                         str(mount)], capture_output=True, check=False)
  if made.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {made.stderr.decode().strip()}')
  yield str(mount)
  subprocess.run(['umount', str(mount)], check=False)


# Slow: a full disk is one error that keeps the checkpoints and resumes
# bit for bit in the core (test_resumable: the toy loop, and a save still
# in flight counted as intact), and one line with exit status 5 from the
# TTA loop end to end (test_tta_loop); this is the real filesystem's.
@pytest.mark.slow
def test_a_full_disk_is_one_line_keeps_the_checkpoints_and_resumes_bit_exactly(
    small_tmpfs, reference):
  # A checkpoint every 5 steps fills the 3 MiB long before step 40; the
  # reference (the same run, saved every 20) has the states to compare.
  overrides = ('--config.checkpoint_every=5', '--config.keep_checkpoints=10')
  changes = dict(checkpoint_every=5, keep_checkpoints=10)
  workdir = os.path.join(small_tmpfs, 'run')
  result = launch_runs.run(workdir, *overrides)
  assert result.returncode == EXIT_DISK_FULL
  line = _error_line(result)
  saved = sorted(int(d) for d in os.listdir(os.path.join(workdir,
                                                         'checkpoints'))
                 if d.isdigit())
  assert saved and saved[-1] < 40
  # The write that finds the disk full is the checkpoint's, or (when a
  # metrics line comes first, as on a loaded machine) one in the workdir.
  assert re.match(rf'error: disk full writing {re.escape(workdir)}'
                  r'(/[\w./-]+)? \(needs about ', line), line
  assert f'checkpoints up to step {saved[-1]} are intact' in line
  for step in saved:  # Each verifies; those the reference holds equal its.
    state = _state(workdir, step, **changes)
    if step in (20, 40):
      checkpoint_damage.assert_same_tree(state, _state(reference[0], step))

  subprocess.run(['mount', '-o', 'remount,size=64m', small_tmpfs], check=True)
  result = launch_runs.run(workdir, *overrides)
  assert result.returncode == 0, result.stderr[-3000:]
  checkpoint_damage.assert_same_tree(_state(workdir, 40, **changes),
                     _state(reference[0], 40))
  assert (_read_json(os.path.join(workdir, trainer.FINAL_METRICS))
          == reference[1])


# --- Signals ------------------------------------------------------------------


def _wait_for(predicate, proc, timeout=240):
  deadline = time.monotonic() + timeout
  while not predicate():
    if proc.poll() is not None:
      raise AssertionError(f'ended early: {proc.communicate()[1][-3000:]}')
    assert time.monotonic() < deadline, 'timed out'
    time.sleep(0.01)


def _checkpoint_steps(workdir):
  path = os.path.join(workdir, 'checkpoints')
  return [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(
      path) else []


def _stopped_at(stderr, name):
  """The step of the run's one `stopped by <name>` line."""
  assert 'Traceback' not in stderr and 'KeyboardInterrupt' not in stderr
  lines = [l for l in stderr.splitlines() if l.startswith('stopped by')]
  assert len(lines) == 1, stderr[-3000:]
  return int(lines[0].split(f'stopped by {name} at step ')[1].split(';')[0])


# Slow: both signals save at their step and resume bit for bit in the
# core (test_resumable); through the launcher, SIGTERM's save and exit 0
# are test_launch_zygote's, and Ctrl-C's save at the stop is the sweep's
# test below.
@pytest.mark.slow
def test_sigterm_and_sigint_save_a_checkpoint_and_exit_0_and_130(tmp_path):
  # SIGTERM (a preemption) exits 0; the same command resumes from its save;
  # SIGINT (Ctrl-C) then exits 130. Each leaves its stop step as the
  # newest checkpoint, restorable and finite. A checkpoint every 5 steps
  # (not 20): each signal comes after the next one, 15 steps sooner.
  workdir = str(tmp_path)
  steps = ('--config.num_steps=100000', '--config.checkpoint_every=5')
  last = 0
  for sig, code in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
    proc = launch_runs.start(workdir, *steps,
                             config=f'configs/digits.py:{MLP}')
    _wait_for(lambda: max(_checkpoint_steps(workdir), default=0) > last,
              proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-3000:]
    step = _stopped_at(stderr, sig.name)
    assert step > last
    if last:
      assert f'Resumed from the checkpoint at step {last}' in stderr
    with checkpointing.Checkpoints(workdir, every_steps=1, keep=10) as ckpts:
      assert ckpts.latest_step() == step
    state = _state(workdir, step, MLP, num_steps=100000,
                   checkpoint_every=5)
    assert int(state.step) == step
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))
    last = step


def test_kill_9_after_a_checkpoint_resumes_bit_exactly(reference, tmp_path):
  workdir = str(tmp_path)
  victim = launch_runs.start(workdir)
  _wait_for(lambda: 20 in _checkpoint_steps(workdir), victim)
  victim.send_signal(signal.SIGKILL)
  victim.communicate()
  assert victim.returncode == -signal.SIGKILL
  assert not os.path.exists(os.path.join(workdir, trainer.FINAL_METRICS))
  resumed = launch_runs.run(workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Resumed from the checkpoint at step' in resumed.stderr
  checkpoint_damage.assert_same_tree(_state(workdir, 40), _state(reference[0], 40))
  for name in ('metrics.jsonl', trainer.FINAL_METRICS):
    with open(os.path.join(workdir, name)) as f, open(
        os.path.join(reference[0], name)) as g:
      assert f.read() == g.read(), name
  assert f"test accuracy: {reference[1]['test_accuracy']:.4f}" in (
      resumed.stdout)


def test_a_stop_between_log_lines_resumes_to_the_same_log(reference,
                                                          tmp_path,
                                                          monkeypatch):
  # Stopped at step 25 (logs every 10, checkpoints every 20): the interval
  # 21..30 straddles the stop, and its logged means must still equal an
  # uninterrupted run's, as must every other line and the parameters.
  workdir = str(tmp_path)
  monkeypatch.setattr(preemption.StopFlag, 'requested',
                      lambda self, step: step == 25)
  with pytest.raises(errors.Preempted, match='at step 25'):
    trainer.train_and_evaluate(_config(), workdir)
  monkeypatch.undo()
  assert trainer.train_and_evaluate(_config(), workdir) == reference[1]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f, open(
      os.path.join(reference[0], 'metrics.jsonl')) as g:
    assert f.read() == g.read()
  checkpoint_damage.assert_same_tree(_state(workdir, 40), _state(reference[0], 40))


def _catches_sigterm(pid) -> bool:
  with open(f'/proc/{pid}/status') as f:
    caught = next(l for l in f if l.startswith('SigCgt:')).split()[1]
  return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not os.path.exists('/proc/self/status'),
                    reason='reads signal dispositions from /proc')
def test_sigterm_during_start_up_is_one_line(tmp_path):
  workdir = str(tmp_path / 'run')
  proc = launch_runs.start(workdir, zygote=False)
  # As soon as the launcher handles SIGTERM: before JAX starts, long before
  # the first step.
  _wait_for(lambda: _catches_sigterm(proc.pid), proc)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM
  assert 'Traceback' not in stderr
  assert [l for l in stderr.splitlines() if l.strip()
          and not l[:1] in 'IWE'] == [
              'stopped by SIGTERM outside the training loop; nothing new to '
              'save. Run the same command again to resume.']
  assert not os.path.exists(os.path.join(workdir, 'checkpoints', '20'))


def _loading_jax(pid) -> bool:
  with open(f'/proc/{pid}/maps') as f:
    return 'jaxlib' in f.read()


@pytest.mark.skipif(not os.path.exists('/proc/self/status'),
                    reason='reads signal dispositions from /proc')
def test_ctrl_c_while_the_launcher_imports_is_one_line(tmp_path):
  # A KeyboardInterrupt traceback of 30 to 70 lines, from inside jax's or
  # TensorFlow's imports.
  workdir = str(tmp_path / 'run')
  proc = launch_runs.start(workdir, zygote=False)
  _wait_for(lambda: _loading_jax(proc.pid), proc)
  assert not _catches_sigterm(proc.pid)  # Its job has not started.
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGINT
  assert stderr.splitlines() == [
      'stopped by SIGINT outside the run (starting up); nothing was '
      'written. Run the same command again.'], stderr
  assert not os.path.exists(workdir)


# --- Sweeps ---------------------------------------------------------------------

_SWEEP_CONFIG = '''
from configs import digits

def get_config(arg=None):
  config = digits.get_config({arg!r})
  config.num_steps = {num_steps}
  config.checkpoint_every = {checkpoint_every}
  return config

def get_sweep(name):
  return [{{'seed': 0}}]
'''


def _sweep(tmp_path, num_steps, checkpoint_every=20, arg=MLP, **kw):
  config = tmp_path / 'sweep_config.py'
  config.write_text(_SWEEP_CONFIG.format(arg=arg, num_steps=num_steps,
                                         checkpoint_every=checkpoint_every))
  root = str(tmp_path / 'sweep')
  # Its progress lines must reach a pipe (`| tee`) as they happen, whether
  # or not the caller's environment unbuffers Python's output.
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}
  proc = subprocess.Popen(
      [sys.executable, '-m', 'launch.sweep', f'--config={config}',
       '--sweep=one', f'--workdir={root}'], cwd=launch_runs.REPO_ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
      **kw)
  return proc, os.path.join(root, 'seed=0')


def _alive(pid) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f'/proc/{pid}/stat') as f:
    return f.read().split(')')[-1].split()[0] != 'Z'


def test_runs_die_with_a_killed_sweep_after_saving(tmp_path):
  # Killed once its run is in the training loop (its first checkpoint).
  proc, run = _sweep(tmp_path, num_steps=100000, checkpoint_every=5)
  _wait_for(lambda: os.path.isdir(os.path.join(run, 'checkpoints', '5')),
            proc)
  child = workdir_lock.holder(run)['pid']
  proc.kill()  # kill -9: the sweep cannot pass anything on itself.
  proc.wait()
  deadline = time.monotonic() + 60
  while _alive(child):
    assert time.monotonic() < deadline, 'the run outlived its sweep'
    time.sleep(0.1)
  with open(os.path.join(tmp_path, 'sweep', 'logs', 'seed=0.log')) as f:
    log = f.read()
  assert 'stopped by SIGTERM at step' in log, log[-3000:]
  assert workdir_lock.holder(run) is None


# A run that only marks itself finished: the sweep's loop below waits on
# the lock, not on a trainer.
_FINISHING_RUN = ('import os, sys\n'
                  "open(os.path.join(sys.argv[1], 'final_metrics.json'), "
                  "'w').write('{}')\n")


def test_the_sweep_loop_waits_for_a_held_run_then_runs_it(tmp_path, capsys,
                                                          monkeypatch):
  # launch.sweep's local loop (sweep_runs.run_local) in this process, on a
  # stand-in run whose workdir another process holds; the relaunched
  # sweep's own process and trainer are the slow test below. No pre-exec
  # hook in a child of this process (JAX's threads: test_sweep).
  monkeypatch.setattr(sweep_runs, '_die_with_parent', None)
  root = str(tmp_path / 'sweep')
  workdir = os.path.join(root, 'seed=0')
  os.makedirs(workdir)
  script = tmp_path / 'finishing_run.py'
  script.write_text(_FINISHING_RUN)
  run = sweep_plan.Run(name='seed=0', overrides={'seed': 0}, workdir=workdir,
                       argv=(sys.executable, str(script), workdir))
  final = os.path.join(workdir, trainer.FINAL_METRICS)
  holder = launch_runs.hold_workdir(workdir)
  failures = []
  loop = threading.Thread(target=lambda: failures.append(
      sweep_runs.run_local([run], root, parallel=1)))
  try:
    loop.start()
    time.sleep(2)  # Ten of the loop's looks at the lock.
    assert loop.is_alive() and not os.path.exists(final)
    out = capsys.readouterr().out
    assert out == (f'[wait] seed=0: workdir in use by pid {holder.pid} on '
                   f'{socket.gethostname()}\n'), out
  finally:
    holder.kill()
    holder.wait()
    loop.join(120)
  assert failures == [0] and os.path.exists(final)
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith('[start] seed=0: ') and lines[1:] == [
      '[done] seed=0', '1/1 runs finished'], lines


# Slow: the waiting is the loop's, tested above on a stand-in run.
@pytest.mark.slow
def test_a_relaunched_sweep_waits_for_a_held_run(tmp_path):
  run = os.path.join(tmp_path, 'sweep', 'seed=0')
  os.makedirs(run)
  holder = launch_runs.hold_workdir(run)
  # 6 steps (runlocal's 5 warm-up steps need one more): the run only has
  # to start after the wait and finish.
  proc, _ = _sweep(tmp_path, num_steps=6)
  try:
    said = select.select([proc.stdout], [], [], 120)[0]
    assert said, 'no [wait] line within 120 s: is the sweep\'s output buffered?'
    line = proc.stdout.readline()
    assert line.startswith(f'[wait] seed=0: workdir in use by pid '
                           f'{holder.pid}'), line
    time.sleep(2)
    assert not os.path.exists(os.path.join(run, 'checkpoints'))
  finally:
    holder.kill()
    holder.wait()
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert '[start] seed=0' in out and '1/1 runs finished' in out


def _interruptible():
  # A shell that starts a job in the background (`cmd &`, as CI scripts
  # may) hands it SIGINT ignored, and Python then never raises
  # KeyboardInterrupt: give the sweep the terminal's default back.
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_a_sweep_reports_the_checkpoints_that_exist(tmp_path):
  # The CNN: the MLP's run could be past its next checkpoint (40) by the
  # time the one at 20 is written, and then `latest > 20` would hold
  # without a save at the stop.
  proc, run = _sweep(tmp_path, num_steps=100000, arg='runlocal',
                     start_new_session=True, preexec_fn=_interruptible)
  _wait_for(lambda: os.path.isdir(os.path.join(run, 'checkpoints', '20')),
            proc)
  os.killpg(proc.pid, signal.SIGINT)  # What Ctrl-C in its terminal does.
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode != 0
  with checkpointing.Checkpoints(run, every_steps=1, keep=10) as ckpts:
    latest = ckpts.latest_step()
  assert latest > 20  # The run saved where it stopped.
  assert (f'[stopped] seed=0: latest checkpoint at step {latest}; a relaunch '
          'resumes it') in out


# --- The clean path under random crashes ----------------------------------------


@pytest.mark.slow  # test_kill_9_after_a_checkpoint_resumes_bit_exactly kills
# once at a known step.
def test_kill_9_at_random_moments_resumes_bit_exactly(tmp_path):
  overrides = ('--config.num_steps=80', '--config.checkpoint_every=5')
  reference = str(tmp_path / 'reference')
  assert launch_runs.run(reference, *overrides).returncode == 0
  workdir = str(tmp_path / 'crashed')
  rng = random.Random(0)
  for _ in range(4):
    proc = launch_runs.start(workdir, *overrides)
    time.sleep(rng.uniform(2.0, 8.0))
    proc.kill()
    proc.communicate()
  result = launch_runs.run(workdir, *overrides)
  assert result.returncode == 0, result.stderr[-3000:]
  changes = dict(num_steps=80, checkpoint_every=5)
  checkpoint_damage.assert_same_tree(_state(workdir, 80, **changes),
                     _state(reference, 80, **changes))
  for name in ('metrics.jsonl', trainer.FINAL_METRICS):
    with open(os.path.join(workdir, name)) as f, open(
        os.path.join(reference, name)) as g:
      assert f.read() == g.read(), name


def test_a_fifo_among_a_sweeps_logs_is_one_line_before_any_run(tmp_path):
  logs = tmp_path / 'sweep' / 'logs'
  logs.mkdir(parents=True)
  os.mkfifo(logs / 'seed=0.log')  # The log its one run would append to.
  proc, workdir = _sweep(tmp_path, num_steps=2)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 2, err[-2000:]
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: ') and (
      'seed=0.log is a FIFO' in lines[0]), lines
  assert not os.path.exists(workdir)
