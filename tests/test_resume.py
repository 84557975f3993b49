"""Crash and preemption: SIGKILL part-way resumes bit-exactly; SIGTERM saves and exits cleanly."""

import json
import os
import re
import signal
import time

import jax
import numpy as np

from tests import launch_runs
from train import checkpointing
from train.vision import experiment
from train.vision import trainer

# Long enough that a kill after the first checkpoint lands mid-run.
OVERRIDES = ('--config.num_steps=160', '--config.checkpoint_every=20',
             '--config.log_every=10', '--config.eval_every=40')


def _wait_for_checkpoint(proc, workdir, step, timeout=240):
  path = os.path.join(workdir, 'checkpoints', str(step))
  deadline = time.monotonic() + timeout
  while not os.path.isdir(path):
    if proc.poll() is not None:
      raise AssertionError(f'run ended before checkpoint {step}: '
                           f'{proc.communicate()[1][-3000:]}')
    # Drain nothing here: the runs log little before their first checkpoint.
    assert time.monotonic() < deadline, 'no checkpoint in time'
    time.sleep(0.01)


def _config(*overrides):
  from configs import digits  # pylint: disable=g-import-not-at-top
  config = digits.get_config('runlocal')
  for o in overrides:
    key, value = o.removeprefix('--config.').split('=')
    config[key] = int(value)
  return config


def _restore(workdir, step, *overrides):
  exp = experiment.build(_config(*overrides), workdir)
  with checkpointing.Checkpoints(workdir, every_steps=1, keep=10) as ckpts:
    state, meta = ckpts.restore(step, exp.abstract_state)
  return jax.device_get(state), meta


def test_sigkill_then_rerun_ends_bit_identical_to_an_uninterrupted_run(
    tmp_path):
  ref_dir, crash_dir = str(tmp_path / 'ref'), str(tmp_path / 'crash')
  reference = launch_runs.start(ref_dir, *OVERRIDES)
  victim = launch_runs.start(crash_dir, *OVERRIDES)
  _wait_for_checkpoint(victim, crash_dir, 20)
  victim.send_signal(signal.SIGKILL)
  victim.communicate()
  assert victim.returncode == -signal.SIGKILL
  assert not os.path.exists(os.path.join(crash_dir, trainer.FINAL_METRICS))
  ref_out, ref_err = reference.communicate(timeout=300)
  assert reference.returncode == 0, ref_err[-3000:]

  resumed = launch_runs.run(crash_dir, *OVERRIDES)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Resumed from the checkpoint at step' in resumed.stderr

  want, _ = _restore(ref_dir, 160, *OVERRIDES)
  got, _ = _restore(crash_dir, 160, *OVERRIDES)
  leaves_want = jax.tree_util.tree_leaves_with_path(want)
  leaves_got = jax.tree.leaves(got)
  assert len(leaves_want) == len(leaves_got)
  for (path, a), b in zip(leaves_want, leaves_got):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b), jax.tree_util.keystr(path)  # Bit for bit.

  def metrics(d):
    with open(os.path.join(d, 'metrics.jsonl')) as f:
      return [json.loads(line) for line in f]
  assert metrics(crash_dir) == metrics(ref_dir)
  accuracy = lambda out: re.search(r'test accuracy: (\S+)', out).group(1)
  assert accuracy(resumed.stdout) == accuracy(ref_out)
  with open(os.path.join(crash_dir, trainer.FINAL_METRICS)) as f, open(
      os.path.join(ref_dir, trainer.FINAL_METRICS)) as g:
    assert json.load(f) == json.load(g)


def test_sigterm_saves_a_restorable_checkpoint_and_exits_cleanly(tmp_path):
  workdir = str(tmp_path)
  overrides = ('--config.num_steps=100000', '--config.checkpoint_every=20')
  proc = launch_runs.start(workdir, *overrides)
  _wait_for_checkpoint(proc, workdir, 20)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-3000:]
  assert 'Traceback' not in stderr
  line = [l for l in stderr.splitlines() if l.startswith('stopped by SIGTERM')]
  assert len(line) == 1, stderr[-3000:]
  step = int(line[0].split('at step ')[1].split(';')[0])
  assert step >= 20
  with checkpointing.Checkpoints(workdir, every_steps=1, keep=10) as ckpts:
    assert ckpts.latest_step() == step
  state, meta = _restore(workdir, step, *overrides)
  assert int(state.step) == step
  assert 'config' in meta
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))
