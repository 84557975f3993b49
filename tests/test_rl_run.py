"""The RL job: synchronous mode = a plain GRPO loop bit for bit, the
staleness bound, resume after SIGTERM and kill -9, and one-line errors."""

import copy
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import rl as rl_config
from configs import rl_sft as sft_config
from geom import gas
from train.jobs import trainers
from tests import config_edits
from tests import full_disk
from tests import launch_runs
from tests.conftest import REPO_ROOT
from tests.conftest import SFT_POLICY_OVERRIDES
from train.run import checksums
from train.run.workdir_lock import WorkdirBusy
from train import errors
from train.rl import batches
from train.rl import learner
from train.rl import rollout
from train.rl import run
from train.rl import runtime
from train.rl import scheduler
from train.rl import sft
from train.rl import tasks


@pytest.fixture(scope='module')
def sft_workdir(sft_policy_run):
  workdir = sft_policy_run[0]
  # The warm start answers some one- and two-digit sums, so groups disagree
  # and the updates are not zero.
  with open(os.path.join(workdir, sft.PASS_AT_1)) as f:
    assert 0.1 < json.load(f)['add_d1']
  return workdir


def _config(sft_workdir, **runtime_fields):
  config = rl_config.get_config('runlocal')
  config.sft_workdir = sft_workdir
  # One and two digits: the warm start solves some, so groups disagree
  # and the updates are not zero.
  config.difficulties = (1, 2)
  config.runtime.update(runtime_fields)
  return config


def _plain_grpo(config) -> str:
  """Sequential GRPO from the same parts, no threads: generate batch k
  with version k, update, repeat."""
  _, model, params, _ = sft.load_policy(config.sft_workdir)
  rollout_mesh, learner_mesh = runtime.split_devices(config.rollout_devices)
  learner_repl = NamedSharding(learner_mesh, P())
  tx = run.optimizer(config)
  update = learner.make_update(model, tx, run.loss_settings(config))
  params = jax.device_put(params, learner_repl)
  reference = params
  opt_state = jax.device_put(tx.init(params), learner_repl)
  length = run.sequence_length(config)
  for k in range(config.num_versions):
    difficulty, problems = run.batch_problems(config, k)
    out = rollout.sample(
        model, jax.device_put(params, NamedSharding(rollout_mesh, P())),
        problems, jax.random.fold_in(jax.random.key(config.seed), k),
        temperature=config.temperature,
        num_steps=tasks.max_answer_tokens(config.family, difficulty),
        sharding=NamedSharding(rollout_mesh, P('data')))
    batch = jax.device_put(learner.assemble(out, config.grpo.group_size,
                                            length),
                           NamedSharding(learner_mesh, P('data')))
    params, opt_state, _ = update(params, opt_state, batch, reference)
  return run.fingerprint(params)


