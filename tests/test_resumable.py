"""The resumable-run core (`train.run.resumable`), on a toy loop.

The guarantees every loop (train, TTA, RL) gets from the core are tested
here once; each loop keeps one end-to-end kill-and-resume test of its own
(test_workdir_faults, test_tta_loop, test_rl_run). The toy loop is a
jitted recurrence on a 4-vector, so a run takes milliseconds and a resumed
run can be compared bit for bit with an uninterrupted one.
"""

import functools
import hashlib
import json
import os
import signal
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests import full_disk
from train.run import checkpointing
from train.run import disk_space
from train import errors
from train.run import local_checkpoints
from train.run import preemption
from train.run import resumable
from train.run import resume_check
from train.run import workdir_lock
from train.errors import NonFiniteLossError, Preempted

MAY_CHANGE = ('log_every', 'checkpoint_every', 'keep_checkpoints')
TOTAL = 10


def _config(**changes) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(dict(
      task='toy', rate=0.5, num_steps=TOTAL, checkpoint_every=3,
      keep_checkpoints=10, log_every=1, blow_up_at=-1))
  config.update(changes)
  return config


@functools.partial(jax.jit, static_argnums=2)
def _step(w, step, blow_up_at):
  w = w * 0.75 + jnp.sin(step * jnp.arange(1.0, 5.0, dtype=jnp.float32))
  return jnp.where(step == blow_up_at, jnp.inf, w)


_finite = jax.jit(lambda tree: jnp.all(jnp.isfinite(tree['w'])))


def _sha(w) -> str:
  return hashlib.sha256(np.asarray(w).tobytes()).hexdigest()


class _Crash(Exception):
  """A stand-in for a process killed after a step."""


# The checkpoint class toy runs use (the `backend` fixture sets it).
_BACKEND = [checkpointing.Checkpoints]


@pytest.fixture(params=['orbax', 'local'])
def backend(request):
  """Runs the test on Orbax's checkpoints and on the local ones (a run on
  part of a multi-process job)."""
  _BACKEND[0] = (checkpointing.Checkpoints if request.param == 'orbax'
                 else local_checkpoints.LocalCheckpoints)
  yield request.param
  _BACKEND[0] = checkpointing.Checkpoints


def toy_run(workdir, config, *, inputs=None, events=None, after_step=None):
  """The toy loop on the core. `events` records what the loop did beyond
  the core ('loaded': its data; 'step k'); `after_step(k)` runs after
  step k's log line (raise `_Crash` to kill the run there)."""
  events = [] if events is None else events
  check = functools.partial(resume_check.check_task, config, str(workdir),
                            task='toy', what='a toy run',
                            may_change=MAY_CHANGE)
  with resumable.open_run(config, str(workdir), check_config=check,
                          results_name='results.json',
                          checkpoints=_BACKEND[0]) as run:
    if inputs:
      run.pin(inputs)
    done = run.finished(config.num_steps)
    if done is not None:
      return done
    events.append('loaded')
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    found = run.restore({'w': jax.ShapeDtypeStruct((4,), jnp.float32,
                                                   sharding=sharding)})
    start, w = 0, jnp.zeros(4, jnp.float32)
    if found is not None:
      start, tree, meta = found
      w = tree['w']
      assert meta['note'] == start  # The loop's own metadata comes back.
    run.finite = resumable.Finite(_finite, 'toy state', can_skip=False)
    with run.stopping():
      for step in range(start + 1, config.num_steps + 1):
        w = _step(w, step, config.blow_up_at)
        events.append(f'step {step}')
        run.writer.write(step, {'w0': float(w[0])})
        if after_step is not None:
          after_step(step)
        run.end_step(step, lambda: ({'w': w}, {'note': step}))
    # A record after the last save, as the trainer's final evaluation.
    run.writer.write(config.num_steps, {'final_w0': float(w[0])})
    return run.finish({'sha': _sha(w), 'steps': config.num_steps},
                      lambda: ({'w': w}, {'note': config.num_steps}))


