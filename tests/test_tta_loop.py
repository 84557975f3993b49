"""launch.tta / train.tta.adapt: results, bit-exact resume after kill -9, one-line errors."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import tta as tta_config
from tests import config_edits
from tests import full_disk
from tests import launch_runs
from tests import read_only
from train import errors
from train.tta import adapt
from train.tta import source as source_lib

REPO_ROOT = launch_runs.REPO_ROOT


@pytest.fixture(scope='module')
def source_workdir(tta_source_run):
  """A CNN trained briefly on mnist5k (the streams' clean data set): the
  session's, which test_tta_study's study reuses (tests/tta_source.py)."""
  return tta_source_run


# runlocal's 24 batches: the last one is also a regular checkpoint's step
# (checkpoint_every may change on resume: the runs below that resume this
# one's workdir with runlocal's 50 are not refused for it). Every 6, not
# 8: the checkpoints fall inside the episodes of 8 batches, so a resume
# from one needs the adapted state saved there (at an episode's start it
# is the source's again).
TENT_CHECKPOINT_EVERY = 6


@pytest.fixture(scope='module')
def tent_run(source_workdir, tmp_path_factory):
  """runlocal's TENT run, finished, a checkpoint every 6 batches:
  (workdir, results)."""
  workdir = str(tmp_path_factory.mktemp('tent'))
  return workdir, adapt.adapt_and_evaluate(_tent_config(source_workdir),
                                           workdir)


def _tent_config(source):
  # All four checkpoints kept (runlocal keeps 2): the in-process resume
  # starts from the first, inside the first episode.
  return _config(source, 'runlocal,method=tent',
                 checkpoint_every=TENT_CHECKPOINT_EVERY, keep_checkpoints=4)


@pytest.fixture(scope='module')
def source_run(source_workdir, tmp_path_factory):
  """runlocal's run of the source model alone (at its severity, 5),
  finished: (workdir, results)."""
  workdir = str(tmp_path_factory.mktemp('source_run'))
  return workdir, adapt.adapt_and_evaluate(
      _config(source_workdir, 'runlocal,method=source', severity=5), workdir)


def _config(source, arg='runlocal', **fields):
  config = tta_config.get_config(arg)
  config.source_workdir = source
  return config_edits.apply(config, fields)


def _command(workdir, source, *overrides, arg='runlocal'):
  return [sys.executable, '-m', 'launch.tta',
          f'--config=configs/tta.py:{arg}', f'--workdir={workdir}',
          f'--config.source_workdir={source}', *overrides]


def _run(*args, **kw):
  return subprocess.run(_command(*args, **kw), cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=300)


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return f.read()


def test_the_source_is_only_read(source_workdir, tmp_path):
  # Loading the source wrote a probe file into its workdir (a read-only
  # one was refused as "not writable"), and cleaned up the unfinished
  # checkpoints there: a source run still saving would lose its save.
  direct = source_lib.load(_config(source_workdir))
  with read_only.view(source_workdir, str(tmp_path / 'ro')) as ro:
    seen = source_lib.load(_config(ro))
  assert seen.step == direct.step
  jax.tree.map(np.testing.assert_array_equal, (seen.params, seen.batch_stats),
               (direct.params, direct.batch_stats))
  copy = shutil.copytree(source_workdir, tmp_path / 'saving')
  in_progress = copy / 'checkpoints' / '60.orbax-checkpoint-tmp-1700000000'
  in_progress.mkdir()
  (in_progress / 'part').write_bytes(b'a save in progress')
  before = sorted(p.relative_to(copy) for p in copy.rglob('*'))
  assert source_lib.load(_config(str(copy))).step == direct.step
  assert sorted(p.relative_to(copy) for p in copy.rglob('*')) == before


def test_a_source_trained_further_is_refused_on_resume_and_rerun(
    source_workdir, tmp_path):
  # The source was named by path only: one trained on after the run
  # started was adapted from the old one's progress on resume, and a
  # finished run reported its old result again. It is pinned by content.
  # The source as its training run left it at its first checkpoint (step
  # 20 of 40); "trained further" below is that run's next checkpoint (40),
  # which it wrote when it trained on in this workdir, put back.
  src = tmp_path / 'source'
  trained = sorted(int(d) for d in os.listdir(
      os.path.join(source_workdir, 'checkpoints')) if d.isdigit())
  shutil.copytree(source_workdir, src, ignore=lambda d, names: [
      n for n in names if os.path.basename(d) == 'checkpoints'
      and n.isdigit() and int(n) > trained[0]])
  src = str(src)
  # The source model alone (no gradients: cheaper), a checkpoint every 4
  # of its 8 batches.
  config = _config(src, 'runlocal,method=source', checkpoint_every=4,
                   corruptions='gaussian_noise')
  finished = str(tmp_path / 'finished')
  results = adapt.adapt_and_evaluate(config, finished)
  # The same run as a kill left it, at its first kept checkpoint.
  cut = tmp_path / 'cut'
  shutil.copytree(finished, cut)
  os.remove(cut / adapt.RESULTS)
  steps = sorted(int(d) for d in os.listdir(cut / 'checkpoints')
                 if d.isdigit())
  for step in steps[1:]:
    shutil.rmtree(cut / 'checkpoints' / str(step))
  loaded = source_lib.load(config)
  assert loaded.step == trained[0]
  before = loaded.fingerprint
  for step in trained[1:]:
    shutil.copytree(os.path.join(source_workdir, 'checkpoints', str(step)),
                    os.path.join(src, 'checkpoints', str(step)))
  loaded = source_lib.load(config)
  assert loaded.step == trained[-1] > trained[0]
  after = loaded.fingerprint
  assert after != before
  for workdir in (finished, str(cut)):
    with pytest.raises(errors.UsageError) as e:
      adapt.adapt_and_evaluate(config, workdir)
    text = str(e.value)
    assert text.startswith(f"config.source_workdir='{after[:19]}': differs "
                           f'from {before[:19]}, the one the checkpoint of '
                           f'{workdir} at step '), text
  assert json.load(open(os.path.join(finished, adapt.RESULTS))) == results


def test_a_write_that_runs_out_of_space_is_disk_full(source_workdir,
                                                      tmp_path, monkeypatch):
  workdir = tmp_path / 'tta'
  log = str(workdir / 'metrics.jsonl')
  full_disk.on_metrics_write(monkeypatch, log, 2)
  with pytest.raises(errors.DiskFull) as e:
    # The source model alone: its step traces and compiles fastest.
    adapt.adapt_and_evaluate(_config(source_workdir, 'runlocal,method=source',
                                     batch_size=8, log_every=1), str(workdir))
  assert e.value.exit_code == 5
  assert str(e.value).startswith(f'disk full writing {log} (needs about ?, ')


def test_adapts_and_reports_per_corruption_errors(source_workdir, tent_run,
                                                  source_run, tmp_path):
  results = {}
  for name in ('source', 'bn_stats', 'tent'):
    workdir = str(tmp_path / name)
    if name == 'tent':
      workdir, results[name] = tent_run
    elif name == 'source':
      workdir, results[name] = source_run
    else:
      results[name] = adapt.adapt_and_evaluate(
          _config(source_workdir, f'runlocal,method={name}'), workdir)
    assert sorted(results[name]['errors']) == ['contrast', 'fog',
                                               'gaussian_noise']
    assert os.path.getsize(os.path.join(workdir, 'errors.png')) > 1000
    on_disk = json.load(open(os.path.join(workdir, 'results.json')))
    assert on_disk == results[name]
    lines = _records(workdir).splitlines()
    assert len(lines) == results[name]['batches'] + 1
  # The published first finding: test-batch statistics beat the source
  # model's running ones by far under corruption.
  assert (results['bn_stats']['mean_error']
          < results['source']['mean_error'] - 10)
  assert results['source']['updates'] == results['bn_stats']['updates'] == 0
  assert results['tent']['updates'] == results['tent']['batches']


def test_a_finished_workdir_reports_without_adapting_again(source_workdir,
                                                           tent_run):
  # The module's TENT run (its last batch also a regular checkpoint's
  # step), finished by the fixture: its run again is this test's second.
  workdir, first = tent_run
  before = _records(workdir)
  assert adapt.adapt_and_evaluate(_tent_config(source_workdir),
                                  workdir) == first
  assert _records(workdir) == before


def _kill_at_first_checkpoint(workdir, command):
  """Starts `command`, kills it (-9) once its first checkpoint is in
  place, and checks it left no results."""
  proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  checkpoints = os.path.join(workdir, 'checkpoints')
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    steps = [d for d in (os.listdir(checkpoints) if os.path.isdir(checkpoints)
                         else []) if d.isdigit()]
    if steps:
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert not os.path.exists(os.path.join(workdir, 'results.json'))


def _check_resumed(workdir, source_workdir, overrides, arg, reference):
  """The same command, run again on the killed `workdir`, resumes and ends
  with `reference`'s results and log."""
  resumed = _run(workdir, source_workdir, *overrides, arg=arg)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert 'Resuming at batch' in resumed.stderr
  assert (json.load(open(os.path.join(workdir, 'results.json')))
          == json.load(open(os.path.join(reference, 'results.json'))))
  assert _records(workdir) == _records(reference)


def test_a_run_cut_at_its_first_checkpoint_resumes_bit_exactly(
    source_workdir, tent_run, tmp_path, caplog):
  """The module's TENT run as a kill -9 after its first checkpoint leaves
  it (later checkpoints and results gone, its log past the checkpoint
  kept), resumed in this process: the same results and log, each record
  once. The first checkpoint is inside the first episode of 8 batches, so
  the resume restores an adapted state and crosses the two later
  episodes' resets. The launcher's kill -9 is the slow test below."""
  reference, results = tent_run
  cut = tmp_path / 'cut'
  shutil.copytree(reference, cut)
  os.remove(cut / adapt.RESULTS)
  kept = sorted(int(d) for d in os.listdir(cut / 'checkpoints')
                if d.isdigit())
  for step in kept[1:]:
    shutil.rmtree(cut / 'checkpoints' / str(step))
  assert kept[0] == TENT_CHECKPOINT_EVERY
  with caplog.at_level(logging.INFO, logger='absl'):
    resumed = adapt.adapt_and_evaluate(_tent_config(source_workdir),
                                       str(cut))
  assert f'Resuming at batch {kept[0]} of ' in caplog.text
  assert resumed == results
  assert json.load(open(cut / adapt.RESULTS)) == results
  assert _records(cut) == _records(reference)


# Slow: the in-process resume above is this loop's in the default suite,
# and test_workdir_faults' kill -9 after a checkpoint is the shared
# launcher's (entry.run_job) through launch.train.
@pytest.mark.slow
def test_kill_9_then_resume_is_bit_exact(source_workdir, tent_run, tmp_path):
  # The module's TENT run is the reference (its three episodes of 8
  # batches, a checkpoint every 6): the kill comes at the first, inside
  # the first episode, and the resume crosses the two later episodes'
  # resets. SAR with CONGA's state is the slow test below.
  reference, _ = tent_run
  overrides = (f'--config.checkpoint_every={TENT_CHECKPOINT_EVERY}',)
  workdir = str(tmp_path / 'killed')
  _kill_at_first_checkpoint(workdir, _command(
      workdir, source_workdir, *overrides, arg='runlocal,method=tent'))
  _check_resumed(workdir, source_workdir, overrides, 'runlocal,method=tent',
                 reference)


# Slow: the TENT run's in-process resume above is this loop's in the
# default suite; the core resumes any state tree bit for bit
# (test_resumable), and SAR's and CONGA's steps are test_tta_methods' and
# geom's.
@pytest.mark.slow
def test_kill_9_then_resume_is_bit_exact_with_sar_and_conga(source_workdir,
                                                            tmp_path):
  # Two corruptions (of runlocal's three): the stream still resets between
  # episodes after the resume, in two thirds of the time. Batches of 25,
  # which divide each corruption's 500 images (a ragged last batch is a
  # second shape: a second trace and compile in each of the three runs),
  # and a checkpoint every 8 of the 40 batches (a save costs about 0.1 s
  # of CPU, in the reference and in the resumed run): the kill still comes
  # at the first, and the resume still crosses the episodes' boundary
  # (batch 20).
  overrides = ('--config.method.schedule=conga', '--config.batch_size=25',
               '--config.checkpoint_every=8',
               '--config.corruptions=fog,contrast')
  reference = str(tmp_path / 'reference')  # The same run, in-process.
  adapt.adapt_and_evaluate(
      _config(source_workdir, 'runlocal,method=sar', batch_size=25,
              checkpoint_every=8, corruptions='fog,contrast',
              **{'method.schedule': 'conga'}), reference)

  workdir = str(tmp_path / 'killed')
  _kill_at_first_checkpoint(workdir, _command(
      workdir, source_workdir, *overrides, arg='runlocal,method=sar'))
  _check_resumed(workdir, source_workdir, overrides, 'runlocal,method=sar',
                 reference)


# Slow: the core's stop-signal tests (test_resumable: SIGTERM and SIGINT
# save at that step and resume bit for bit), the launcher's exit codes
# for them (test_workdir_faults) and this loop's in-process resume above
# cover it.
@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_resumes(source_workdir, tmp_path):
  overrides = ('--config.batch_size=4', '--config.checkpoint_every=1000')
  workdir = str(tmp_path / 'w')
  proc = subprocess.Popen(_command(workdir, source_workdir, *overrides),
                          cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-2000:]
  assert 'stopped by SIGTERM at step' in err
  resumed = _run(workdir, source_workdir, *overrides)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert 'Resuming at batch' in resumed.stderr
  assert 'mean error' in resumed.stdout


# In-process: launch.tta prints `error: <the UsageError>` and exits 2
# (test_a_missing_or_incompatible_source_fails_in_one_line runs it).
@pytest.mark.parametrize('field,value', [
    ('method.name', 'tentt'),
    ('corruptions', 'gaussian_noise,snowy'),
    ('severity', 7),
    ('method.learning_rate', -1.0),
    ('protocol', 'online'),
    ('method.schedule', 'cosine'),
    ('seed', -1),
    ('method.fisher_samples', 0),  # Was accepted.
])
def test_bad_settings_fail_in_one_line_before_compute(source_workdir,
                                                      tmp_path, field,
                                                      value):
  workdir = str(tmp_path / 'w')
  with pytest.raises(errors.UsageError) as e:
    adapt.adapt_and_evaluate(_config(source_workdir, **{field: value}),
                             workdir)
  assert field in str(e.value) and '\n' not in str(e.value), str(e.value)
  assert not os.path.exists(os.path.join(workdir, 'checkpoints'))


@pytest.mark.parametrize('field,value,message', [
    ('margin', 2.0, 'config.method.conga.margin=2.0: must be in (0, 1]'),
    ('grad_decay', -0.5,
     'config.method.conga.grad_decay=-0.5: must be in (0, 1)'),
    ('margn', 0.3, "config.method.conga.margn=0.3: not an argument of "
     "geom.conga.conga; valid choices: 'entropy_decay', 'grad_decay', "),
])
def test_a_bad_conga_setting_is_one_line_before_the_source_loads(
    tmp_path, field, value, message):
  # It passed check_config and failed after the source and the stream had
  # loaded, with geom's ArgumentError traceback. The source here does not
  # exist: the CONGA setting is reported first.
  config = _config(str(tmp_path / 'no_source'), **{
      'method.schedule': 'conga'})
  config.method.conga[field] = value
  with pytest.raises(errors.ConfigError) as e:
    adapt.adapt_and_evaluate(config, str(tmp_path / 'w'))
  assert str(e.value).startswith(message), str(e.value)
  assert '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'w')


def test_a_missing_or_incompatible_source_fails_in_one_line(
    tmp_path, digits_runlocal_run):
  missing = _run(str(tmp_path / 'a'), str(tmp_path / 'nowhere'))
  assert missing.returncode == 2
  assert 'config.source_workdir' in missing.stderr
  assert 'holds no checkpoints' in missing.stderr
  # A classifier of 8x8 digits cannot adapt to 28x28 MNIST streams.
  wrong = _run(str(tmp_path / 'b'), digits_runlocal_run[0])
  assert wrong.returncode == 2, wrong.stderr[-2000:]
  line = [l for l in wrong.stderr.splitlines() if l.startswith('error:')]
  assert len(line) == 1 and "trained on 'digits'" in line[0]
  assert 'Traceback' not in wrong.stderr


def test_resume_with_another_config_is_refused(source_workdir, tent_run):
  workdir, results = tent_run
  records = _records(workdir)
  changed = _run(workdir, source_workdir, '--config.method.learning_rate=0.01')
  assert changed.returncode == 2
  assert 'config.method.learning_rate 0.001 -> 0.01' in changed.stderr
  # Refused before the source or the stream is read; nothing written.
  assert 'Source classifier' not in changed.stderr
  assert _records(workdir) == records
  assert json.load(open(os.path.join(workdir, 'results.json'))) == results


def test_a_held_workdir_is_refused(source_workdir, tmp_path):
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  holder = launch_runs.hold_workdir(workdir)
  try:
    result = _run(workdir, source_workdir)
  finally:
    holder.kill()
  assert result.returncode == 75
  assert 'in use by another run' in result.stderr


def test_source_error_rises_with_severity(source_workdir, source_run,
                                          tmp_path):
  # One corruption of runlocal's three, at severities 1 and 3 (a third of
  # the CPU of two runs of the whole runlocal stream); at severity 5, its
  # error in the module's source run (the source model has no state: its
  # error on a corruption does not depend on the others in the stream).
  errors = []
  for severity in (1, 3):
    result = adapt.adapt_and_evaluate(
        _config(source_workdir, 'runlocal,method=source', severity=severity,
                corruptions='gaussian_noise'),
        str(tmp_path / f's{severity}'))
    errors.append(result['mean_error'])
  errors.append(source_run[1]['errors']['gaussian_noise'])  # Severity 5.
  assert errors[0] < errors[1] < errors[2], errors
