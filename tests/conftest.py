"""Test setup: 8 simulated CPU devices, a private TFDS data directory and a
session-wide compilation cache.

All must be in place before JAX or TFDS is imported anywhere, so they are
set at import time of this file, which pytest loads first. Subprocesses
started by tests inherit them.

`make test` runs the suite in pytest-xdist workers, a file per worker at a
time (`--dist loadfile`, so a module's fixtures are built once). The
compilation cache is the controller's, shared by every worker; trained
artifacts (the session fixtures below) are built by the first worker that
needs them and read by the others (`_built_once`).
"""

import atexit
import contextlib
import fcntl
import os
import pathlib
import shutil
import tempfile
from typing import Iterator

# The suite compiles far more than it runs (half its CPU time was in XLA
# compiles), so its programs are compiled without LLVM's optimisations
# (level 0; XLA's own HLO passes still run): test_sam_trainer and
# test_steering_lm took 3m13 of CPU against 2m10, and the LM's parameter
# initialisation compiled in 1.3 s against 3.3. What the tests check holds
# at any level (bit-exact resume compares runs compiled alike; references
# have tolerances); the float results differ from a default build in the
# last bits (the digits run's test loss 0.015156 against 0.015119, with the
# same accuracy), so no test compares against numbers from one.
# XLA:CPU's MLIR fusion emitters are off too (its classic elemental
# emitters instead): they compiled the SAM train step of the digits CNN in
# 2.3 s against 0.86 s, a 4-op program in 50 ms against 28, and took the
# whole suite from 22.4 min (CPU 41.8 min) to 16.6 (29.7) on 2 cores; the
# programs run slower (the digits run 34 -> 22-26 steps/s), which the
# suite's short runs do not feel. The programs are compiled as one LLVM
# module (no parallel codegen split) and without XNNPACK's kernels: the
# test-sized programs compile faster that way (a probe of 12 of them:
# 5.8 s of compiles -> 3.9), and the suite took 678 s against 718 on a
# 2-core EPYC host (CPU 1307 s against 1310). A setting already in
# XLA_FLAGS is kept.
_FLAGS = [f for f in os.environ.get('XLA_FLAGS', '').split()
          if not f.startswith('--xla_force_host_platform_device_count')]
for _flag in ('--xla_backend_optimization_level=0',
              '--xla_cpu_use_fusion_emitters=false',
              '--xla_cpu_parallel_codegen_split_count=1',
              '--xla_cpu_use_xnnpack=false'):
  if not any(f.startswith(_flag.split('=')[0] + '=') for f in _FLAGS):
    _FLAGS.append(_flag)
os.environ['XLA_FLAGS'] = ' '.join(
    _FLAGS + ['--xla_force_host_platform_device_count=8'])
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The lab (train/, launch/, configs/, studies/, bench/, tests/) is not
# installed: it runs from the checkout, as `python -m launch.train` from
# the repository's root finds it (the current directory is on sys.path).
# This process finds it through pytest (pyproject.toml's `pythonpath`);
# the processes the tests start (`python -m launch.X`, `python -c ...`,
# some with another current directory) find it here, before anything
# installed. (tests/test_wheel.py's fresh environment drops it.)
# tests/zygote_hook (after the root) holds the sitecustomize that hands
# those processes to the worker's zygote (the fixture `_launch_zygote`).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ZYGOTE_HOOK = os.path.join(REPO_ROOT, 'tests', 'zygote_hook')
os.environ['PYTHONPATH'] = os.pathsep.join(
    [REPO_ROOT, _ZYGOTE_HOOK] + [
        p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep)
        if p and p not in (REPO_ROOT, _ZYGOTE_HOOK)])
