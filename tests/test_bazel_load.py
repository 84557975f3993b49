"""Bazel loads and analyses every BUILD file (`bazel build --nobuild //...`).

tests/test_build_files.py reads the BUILD files as Python; Bazel itself
refuses more: a label listed twice in one attribute (main's 9 pytest_test
rules once got `:conftest` twice from tests/pytest_test.bzl), Starlark
errors in macros and .bzl files, `$(location)` arguments, the venv
toolchain. `--nobuild` stops after analysis, which also catches a dep that
names no target (plain `bazel query //...` does not); neither sees a
missing source file (only a real build does, 20 s; test_build_files does).

The second test (`slow`) plants a duplicate label and a dep on no target
in a copy of the BUILD files and sees the same command fail on both.

Each run is `--batch` in a private output root under /tmp: no server is
left behind, and none is shared with (or locked against) a developer's own
Bazel or an enclosing `bazel test`. `.bazelrc` turns off the convenience
symlinks, so nothing is written into the checkout.
"""

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile

import pytest

if shutil.which('bazel') is None:
  pytest.skip('bazel is not installed (`apt-get install bazel-bootstrap`; '
              '`make test` tries to)', allow_module_level=True)

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, which is what Bazel must load.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
TIMEOUT_S = 300
# A JVM this short-lived spends most of its CPU in the optimising JIT:
# without it (C1 only) `build --nobuild //...` took 4.5 s of CPU against
# 9.5, and 7-8 s against 21 on a 2-core host with both cores busy.
JVM_ARGS = ('--host_jvm_args=-XX:TieredStopAtLevel=1',)


def _bazel(workspace: str, *args: str) -> subprocess.CompletedProcess:
  with tempfile.TemporaryDirectory(prefix='bazel_root_') as root:
    # Its own session, so that a timeout kills the JVM the client started.
    process = subprocess.Popen(
        ['bazel', '--batch', f'--output_user_root={root}', *JVM_ARGS,
         *args],
        cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
      out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
      process.communicate()
      pytest.fail(f'bazel {" ".join(args)} ran over {TIMEOUT_S} s')
  return subprocess.CompletedProcess(process.args, process.returncode, out,
                                     err)


def _errors(stderr: str) -> str:
  # The first errors name the cause; the rest are targets that depend on it.
  return '\n'.join([line for line in stderr.splitlines()
                    if line.startswith('ERROR')][:20])


# Loading (BUILD and .bzl files, macros) and analysis (labels resolve,
# `$(location)`, the toolchain), no build; every error, not the first.
LOAD = ('build', '--nobuild', '--keep_going', '//...')


def test_bazel_loads_and_analyses_every_target():
  result = _bazel(REPO_ROOT, *LOAD)
  assert result.returncode == 0, _errors(result.stderr) or result.stderr
  found = re.search(r'Found (\d+) targets', result.stderr)
  assert found, result.stderr
  # One pytest_test per test file at least, so a pattern that matched a
  # fraction of the tree shows.
  tests = glob.glob(os.path.join(REPO_ROOT, 'tests', 'test_*.py'))
  assert int(found.group(1)) > len(tests), result.stderr


def _copy_build_tree(destination: str) -> None:
  """Copies what Bazel reads to analyse the packages (no sources)."""
  for dirpath, dirnames, files in os.walk(REPO_ROOT):
    dirnames[:] = [d for d in dirnames
                   if not d.startswith(('.', 'bazel-')) and d != 'workdirs']
    relative = os.path.relpath(dirpath, REPO_ROOT)
    for name in files:
      if (name in ('BUILD', 'WORKSPACE') or name.endswith('.bzl')
          or relative == '.' and name.startswith('.bazel')):
        os.makedirs(os.path.join(destination, relative), exist_ok=True)
        shutil.copy(os.path.join(dirpath, name),
                    os.path.join(destination, relative, name))
  # The venv toolchain (third_party/bazel/venv_python.bzl) needs only the
  # interpreter's path to exist.
  os.makedirs(os.path.join(destination, '.venv', 'bin'))
  os.symlink(os.path.join(REPO_ROOT, '.venv', 'bin', 'python3'),
             os.path.join(destination, '.venv', 'bin', 'python3'))


def _plant(path, edit) -> str:
  """Applies `edit` (a function of a deps list's first label) to a BUILD file."""
  build = path.read_text()
  first_dep = re.search(r'deps = \[\s*"([^"]+)",', build)
  assert first_dep, f'no deps list in {path} to plant an error in'
  path.write_text(build[:first_dep.start(1) - 1] + edit(first_dep.group(1))
                  + build[first_dep.end(1) + 1:])
  label = first_dep.group(1)
  package = path.parent.name
  return f'//{package}{label}' if label.startswith(':') else label


# Slow (`make test-all`): it tests the check's power, a second Bazel run
# of 10 s; the check itself is the test above, and a dep on no target is
# also test_build_files.py's (test_deps_name_real_targets_and_cover_the_
# imports).
@pytest.mark.slow
def test_the_load_fails_on_a_duplicate_label_and_a_missing_target(tmp_path):
  _copy_build_tree(str(tmp_path))
  duplicated = _plant(tmp_path / 'tests' / 'BUILD',
                      lambda label: f'"{label}", "{label}"')
  _plant(tmp_path / 'train' / 'run' / 'BUILD',
         lambda label: f'"//train/run:no_such_target", "{label}"')
  result = _bazel(str(tmp_path), *LOAD)
  errors = _errors(result.stderr) or result.stderr
  assert result.returncode != 0
  assert f"Label '{duplicated}' is duplicated" in errors, errors
  assert "rule '//train/run:no_such_target' does not exist" in errors, errors