def _steps_saved(workdir) -> list[int]:
  directory = os.path.join(workdir, 'checkpoints')
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _logged_steps(workdir) -> list[int]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line)['step'] for line in f]


@pytest.fixture(autouse=True)
def _fresh_stop_state(monkeypatch):
  # A handled stop marks the process as stopping for good (later signals
  # are ignored so the save completes); each test starts afresh.
  monkeypatch.setattr(preemption, '_STOPPING', threading.Event())
  monkeypatch.setattr(preemption, '_PENDING', [])


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """An uninterrupted run's results and log."""
  workdir = tmp_path_factory.mktemp('reference')
  results = toy_run(workdir, _config())
  return results, _logged_steps(workdir)


def _crash_at(n):
  def after_step(step):
    if step == n:
      raise _Crash(step)
  return after_step


def test_a_crashed_run_resumes_bit_exactly_and_logs_each_step_once(
    reference, tmp_path, backend):
  with pytest.raises(_Crash):
    toy_run(tmp_path, _config(), after_step=_crash_at(8))
  assert _steps_saved(tmp_path) == [3, 6]
  assert _logged_steps(tmp_path) == list(range(1, 9))
  events = []
  assert toy_run(tmp_path, _config(), events=events) == reference[0]
  assert events[:2] == ['loaded', 'step 7']  # From the checkpoint at 6.
  assert _logged_steps(tmp_path) == reference[1] == list(range(1, 11)) + [10]
  assert _steps_saved(tmp_path) == [3, 6, 9, 10]


def test_a_finished_run_returns_its_results_and_loads_nothing(reference,
                                                             tmp_path, backend):
  toy_run(tmp_path, _config())
  before = open(os.path.join(tmp_path, 'metrics.jsonl')).read()
  events = []
  assert toy_run(tmp_path, _config(), events=events) == reference[0]
  assert not events
  assert open(os.path.join(tmp_path, 'metrics.jsonl')).read() == before


def test_a_changed_config_is_refused_before_anything_loads(tmp_path):
  with pytest.raises(_Crash):
    toy_run(tmp_path, _config(), after_step=_crash_at(4))
  log = open(os.path.join(tmp_path, 'metrics.jsonl')).read()
  events = []
  with pytest.raises(resume_check.ConfigChanged, match='rate'):
    toy_run(tmp_path, _config(rate=0.25), events=events)
  assert not events
  assert open(os.path.join(tmp_path, 'metrics.jsonl')).read() == log
  # A field that only changes how the run is recorded may change.
  assert toy_run(tmp_path, _config(checkpoint_every=4))['steps'] == TOTAL


def test_a_pinned_input_that_changed_is_refused_on_resume_and_rerun(
    tmp_path):
  old, new = {'config.source': 'sha256:' + 'a' * 64}, {
      'config.source': 'sha256:' + 'b' * 64}
  with pytest.raises(_Crash):
    toy_run(tmp_path, _config(), inputs=old, after_step=_crash_at(4))
  for _ in range(2):  # Resuming, then rerunning the finished run.
    events = []
    with pytest.raises(errors.UsageError) as e:
      toy_run(tmp_path, _config(), inputs=new, events=events)
    assert 'sha256:aaaaaaaaaaaa' in str(e.value)
    assert 'sha256:bbbbbbbbbbbb' in str(e.value)
    assert events in ([], ['loaded'])  # Refused before any step.
    toy_run(tmp_path, _config(), inputs=old)


def test_a_second_run_on_a_held_workdir_is_refused(tmp_path):
  def second_run(step):
    if step == 2:
      with pytest.raises(workdir_lock.WorkdirBusy):
        toy_run(tmp_path, _config())
  assert toy_run(tmp_path, _config(), after_step=second_run)['steps'] == TOTAL


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_saves_at_that_step_and_resumes_bit_exactly(
    reference, tmp_path, signum, backend):
  def stop(step):
    if step == 4:
      signal.raise_signal(signum)  # To this thread: handled before step 5.
  with pytest.raises(Preempted) as e:
    toy_run(tmp_path, _config(), after_step=stop)
  assert e.value.step == 4
  assert e.value.signal_name == signal.Signals(signum).name
  assert _steps_saved(tmp_path) == [3, 4]
  assert toy_run(tmp_path, _config()) == reference[0]