def _grad_norms(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [r['train/grad_norm'] for r in map(json.loads, f)
            if 'train/grad_norm' in r]


@pytest.fixture(scope='module')
def synchronous_run(sft_workdir, tmp_path_factory):
  """(config, workdir, results) of a synchronous run (s = 0, two actors) of
  8 versions, run once: the plain loop's match below, the synchronous
  run the asynchronous ones must differ from (8 versions as theirs; 6
  before, which nothing here depends on), and the finished run (copied)
  that test_a_held_workdir_a_changed_config_or_policy_are_refused
  resumes."""
  config = _config(sft_workdir, max_staleness=0, num_actors=2)
  config.num_versions = 8
  workdir = tmp_path_factory.mktemp('synchronous') / 'rl'
  return config, workdir, run.train_and_evaluate(config, str(workdir))


def test_synchronous_mode_is_the_plain_grpo_loop_bit_for_bit(sft_workdir,
                                                             synchronous_run):
  config, workdir, results = synchronous_run
  assert results['params_sha256'] == _plain_grpo(config)
  sft_params = sft.load_policy(sft_workdir).params
  assert results['params_sha256'] != run.fingerprint(sft_params)
  assert max(_grad_norms(workdir)) > 0
  assert results['staleness_histogram'] == {'0': config.num_versions}
  assert sum(results['difficulty_mix'].values()) == config.num_versions
  assert os.path.getsize(workdir / run.PLOT) > 0


@pytest.fixture(scope='module')
def deterministic_run(sft_workdir, tmp_path_factory):
  """(config, workdir, results) of the deterministic run with s = 2 (two
  actors, 8 versions) that `_launch` starts, run once in this process:
  the first of the two runs that must repeat below, and the uninterrupted
  run the launcher's stopped, killed and resumed one must equal."""
  config = _launched_config(sft_workdir)
  workdir = tmp_path_factory.mktemp('deterministic') / 'rl'
  return config, workdir, run.train_and_evaluate(config, str(workdir))


def test_async_runs_respect_the_bound_and_deterministic_ones_repeat(
    tmp_path, synchronous_run, deterministic_run):
  config, _, a = deterministic_run
  assert config.runtime.max_staleness == 2 and config.runtime.num_actors == 2
  assert config.runtime.deterministic
  b = run.train_and_evaluate(config, str(tmp_path / 'b'))
  assert a['params_sha256'] == b['params_sha256']
  # Batch k on version max(0, k - 2): staleness 0, 1, then 2 from k = 2.
  assert a['staleness_histogram'] == {'0': 1, '1': 1, '2': 6}
  sync, _, synchronous = synchronous_run  # The same config, s = 0.
  assert sync.num_versions == config.num_versions
  assert a['params_sha256'] != synchronous['params_sha256']


def _gas_config(sft_workdir):
  """A deterministic GAS config (s = 3, curvature every 3 versions)."""
  config = _config(sft_workdir, max_staleness=3, num_actors=2,
                   deterministic=True)
  config.scheduler = 'gas'
  config.gas.update(latency_source='model', curvature_every=3,
                    curvature_iters=3, alpha=1.0)
  config.num_versions = 7  # Batches 0-6: the refused test's 4 and 6.
  return config


@pytest.fixture(scope='module')
def gas_run(sft_workdir, tmp_path_factory):
  """(config, workdir, results) of a deterministic GAS run, run once for
  the GAS tests."""
  config = _gas_config(sft_workdir)
  root = tmp_path_factory.mktemp('gas')
  return config, root / 'a', run.train_and_evaluate(config, str(root / 'a'))


@pytest.fixture(scope='module')
def gas_runs(gas_run, tmp_path_factory):
  """(config, workdir of a, a, b): `gas_run` and a second run of its
  config (`make test-all`'s repeat)."""
  config, workdir, a = gas_run
  b = run.train_and_evaluate(config, str(tmp_path_factory.mktemp('gas_b')))
  return config, workdir, a, b


def _check_gas_budgets(config, workdir, a):
  """Every batch trained within the budget logged for its version;
  curvature at versions 3 and 6; every admitted sample counted."""
  # Admission for batch k reads the budgets logged at version k.
  options = scheduler.settings(config).options
  budgets = {f'gas/budget/d{d:g}': int(n) for d, n in zip(
      options.difficulties, gas.budgets(gas.init(options), options))}
  records = [json.loads(l) for l in open(workdir / 'metrics.jsonl')]
  trained = 0
  for record in records:
    if 'staleness' in record:
      trained += 1
      limit = budgets[f'gas/budget/d{int(record["difficulty"])}']
      assert record['staleness'] <= limit, (record['step'], limit)
    if 'gas/budget/d1' in record:
      budgets = {k: v for k, v in record.items() if 'gas/budget/' in k}
  assert trained == config.num_versions
  assert 'gas/lambda_max/d1' in records[3]  # Curvature at versions 3 and 6.
  assert sum(a['difficulty_mix'].values()) == config.num_versions
  counted = sum(a['gas'][f'admitted/d{d}'] for d in config.difficulties)
  assert counted == config.num_versions * 16  # 4 prompts x 4 samples.


def test_a_gas_run_keeps_every_batch_in_budget(gas_run):
  """The default suite's GAS run (one; the slow test below repeats it)."""
  _check_gas_budgets(*gas_run)


# Slow (`make test-all`): a second GAS run, to repeat the first. The
# default suite: test_a_gas_run_keeps_every_batch_in_budget (the same
# checks on one run), the repeat of a deterministic fixed-s run
# (test_async_runs_respect_the_bound_and_deterministic_ones_repeat) and
# GAS's deterministic plans repeating (test_rl_scheduler).
@pytest.mark.slow
def test_gas_runs_keep_every_batch_in_budget_and_deterministic_ones_repeat(
    gas_runs):
  config, workdir, a, b = gas_runs
  assert a['params_sha256'] == b['params_sha256']
  assert a['gas'] == b['gas'] and a['difficulty_mix'] == b['difficulty_mix']
  _check_gas_budgets(config, workdir, a)


def test_a_refused_batch_is_generated_again_from_the_current_version(
    gas_run, tmp_path, monkeypatch):
  # The same config as the run kept by the GAS test above, with batches 4
  # and 6 refused.
  config, _, kept = gas_run
  refuse = {4, 6}
  real = scheduler.Gas.admit
  monkeypatch.setattr(scheduler.Gas, 'admit', lambda self, k, d, lag: (
      k not in refuse and real(self, k, d, lag)))
  redone = run.train_and_evaluate(config, str(tmp_path / 'redone'))
  assert sum(redone['dropped'].values()) == len(refuse)
  assert sum(redone['gas'][f'dropped/d{d}'] for d in config.difficulties
             ) == 16 * len(refuse)
  # The same difficulties trained (nothing skipped), but batches 4 and 6
  # from versions 4 and 6 instead of older ones.
  assert redone['difficulty_mix'] == kept['difficulty_mix']
  records = [json.loads(l) for l in open(tmp_path / 'redone' /
                                         'metrics.jsonl')]
  lags = {r['step'] - 1: r['staleness'] for r in records if 'staleness' in r}
  assert all(lags[k] == 0 for k in refuse) and max(lags.values()) > 0
  assert redone['params_sha256'] != kept['params_sha256']


def _launch(workdir, sft_workdir, *overrides):
  return [sys.executable, '-m', 'launch.rl',
          '--config=configs/rl.py:runlocal,staleness=2',
          f'--config.sft_workdir={sft_workdir}', f'--workdir={workdir}',
          '--config.difficulties=(1,2)', '--config.num_versions=8',
          '--config.runtime.deterministic=True', *overrides]


def _latest_checkpoint(workdir) -> int:
  """The newest committed checkpoint's step (orbax renames it to its step
  last), or -1."""
  checkpoints = os.path.join(workdir, 'checkpoints')
  return max((int(d) for d in (os.listdir(checkpoints) if os.path.isdir(
      checkpoints) else ()) if d.isdigit()), default=-1)


def _wait_for_checkpoint(workdir, proc, after=-1, timeout=240):
  """Until a checkpoint past `after` is committed; returns its step."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    if (latest := _latest_checkpoint(workdir)) > after:
      return latest
    time.sleep(0.01)
  raise TimeoutError(f'no checkpoint past {after} in {workdir}')


GAS = ('--config.scheduler=gas', '--config.gas.latency_source=model',
       '--config.gas.curvature_every=3', '--config.gas.curvature_iters=3')


# One run takes both interruptions in turn (SIGTERM, then kill -9 of the
# resumed run), against one uninterrupted run: a resume from a SIGTERM save
# and one from a cadence checkpoint left by a killed process.
# Both slow (`make test-all`; two launcher runs each). The default suite:
# test_a_run_resumes_from_a_cadence_checkpoint_bit_for_bit (below: the
# resume, in this process), test_rl_multihost's SIGTERM test (launch.rl
# stopped by SIGTERM, saved, resumed exactly) and, for GAS, test_rl_
# scheduler (its checkpointed state restored, planning the same).
@pytest.mark.parametrize('extra', [
    pytest.param((), marks=pytest.mark.slow),
    pytest.param(GAS, marks=pytest.mark.slow)], ids=['plain', 'gas'])
def test_a_run_stopped_by_sigterm_then_killed_resumes_bit_for_bit(
    sft_workdir, tmp_path, request, caplog, extra):
  launch = lambda workdir: _launch(workdir, sft_workdir, *extra)
  start = lambda workdir: subprocess.Popen(
      launch(workdir), cwd=REPO_ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  cut = tmp_path / 'cut'
  proc = start(cut)
  _wait_for_checkpoint(cut, proc)  # The first is at version 2 of 8.
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert 'checkpoint saved' in err
  saved = _latest_checkpoint(cut)
  proc = start(cut)
  _wait_for_checkpoint(cut, proc, after=saved)
  proc.send_signal(signal.SIGKILL)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == -signal.SIGKILL, err[-3000:]
  assert 'Resuming at version' in err
  # The last resume, from the cadence checkpoint the killed process left,
  # runs to the end in this process: reading a checkpoint is the same code
  # either way (the launcher's resume from a SIGTERM save is the second
  # run above), and a launcher would trace every program again (7 s of
  # CPU against 2 here, where this config's run has traced them).
  with caplog.at_level(logging.INFO, logger='absl'):
    run.train_and_evaluate(_launched_config(sft_workdir, *extra), str(cut))
  assert 'Resuming at version' in caplog.text
  # The uninterrupted run of the same config, in this process: what is
  # compared is the policy it ends with, which no process boundary changes
  # (a launcher's run was 7 s of CPU against 3 here). Without GAS it is
  # the module's deterministic run (test_async_runs_...'s first).
  if extra:
    whole = tmp_path / 'whole'
    run.train_and_evaluate(_launched_config(sft_workdir, *extra), str(whole))
  else:
    whole = request.getfixturevalue('deterministic_run')[1]
  load = lambda d: json.load(open(os.path.join(d, run.RESULTS)))
  assert load(cut)['params_sha256'] == load(whole)['params_sha256']
  steps = [json.loads(l)['step'] for l in open(cut / 'metrics.jsonl')]
  assert steps == sorted(set(steps))  # No record twice after the resumes.


def test_a_run_resumes_from_a_cadence_checkpoint_bit_for_bit(
    tmp_path, deterministic_run, caplog):
  """The module's deterministic run (s = 2) as a kill -9 after its first
  kept checkpoint leaves it (the later one and its results gone, its log
  past the checkpoint kept), resumed in this process: it ends with the
  uninterrupted run's policy, each record once. The launcher's SIGTERM-
  then-kill test (slow) does this through two launcher runs."""
  config, whole, results = deterministic_run
  cut = tmp_path / 'cut'
  shutil.copytree(whole, cut)
  os.remove(cut / run.RESULTS)
  kept = sorted(int(d) for d in os.listdir(cut / 'checkpoints')
                if d.isdigit())
  for step in kept[1:]:
    shutil.rmtree(cut / 'checkpoints' / str(step))
  assert 0 < kept[0] < config.num_versions
  with caplog.at_level(logging.INFO, logger='absl'):
    resumed = run.train_and_evaluate(config, str(cut))
  assert f'Resuming at version {kept[0]} of {config.num_versions}' in (
      caplog.text)
  assert resumed['params_sha256'] == results['params_sha256']
  assert resumed['staleness_histogram'] == results['staleness_histogram']
  steps = [json.loads(l)['step'] for l in open(cut / 'metrics.jsonl')]
  assert steps == sorted(set(steps))  # No record twice after the resume.


def _launched_config(sft_workdir, *overrides):
  """What `_launch` runs (with `overrides`, '--config.a.b=v' flags), as a
  config."""
  config = rl_config.get_config('runlocal,staleness=2')
  config.sft_workdir = str(sft_workdir)
  config.difficulties = (1, 2)
  config.num_versions = 8
  config.runtime.deterministic = True
  return config_edits.apply_flags(config, overrides)


# In-process: the launcher prints `error: <the UsageError>` and exits 2
# (test_bad_input_through_the_launcher_is_one_line_and_exit_2).
@pytest.mark.parametrize('changes,field', [
    ({'family': 'div'}, 'task.family'),
    ({'difficulties': (1, 9)}, 'task.difficulty'),
    ({'grpo.correction': 'vtrace'}, 'grpo.correction'),
    ({'runtime.max_staleness': -1}, 'runtime.max_staleness'),
    ({'rollout_devices': 8}, 'rollout_devices'),
    ({'rollout_devices': 3}, 'prompts_per_batch'),
    ({'sft_workdir': '/nonexistent/sft'}, 'config.sft_workdir'),
    ({'scheduler': 'lottery'}, 'scheduler'),
    ({'scheduler': 'gas', 'gas.bandit': 'thompson'}, 'gas.bandit'),
    # Deterministic runs (as _launch makes them) need the latency model.
    ({'scheduler': 'gas'}, 'gas.latency_source'),
    ({'optimizer.learning_rate': float('inf')}, 'optimizer.learning_rate'),
    ({'seed': -1}, 'config.seed=-1: must be an integer in [0, 2**32)'),
    # A billion of these grew the process to 18 GB before it was killed.
    ({'runtime.max_staleness': 10**9}, 'config.runtime.max_staleness='
     '1000000000: must be an integer in [0, 10]'),
    ({'prompts_per_batch': 10**9}, 'config.prompts_per_batch=1000000000: '
     'times grpo.group_size'),
    ({'eval_examples': 10**9}, 'config.eval_examples=1000000000: must be an '
     'integer in [1, 100000]'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_one_line_before_any_work(sft_workdir, tmp_path,
                                               changes, field):
  # 10 versions: max_staleness's bound is min(10, num_versions), and the
  # message names the hard cap.
  config = config_edits.apply(
      _launched_config(sft_workdir, '--config.num_versions=10'), changes)
  with pytest.raises(errors.UsageError) as e:
    run.train_and_evaluate(config, str(tmp_path / 'w'))
  assert field in str(e.value) and '\n' not in str(e.value), str(e.value)
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


def _saved_arrays(workdir):
  """{step: every array of that checkpoint's state}, read as stored."""
  root = os.path.join(workdir, 'checkpoints')
  steps = sorted(int(d) for d in os.listdir(root) if d.isdigit())
  with ocp.PyTreeCheckpointer() as reader:
    return {step: jax.tree.leaves(reader.restore(
        os.path.join(root, str(step), 'state'))) for step in steps}


@pytest.mark.parametrize('rate', [1e39, 1e30])
def test_a_policy_gone_non_finite_stops_the_run_and_is_never_saved(
    sft_workdir, tmp_path, rate):
  # launch.rl with learning_rate=inf exited 0 with NaN in 36 of 37
  # checkpointed arrays (inf is now refused with the config). 1e39 is inf
  # in float32: the first update leaves inf in the policy, with a finite
  # loss. 1e30 leaves finite parameters whose next loss is not.
  config = config_edits.apply(_config(sft_workdir), {
      'optimizer.learning_rate': rate, 'checkpoint_every': 1})
  workdir = tmp_path / 'rl'
  with pytest.raises(errors.NonFiniteLossError) as e:
    run.train_and_evaluate(config, str(workdir))
  text = str(e.value)
  assert e.value.exit_code == 3 and '\n' not in text, text
  assert text.startswith('non-finite ') and 'nonfinite=skip' not in text
  if rate == 1e39:
    assert text.startswith('non-finite policy state at step 1; stopped '
                           'without saving (no checkpoint was written)'), text
  assert not os.path.exists(workdir / run.RESULTS)
  saved = _saved_arrays(workdir)
  assert max(saved, default=None) == e.value.last_checkpoint
  for step, arrays in saved.items():
    assert all(np.all(np.isfinite(a)) for a in arrays
               if np.issubdtype(np.asarray(a).dtype, np.inexact)), step


def test_a_write_that_runs_out_of_space_is_disk_full(sft_workdir, tmp_path,
                                                      monkeypatch):
  # The RL run exited 1 with a traceback per thread; the trainer and TTA
  # give one line and exit 5.
  workdir = tmp_path / 'rl'
  log = str(workdir / 'metrics.jsonl')
  full_disk.on_metrics_write(monkeypatch, log, 3)
  with pytest.raises(errors.DiskFull) as e:
    run.train_and_evaluate(_config(sft_workdir, max_staleness=0),
                           str(workdir))
  assert e.value.exit_code == 5
  assert str(e.value).startswith(f'disk full writing {log} (needs about ?, ')


def test_bad_input_through_the_launcher_is_one_line_and_exit_2(sft_workdir,
                                                               tmp_path):
  proc = subprocess.run(_launch(tmp_path / 'w', sft_workdir,
                                '--config.family=div'),
                        cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and 'task.family' in lines[0], proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


def test_a_held_workdir_a_changed_config_or_policy_are_refused(
    sft_workdir, tmp_path, synchronous_run):
  policy = str(tmp_path / 'sft')  # A copy: trained further below.
  shutil.copytree(sft_workdir, policy)
  # The module's finished synchronous run, copied, with its policy named
  # by the copy's path (sft_workdir may move; its content is pinned).
  synchronous, finished, results = synchronous_run
  config = config_edits.apply(copy.deepcopy(synchronous),
                              {'sft_workdir': policy})
  workdir = tmp_path / 'rl'
  shutil.copytree(finished, workdir)
  # Held by another process: refused in this one (launch.rl exits 75 on
  # this error: test_rl_multihost's test_a_refusal_ends_every_process_...).
  holder = launch_runs.hold_workdir(str(workdir))
  try:
    with pytest.raises(WorkdirBusy):
      run.train_and_evaluate(config, str(workdir))
  finally:
    holder.kill()
    holder.wait()
  assert run.train_and_evaluate(config, str(workdir)) == results
  # The same run as a kill left it, at its first kept checkpoint.
  cut = tmp_path / 'cut'
  shutil.copytree(workdir, cut)
  os.remove(cut / run.RESULTS)
  for step in sorted(int(d) for d in os.listdir(cut / 'checkpoints')
                     if d.isdigit())[1:]:
    shutil.rmtree(cut / 'checkpoints' / str(step))
  other = config_edits.apply(copy.deepcopy(config), {'grpo.epsilon': 0.3})
  with pytest.raises(errors.UsageError, match='grpo.epsilon'):
    run.train_and_evaluate(other, str(workdir))
  # sft_workdir may name another path, but not another policy: a resumed
  # run took the new one as its first policy's reference.
  before = checksums.digest(sft.load_policy(policy).params)
  further = config_edits.apply_flags(sft_config.get_config('runlocal'),
                                     SFT_POLICY_OVERRIDES)
  further.num_steps += 10
  trainers.train_and_evaluate(further, policy)
  after = checksums.digest(sft.load_policy(policy).params)
  assert after != before
  for w in (workdir, cut):
    with pytest.raises(errors.UsageError) as e:
      run.train_and_evaluate(config, str(w))
    assert str(e.value).startswith(
        f"config.sft_workdir='{after[:19]}': differs from {before[:19]}, "
        f'the one the checkpoint of {w} at step '), str(e.value)
  assert json.load(open(workdir / run.RESULTS)) == results


def test_failing_actors_end_the_run_in_one_line_with_a_checkpoint_kept(
    sft_workdir, tmp_path, monkeypatch):
  config = _config(sft_workdir, max_staleness=1, num_actors=2,
                   max_actor_restarts=2)
  real = batches.batch_problems

  def broken(config, k, difficulty=None):
    if k >= 3:
      raise RuntimeError(f'generation exploded on batch {k}')
    return real(config, k, difficulty)

  monkeypatch.setattr(batches, 'batch_problems', broken)
  start = time.monotonic()
  # Two actors may fail at once: the count passes the budget by 1 or 2.
  with pytest.raises(runtime.ActorFailed,
                     match=r'failed [34] times.*generation exploded on '
                           r'batch [3-9]') as info:
    run.train_and_evaluate(config, str(tmp_path / 'rl'))
  assert '\n' not in str(info.value)
  assert time.monotonic() - start < 120
  # Versions 1-3 were trained (batches 0-2); the checkpoint at 2 is kept and
  # a later run resumes from it.
  steps = os.listdir(tmp_path / 'rl' / 'checkpoints')
  assert '2' in steps, steps
