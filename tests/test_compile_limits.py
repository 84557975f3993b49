"""`launch.compile`'s limits and deadlines (issue 48): sizes from flags and
configs refused in one line before anything is built, a program whose
arguments exceed the chip not compiled, a budget per step, and SIGTERM
ending a compile within seconds.

The limits are tested in-process at the limit and one past it; a launcher
run (a subprocess) only where its one line, exit status and memory are
the point.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from train.jobs import compile_jobs
from train.jobs import compile_watch
from train.training import aot
from train.compilation import compile_report
from train.compilation import targets
from train.errors import UsageError

from tests import launch_runs

LM_1B = 'configs/lm.py:size=1b'


def _lm_config(**model):
  config = compile_jobs._config_from_file('configs/lm.py', 'size=1b')  # pylint: disable=protected-access
  config.model.update(model)
  return config


def _launch(*args: str, env=None) -> tuple[subprocess.CompletedProcess, int]:
  return launch_runs.run_measured(
      [sys.executable, '-m', 'launch.compile', *args], timeout=120, env=env)


def _one_line(result: subprocess.CompletedProcess) -> str:
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize('target,limit', [('v5e:16x16', 256),
                                          ('v5e:2x2', 16384),
                                          ('v5p:4x4x4', 1024)])
def test_num_slices_is_bounded_by_the_chips_in_all(target, limit):
  config = _lm_config()
  assert targets.max_slices(targets.parse(target)) == limit
  compile_jobs.check_flags(config, target, limit)
  with pytest.raises(UsageError, match=rf'^--num_slices={limit + 1}: at most '
                     rf'{limit} slices of {target} .*65536 chips in all'):
    compile_jobs.check_flags(config, target, limit + 1)


@pytest.mark.parametrize('value', [0, -1, True, 2.5])
def test_a_num_slices_below_one_names_num_slices_not_target(value):
  with pytest.raises(UsageError, match=r'^--num_slices=.*: must be an '
                     r'integer >= 1$'):
    compile_jobs.check_flags(_lm_config(), 'v5e:2x2', value)


def test_gpu_targets_take_one_slice():
  compile_jobs.check_flags(_lm_config(), 'h100:1x1x8', 1)
  with pytest.raises(UsageError, match=r'^--num_slices=2: GPU targets have '
                     'no slices'):
    compile_jobs.check_flags(_lm_config(), 'h100:1x1x8', 2)


def test_a_target_has_at_most_max_chips():
  assert targets.parse('v5e:256x256').num_chips == targets.MAX_CHIPS
  with pytest.raises(UsageError, match=r"^--target='v5e:256x257': 65792 "
                     'chips; at most 65536'):
    compile_jobs.check_flags(_lm_config(), 'v5e:256x257', 1)
  # Python's own limit on int() of a long digit string is not reached.
  with pytest.raises(targets.TargetError, match='unknown target'):
    targets.parse('v5e:' + '9' * 5000 + 'x2')


def test_num_layers_and_model_sizes_are_bounded_before_anything_is_traced():
  compile_jobs.check_flags(_lm_config(num_layers=compile_jobs.MAX_LAYERS),
                           'v5e:2x2', 1)
  with pytest.raises(UsageError, match=r'^config\.model\.num_layers=129: at '
                     'most 128 layers'):
    compile_jobs.check_flags(_lm_config(num_layers=129), 'v5e:2x2', 1)
  # Any other size of the model: int32, as JAX passes it to its programs.
  compile_jobs.check_flags(_lm_config(d_model=2**31 - 1), 'v5e:2x2', 1)
  with pytest.raises(UsageError, match=r'^config\.model\.d_model=2147483648: '
                     r'at most 2147483647 \(JAX passes sizes'):
    compile_jobs.check_flags(_lm_config(d_model=2**31), 'v5e:2x2', 1)
  # A trained model's config (GRPO's, steering's) alike: --model_config's
  # before JAX starts, a checkpoint's when it is read.
  compile_jobs.check_flags(_lm_config(), 'v5e:2x2', 1,
                           given_model_config=_lm_config(num_layers=128))
  with pytest.raises(UsageError, match=r'^model_config\.model\.num_layers='
                     '129: at most 128'):
    compile_jobs.check_flags(_lm_config(), 'v5e:2x2', 1,
                             given_model_config=_lm_config(num_layers=129))


@pytest.mark.parametrize('seconds,ok', [(1, True), (0.5, False),
                                        (86400, True), (86401, False)])
def test_compile_timeout_range(seconds, ok):
  if ok:
    compile_jobs.check_flags(_lm_config(), 'v5e:2x2', 1, seconds)
  else:
    with pytest.raises(UsageError, match=r'^--compile_timeout=.*: must be '
                       r'in \[1, 86400\] seconds'):
      compile_jobs.check_flags(_lm_config(), 'v5e:2x2', 1, seconds)


def _program(elements: int, traced: list[str]) -> aot.Program:
  mesh = Mesh(np.array(jax.devices()[:1]), ('d',))
  x = jax.ShapeDtypeStruct((elements,), jnp.float32,
                           sharding=NamedSharding(mesh, P()))

  def total(v):
    traced.append('traced')
    return jnp.sum(v)

  return aot.Program('sum', jax.jit(total), (x,))


def _chip(hbm_bytes: float) -> targets.Chip:
  return targets.Chip('test', 'cpu', 'cpu', hbm_bytes, 1e12, 1e11, 'test')


def test_arguments_past_the_chip_are_neither_traced_nor_compiled():
  chip = _chip(4096)
  traced = []
  at_limit = compile_report.compile_program(_program(1024, traced), chip)
  assert at_limit.compiled and traced == ['traced']
  traced.clear()
  past = compile_report.compile_program(_program(1025, traced), chip)
  assert not past.compiled and not past.fits and traced == []
  assert past.total_bytes == 4100
  with pytest.raises(compile_report.DoesNotFit, match=(
      r'^sum does not fit on t: needs 0.00 GiB per chip for its arguments '
      r'alone \(parameters, optimizer state, batch; not compiled\); a cpu '
      r'has 0.00 GiB usable; lower config.model.d_model=9, or add chips$')):
    compile_report.check([past], chip, 't', lower='config.model.d_model=9')


def test_a_step_past_its_budget_stops_naming_it_and_the_target():
  release = threading.Event()

  def work(progress):
    progress.step('compiling train_step')
    release.wait(30)

  start = time.monotonic()
  try:
    with pytest.raises(compile_watch.CompileTimeout, match=(
        r'^compiling train_step for v5e:2x2 exceeded --compile_timeout=0.3 '
        r's; the compile stopped')):
      compile_watch.run(work, 'v5e:2x2', 0.3, 'building the programs')
  finally:
    release.set()
  assert time.monotonic() - start < 2
  # The work's own result and errors pass through.
  assert compile_watch.run(lambda progress: 7, 't', 5, 'x') == 7

  def refuses(progress):
    raise UsageError('f', 1, 'no')

  with pytest.raises(UsageError, match='^f=1: no$'):
    compile_watch.run(refuses, 't', 5, 'x')


def test_launcher_refuses_num_slices_in_one_line_before_jax(tmp_path):
  workdir = tmp_path / 'w'
  for value, words in (('1000000000', 'at most 16384 slices of v5e:2x2'),
                       ('-1', 'must be an integer >= 1')):
    result, peak = _launch(f'--config={LM_1B}', '--target=v5e:2x2',
                           f'--num_slices={value}', f'--workdir={workdir}')
    assert result.returncode == 2, result.stderr[-2000:]
    line = _one_line(result)
    assert line.startswith(f'error: --num_slices={value}: '), line
    assert words in line, line
    assert peak < 2**30, peak
    assert not workdir.exists()


def test_launcher_refuses_num_layers_in_one_line(tmp_path):
  workdir = tmp_path / 'w'
  result, peak = _launch(f'--config={LM_1B}', '--target=v5e:2x2',
                         '--config.model.num_layers=100000',
                         f'--workdir={workdir}')
  assert result.returncode == 2, result.stderr[-2000:]
  assert _one_line(result).startswith(
      'error: config.model.num_layers=100000: at most 128 layers')
  assert peak < 2**30 and not workdir.exists()


def _toolchain_missing() -> bool:
  path = targets.toolchain_dir()
  return not all(os.path.isdir(os.path.join(path, n))
                 for n in ('libtpu', 'jax_plugins'))


needs_toolchain = pytest.mark.skipif(_toolchain_missing(),
                                     reason='no compile toolchain')


@needs_toolchain
def test_launcher_does_not_compile_a_model_past_the_chips(tmp_path):
  # d_model 10**9: the TPU compiler ran 9 minutes at 1.4 GB before.
  workdir = tmp_path / 'w'
  result, peak = _launch(f'--config={LM_1B},runlocal', '--target=v5e:2x2',
                         '--config.model.d_model=1000000000',
                         f'--workdir={workdir}')
  assert result.returncode == 3, result.stderr[-2000:]
  line = _one_line(result)
  assert line.startswith('error: train_step does not fit on v5e:2x2: needs ')
  assert ('for its arguments alone (parameters, optimizer state, batch; not '
          'compiled); a TPU v5 lite has 15.75 GiB usable; lower '
          'config.model.d_model=1000000000, ') in line, line
  assert peak < 2**30, peak
  # The report is all it writes.
  assert os.listdir(workdir) == [compile_jobs.RESULT]


def test_launcher_names_a_missing_toolchain_in_one_line(tmp_path):
  workdir = tmp_path / 'w'
  result, _ = _launch(f'--config={LM_1B}', '--target=v5e:2x2',
                      f'--workdir={workdir}',
                      env=dict(os.environ,
                               **{targets.TOOLCHAIN_ENV: '/nonexistent'}))
  assert result.returncode == 2, result.stderr[-2000:]
  assert _one_line(result) == (
      'error: TPU targets need libtpu: run `make compile-toolchain` '
      '(installs into /nonexistent) or `pip install .[tpu]`')
  assert not workdir.exists()


@needs_toolchain
def test_sigterm_ends_a_compile_within_seconds_in_one_line(tmp_path):
  # A WRN-10-10's train step: traced in 2 s, compiled in 30-90 s.
  workdir = tmp_path / 'w'
  proc = subprocess.Popen(
      [sys.executable, '-m', 'launch.compile',
       '--config=configs/wrn_cifar10.py:runlocal', '--target=v5e:2x2',
       '--config.mesh.shape=(4,1)', '--config.model.widen_factor=10',
       f'--workdir={workdir}'],
      cwd=launch_runs.REPO_ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    for line in proc.stdout:
      if line.startswith('compiling train_step'):
        break
    else:
      pytest.fail(f'no compile began: {proc.communicate()}')
    time.sleep(1)  # Inside XLA's compile, which holds its thread.
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    waited = time.monotonic() - sent
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
  assert waited < 3, waited
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 1, stderr[-2000:]
  assert lines[0].startswith('stopped by SIGTERM while compiling train_step '
                             'for v5e:2x2 (')
  assert 'a compile has nothing to resume' in lines[0]
  assert 'Run the same command again to resume' not in lines[0]
  assert not workdir.exists()