def test_a_stop_at_the_last_step_finishes_the_run(reference, tmp_path):
  def stop(step):
    if step == TOTAL:
      os.kill(os.getpid(), signal.SIGTERM)
  assert toy_run(tmp_path, _config(), after_step=stop) == reference[0]


def test_a_non_finite_state_is_never_saved(tmp_path, backend):
  with pytest.raises(NonFiniteLossError) as e:
    toy_run(tmp_path, _config(blow_up_at=5))
  # Found at the save of step 6; the last good checkpoint is 3's.
  assert e.value.step == 6 and e.value.last_checkpoint == 3
  assert 'non-finite toy state at step 6' in str(e.value)
  assert _steps_saved(tmp_path) == [3]


def test_a_damaged_newest_checkpoint_falls_back_and_resumes_bit_exactly(
    reference, tmp_path, backend):
  with pytest.raises(_Crash):
    toy_run(tmp_path, _config(), after_step=_crash_at(7))
  step_dir = os.path.join(tmp_path, 'checkpoints', '6')
  if backend == 'local':
    path = os.path.join(step_dir, local_checkpoints.ARRAYS)
    os.truncate(path, os.path.getsize(path) // 3)
  for root, _, files in os.walk(os.path.join(step_dir, 'state')):
    for name in files:
      if name != '_METADATA' and not name.startswith('_'):
        path = os.path.join(root, name)
        os.truncate(path, os.path.getsize(path) // 3)
  events = []
  assert toy_run(tmp_path, _config(), events=events) == reference[0]
  assert events[1] == 'step 4'  # From the checkpoint at 3.
  assert _logged_steps(tmp_path) == reference[1]


def test_a_full_disk_is_one_error_and_the_checkpoints_stay(
    reference, tmp_path, monkeypatch, backend):
  full_disk.on_metrics_write(monkeypatch, 'metrics.jsonl', 8)
  with pytest.raises(errors.DiskFull) as e:
    toy_run(tmp_path, _config())
  assert 'checkpoints up to step 6 are intact' in str(e.value)
  monkeypatch.undo()
  assert toy_run(tmp_path, _config()) == reference[0]


def test_a_full_disk_counts_a_save_still_in_flight_as_intact(tmp_path,
                                                             monkeypatch):
  # The save of step 1 is asynchronous; the disk is found full when step 2
  # starts, before step 1's directory is renamed into place. The message
  # must count step 1, which is (and stays) intact.
  ckpts = checkpointing.Checkpoints(str(tmp_path), every_steps=1, keep=5)
  state = {'w': jnp.arange(4 << 20, dtype=jnp.float32)}  # 16 MB to write.
  assert ckpts.save(1, state, {})
  monkeypatch.setattr(disk_space, 'free_bytes', lambda path: 0)
  with pytest.raises(errors.DiskFull) as e:
    ckpts.save(2, state, {})
  assert 'checkpoints up to step 1 are intact' in str(e.value)
  monkeypatch.undo()
  restored, _ = ckpts.restore(1, state)
  np.testing.assert_array_equal(restored['w'], state['w'])
  ckpts.close()


def test_a_run_of_no_steps_saves_once_and_is_finished(tmp_path):
  results = toy_run(tmp_path, _config(num_steps=0))
  assert _steps_saved(tmp_path) == [0]
  events = []
  assert toy_run(tmp_path, _config(num_steps=0), events=events) == results
  assert not events


def test_unreadable_results_are_computed_again(reference, tmp_path):
  toy_run(tmp_path, _config())
  with open(os.path.join(tmp_path, 'results.json'), 'w') as f:
    f.write('{"sha": ')
  events = []
  assert toy_run(tmp_path, _config(), events=events) == reference[0]
  assert events == ['loaded']  # Restored at the end; nothing retrained.
  # The record written after the last save is not doubled.
  assert _logged_steps(tmp_path) == reference[1]