# Hermetic data, built here on first use: one directory for the session,
# shared by the xdist workers (created by the controller, like the cache
# below). The builders take a lock per data set (train.vision.datasets), so
# the first worker builds a data set and the others wait and read it.
if 'PYTEST_XDIST_WORKER' not in os.environ:
  os.environ['TFDS_DATA_DIR'] = tempfile.mkdtemp(prefix='geom_tfds_')
  atexit.register(shutil.rmtree, os.environ['TFDS_DATA_DIR'], True)
# One persistent compilation cache per test session, shared with every
# subprocess: the suite compiles the same programs many times (each test
# jits afresh; every launcher run of a config compiles its steps again).
# test_battery.py alone: 215 s without it, 141 s with it. Small programs
# are cached too: every process compiles each eager op (and orbax's
# per-replica slices of every saved array) for itself, 50-90 ms apiece, so
# a launcher run of digits took 12.7 s against 10.2 with them cached, and
# test_workdir_faults.py 269 s against 217 (threshold 0.3 s against
# 0.01 s). A cache entry torn by a killed process only costs a warning and
# a compile.
# xdist workers inherit the controller's cache (the controller imports this
# file before it starts them) and leave its removal to it.
if 'PYTEST_XDIST_WORKER' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(
      prefix='geom_xla_cache_')
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'],
                  True)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.01')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from train.training import host_devices  # pylint: disable=g-import-not-at-top,wrong-import-position

# The launcher does the same from config.cpu_devices (see host_devices).
host_devices.configure_cpu_devices(8)


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, jax.devices()


@pytest.fixture(scope='module', autouse=True)
def _environment_per_module():
  """What a test file sets in os.environ ends with it: compile_jobs.
  import_jax, for one, turns the persistent compilation cache off for the
  processes started after it (JAX_ENABLE_COMPILATION_CACHE=false)."""
  before = dict(os.environ)
  yield
  if os.environ != before:
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope='session', autouse=True)
def _launch_zygote():
  """This worker's zygote (tests/launch_zygote.py): the launcher processes
  its tests start are forked from it, not imported afresh.
  GEOM_NO_ZYGOTE=1 (here, or for one process) turns it off."""
  if os.environ.get('GEOM_NO_ZYGOTE'):
    yield
    return
  from tests import launch_zygote  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(prefix='geom_zygote_')
  path = os.path.join(root, 'socket')
  proc = launch_zygote.start(path, os.path.join(root, 'log'))
  os.environ['GEOM_TEST_ZYGOTE'] = path
  try:
    yield
  finally:
    del os.environ['GEOM_TEST_ZYGOTE']
    proc.terminate()
    proc.wait()
    shutil.rmtree(root, True)


@pytest.fixture
def digits_config():
  """The digits config in its small (runlocal) mode, unlocked for edits."""
  from configs import digits  # pylint: disable=g-import-not-at-top
  return digits.get_config('runlocal')


