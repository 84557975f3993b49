"""Multi-host training on loopback: 2 processes x 4 CPU devices against 1 process x 8.

The processes are real `python -m launch.train --multihost` jobs that meet
through `jax.distributed` on 127.0.0.1 and exchange collectives through
gloo, exactly as TPU-pod workers do through their interconnect.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from configs import digits
from tests import launch_runs
from train.run import checkpointing
from train.vision import experiment
from train.vision import trainer

# Different reduction order across processes (gloo) vs inside one process:
# the parameters agree to float32 rounding, accumulated over the steps.
PARAM_ATOL = 2e-5

# The runs compared: runlocal cut to 10 steps, each run writing two
# checkpoints and two log lines. A wrong reduction or data split across
# the processes shows from the first step on, and the pair's steps cost
# far more CPU than one process's (gloo on loopback): the comparison took
# 50 s of CPU at 40 steps, 38 s at 10 (the one-process run included).
COMPARED = {'num_steps': 10, 'log_every': 5, 'eval_every': 5,
            'checkpoint_every': 5}
COMPARED_FLAGS = tuple(f'--config.{k}={v}' for k, v in COMPARED.items())


def _compared_config():
  config = digits.get_config('runlocal')
  for key, value in COMPARED.items():
    config[key] = value
  return config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _start_pair(workdir, *overrides, heartbeat=100,
                config='configs/digits.py:runlocal'):
  port = _free_port()
  env = dict(os.environ)
  # Each process simulates 4 devices (conftest sets 8 for the test process).
  env['XLA_FLAGS'] = ' '.join(
      f for f in env.get('XLA_FLAGS', '').split()
      if not f.startswith('--xla_force_host_platform_device_count'))
  procs = []
  for i in range(2):
    cmd = launch_runs.command(
        workdir, '--config.cpu_devices=4', '--multihost',
        f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
        f'--process_id={i}', f'--heartbeat_timeout_seconds={heartbeat}',
        *overrides, config=config)
    procs.append(subprocess.Popen(cmd, cwd=launch_runs.REPO_ROOT, env=env,
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  return procs


def _finish(procs, timeout=600):
  outs = [p.communicate(timeout=timeout) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [o for o, _ in outs]


def _final_params(workdir, config):
  exp = experiment.build(config, workdir)
  with checkpointing.Checkpoints(workdir, every_steps=1, keep=10,
                                 async_save=False) as ckpts:
    step = ckpts.latest_step()
    state, _ = ckpts.restore(step, exp.abstract_state)
  return step, jax.device_get(state.params)


def _assert_close(a, b):
  worst = 0.0
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=PARAM_ATOL, rtol=0,
                               err_msg=jax.tree_util.keystr(path))
    worst = max(worst, float(np.max(np.abs(x - y))))
  print(f'largest parameter difference: {worst:.2e}')


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The one-process run of `_compared_config()` (in this process, as
  launch.train runs it), and the same config run by two processes; with
  the line launch.train prints for the first."""
  root = tmp_path_factory.mktemp('multihost')
  one = str(root / 'one')
  final = trainer.train_and_evaluate(_compared_config(), one)
  two = str(root / 'two')
  pair_out = _finish(_start_pair(two, *COMPARED_FLAGS))
  single_out = (f'test accuracy: {final["test_accuracy"]:.4f} (test loss '
                f'{final["test_loss"]:.4f}, step {final["step"]}, workdir '
                f'{one})\n')
  return root, one, two, single_out, pair_out


def test_two_processes_train_like_one(runs):
  _, one, two, single_out, pair_out = runs
  config = _compared_config()
  # Both processes report the same final metrics as the single process
  # (printed with 4 digits).
  line = lambda out: out.strip().splitlines()[-1].split(', workdir')[0]
  assert line(pair_out[0]) == line(pair_out[1]) == line(single_out)
  assert line(single_out).startswith('test accuracy: ')
  step_one, params_one = _final_params(one, config)
  step_two, params_two = _final_params(two, config)
  assert step_one == step_two == config.num_steps
  _assert_close(params_two, params_one)


def test_checkpoints_and_logs_are_written_once(runs):
  _, one, two, _, _ = runs
  steps = lambda w: sorted(os.listdir(os.path.join(w, 'checkpoints')))
  assert steps(two) == steps(one)
  # No per-process copies or leftovers beside the step directories.
  assert all(s.isdigit() for s in steps(two)), steps(two)
  records = lambda w: open(os.path.join(w, 'metrics.jsonl')).read()
  assert records(two).count('"train_loss"') == records(one).count(
      '"train_loss"')


@pytest.mark.slow
def test_a_single_process_checkpoint_resumes_on_two_processes(
    runs):
  root, one, _, _, _ = runs
  config = _compared_config()
  resumed = str(root / 'resumed')
  # The 1-process run's mid-run checkpoint, as if that run had stopped there.
  first = sorted(int(s) for s in os.listdir(os.path.join(one, 'checkpoints')))[0]
  os.makedirs(os.path.join(resumed, 'checkpoints'))
  shutil.copytree(os.path.join(one, 'checkpoints', str(first)),
                  os.path.join(resumed, 'checkpoints', str(first)))
  procs = _start_pair(resumed, *COMPARED_FLAGS)
  _finish(procs)
  records = open(os.path.join(resumed, 'metrics.jsonl')).read()
  assert f'"step": {first},' not in records  # Steps after `first` only.
  _, params_resumed = _final_params(resumed, config)
  _, params_one = _final_params(one, config)
  _assert_close(params_resumed, params_one)


# A run that does not end by itself, logging every step: the tests below
# act at its first log line, at step 1 (runlocal's first is at step 10).
# It is runlocal's MLP (Dense-BN-ReLU, sharded over the model axis like the
# CNN): these tests compare no parameters, and its steps cost a third of
# the CNN's. The two tests share their programs (the compile cache).
_ENDLESS_CONFIG = 'runlocal,model=mlp'
_ENDLESS = ('--config.num_steps=100000', '--config.log_every=1')


# The worker's death is this loop's one kill -9 in the default suite.
@pytest.mark.parametrize('victim', [
    pytest.param(1, id='worker'),
    pytest.param(0, marks=pytest.mark.slow, id='coordinator')])
def test_a_dead_process_stops_the_other_with_an_error(tmp_path, victim):
  heartbeat = 10
  survivor = 1 - victim
  procs = _start_pair(str(tmp_path), *_ENDLESS, heartbeat=heartbeat,
                      config=f'configs/digits.py:{_ENDLESS_CONFIG}')
  try:
    # Wait until both train (the first log line), then kill one.
    deadline = time.monotonic() + 300
    while not os.path.exists(tmp_path / 'metrics.jsonl') or os.path.getsize(
        tmp_path / 'metrics.jsonl') == 0:
      assert time.monotonic() < deadline, 'the pair never started training'
      assert procs[0].poll() is None and procs[1].poll() is None
      time.sleep(0.5)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, err = procs[survivor].communicate(timeout=heartbeat * 6 + 60)
    elapsed = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  assert procs[survivor].returncode != 0
  assert elapsed < heartbeat * 6 + 60
  print(f'process {survivor} stopped {elapsed:.1f} s after process {victim} '
        f'died (exit status {procs[survivor].returncode})')
  # JAX's own message, printed before it aborts the process.
  assert re.search(r'Terminating process because the JAX distributed service '
                   r'detected fatal errors|another task died|coordination '
                   r'service', err, re.I), err[-3000:]


def test_sigterm_on_every_worker_saves_one_agreed_step(tmp_path):
  # What a pod's preemption does: SIGTERM to every worker at about once.
  procs = _start_pair(str(tmp_path), *_ENDLESS,
                      config=f'configs/digits.py:{_ENDLESS_CONFIG}')
  try:
    deadline = time.monotonic() + 300
    while not os.path.exists(tmp_path / 'metrics.jsonl') or os.path.getsize(
        tmp_path / 'metrics.jsonl') == 0:
      assert time.monotonic() < deadline, 'the pair never started training'
      time.sleep(0.5)
    for p in procs:
      p.send_signal(signal.SIGTERM)
    errs = [p.communicate(timeout=120)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:]
  stops = [re.search(r'stopped by SIGTERM at step (\d+)', e) for e in errs]
  assert all(stops), errs[0][-2000:]
  step = int(stops[0].group(1))
  assert int(stops[1].group(1)) == step
  config = digits.get_config(_ENDLESS_CONFIG)
  config.num_steps = 100000
  saved, _ = _final_params(str(tmp_path), config)
  assert saved == step


def test_a_held_workdir_stops_every_process_of_a_run_at_once(tmp_path):
  # Process 0 takes the lock for the run and tells the others: none of them
  # may wait at a collective for a process 0 that has gone.
  holder = launch_runs.hold_workdir(str(tmp_path))
  try:
    procs = _start_pair(str(tmp_path))
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    holder.kill()
    holder.wait()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 75, err[-3000:]
    assert 'Traceback' not in err
  assert f'pid {holder.pid}' in outs[0][1]  # Process 0 names the holder.