@contextlib.contextmanager
def _built_once(tmp_path_factory: pytest.TempPathFactory,
                name: str) -> Iterator[str]:
  """A directory for a session artifact, shared by all xdist workers.

  Held under an exclusive lock: the first worker builds the artifact in it,
  and the others wait, then find it built (a finished run returns its saved
  final metrics without training).
  """
  root = tmp_path_factory.getbasetemp()
  if 'PYTEST_XDIST_WORKER' in os.environ:
    root = root.parent  # The session's directory, above the workers' own.
  path = pathlib.Path(root, name)
  with open(root / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    path.mkdir(exist_ok=True)
    yield str(path)


@pytest.fixture(scope='session')
def digits_runlocal_run(tmp_path_factory):
  """(workdir, final metrics) of the digits runlocal run, trained once per
  test session: tests read it or copy it, never write into it."""
  from configs import digits  # pylint: disable=g-import-not-at-top
  from train.vision import trainer  # pylint: disable=g-import-not-at-top
  with _built_once(tmp_path_factory, 'digits_runlocal') as workdir:
    return workdir, trainer.train_and_evaluate(
        digits.get_config('runlocal'), workdir)


@pytest.fixture(scope='session')
def lm_runlocal_run(tmp_path_factory):
  """(workdir, final metrics) of the LM runlocal run (configs/lm.py), trained
  once per test session for test_lm_jobs and test_forgetting_study: tests
  read it or copy it, never write into it."""
  from configs import lm  # pylint: disable=g-import-not-at-top
  from train.lm import trainer  # pylint: disable=g-import-not-at-top
  with _built_once(tmp_path_factory, 'lm_runlocal') as workdir:
    return workdir, trainer.train_and_evaluate(lm.get_config('runlocal'),
                                               workdir)


@pytest.fixture(scope='session')
def tta_source_run(tmp_path_factory):
  """The workdir of the TTA tests' source CNN (tests/tta_source.py), trained
  once per test session for test_tta_loop and test_tta_study: tests read
  it or copy it, never write into it."""
  from tests import tta_source  # pylint: disable=g-import-not-at-top
  from train.vision import trainer  # pylint: disable=g-import-not-at-top
  with _built_once(tmp_path_factory, 'tta_source') as workdir:
    trainer.train_and_evaluate(tta_source.config(), workdir)
    return workdir


# The SFT warm start the RL tests start from: launch.train on
# configs/rl_sft.py, longer than runlocal (its 30 steps answer almost no
# sum, and all-zero rewards give no update), on one- and two-digit sums.
# One evaluation and one checkpoint, at the end: runlocal's every 20 steps
# made 15 of each, a fifth of the build's CPU (30.0 s against 24.1), for
# the same parameters bit for bit (nothing reads the ones between).
SFT_POLICY_OVERRIDES = ('--config.num_steps=300',
                        '--config.data.difficulties=(1,2)',
                        '--config.optimizer.learning_rate=0.01',
                        '--config.eval_every=300',
                        '--config.checkpoint_every=300')


@pytest.fixture(scope='session')
def sft_policy_run(tmp_path_factory):
  """(workdir, the launcher's stdout) of the SFT warm start, trained once
  per test session through `launch.train` (SFT_POLICY_OVERRIDES), for
  the RL tests (test_rl_sft, test_rl_run, test_rl_rollout, ...): tests
  read it or copy it, never write into it."""
  from tests import launch_runs  # pylint: disable=g-import-not-at-top
  with _built_once(tmp_path_factory, 'sft_policy') as root:
    workdir, stdout = os.path.join(root, 'run'), os.path.join(root, 'stdout')
    if not os.path.exists(stdout):
      proc = launch_runs.run(workdir, *SFT_POLICY_OVERRIDES, timeout=600,
                             config='configs/rl_sft.py:runlocal')
      assert proc.returncode == 0, proc.stderr[-3000:]
      with open(stdout + '.partial', 'w') as f:
        f.write(proc.stdout)
      os.replace(stdout + '.partial', stdout)
    with open(stdout) as f:
      return workdir, f.read()


# The files that take longest (0.7-2 min each on 2 cores) start first, in
# this order (the Makefile turns off xdist's own order, by number of tests,
# which started multihost and the steering study last): a file runs on one
# worker, so a long one started last keeps the other idle until it ends.
_LONGEST_FIRST = ('test_compile.py', 'test_rl_multihost.py',
                  'test_tta_loop.py', 'test_gemma_training.py',
                  'test_battery.py', 'test_sam.py', 'test_docs.py',
                  'test_workdir_faults.py', 'test_multihost.py',
                  'test_gemma_reference.py', 'test_rl_run.py',
                  'test_steering_lm.py', 'test_steering_evaluation.py',
                  'test_steering_selection.py',
                  'test_kernels_sam_perturb.py', 'test_curvature.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# The tests this session left out (`-m 'not slow'`, `-k`): test_slow_tests_
# doc checks that docs/slow_tests.md lists every slow one.
DESELECTED: list = []


def pytest_deselected(items):
  DESELECTED.extend(items)
