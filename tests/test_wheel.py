"""geom's wheel: the library alone, installable and usable outside the lab.

Builds the wheel from a copy of the checkout's pyproject.toml, README.md
and geom/ (setuptools' PEP 517 hooks, the pinned setuptools, no build
isolation, nothing written into the checkout), then checks:
- its files are geom/'s modules and its metadata, nothing else;
- its Requires-Dist is jax, optax and numpy, and no extra names a package
  of the lab (flax, orbax, tensorflow, opencv, absl, ml_collections, ...);
- in a fresh virtual environment outside the checkout (uv venv) it installs
  offline, from uv's cache (which `make` filled moments earlier), with the
  closure of its declared dependencies at the pins of requirements.txt and
  nothing else: the closure is computed from the packages' own metadata,
  installed with --no-deps, and then uv's resolver installs the wheel
  itself with dependencies and must find nothing missing;
- there, from a directory outside the checkout and with no PYTHONPATH,
  tests/wheel_check.py uses each public method against independent
  references (SAM in an optax.chain under jit, with and without the fused
  kernel; the kernel in Pallas's interpreter; the detector; CONGA; GAS;
  curvature; spherical steering), imports every module of geom and
  reports what got loaded: no package of the lab is installed or loaded
  (absl-py only because optax's metadata requires it). `make test` runs
  one method there (the detector) before the imports; every method is
  `slow`.
"""

import ast
import functools
import importlib.metadata
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
import pytest

import geom
from tests import python_imports

# Under Bazel, the runfiles tree: geom/'s sources and the two files are
# its declared inputs (tests/BUILD).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UV = os.path.join(os.path.dirname(sys.executable), 'uv')
LAB = ('train', 'launch', 'configs', 'studies', 'bench')
# Packages of the lab that must never come with geom, even through a
# dependency; and others the suite uses (besides those found from the
# lab's imports, _lab_distributions). absl-py is the lab's too, but optax
# requires it (checked from optax's metadata).
NEVER = {'tensorflow', 'tensorflow-datasets', 'flax', 'orbax-checkpoint',
         'opencv-python', 'opencv-python-headless', 'ml-collections'}
LAB_NAMED = NEVER | {'absl-py', 'etils', 'array-record', 'scikit-learn',
                     'numba', 'scikit-image', 'mlxtend', 'sentencepiece',
                     'tensorboardx', 'matplotlib', 'pillow',
                     'imagecorruptions-imaug', 'gguf', 'vadersentiment',
                     'google-tunix', 'clu'}
TIMEOUT_S = 300

if not os.path.exists(UV):
  pytest.skip(f'no uv beside {sys.executable} (`make INSTALLER=pip`): the '
              'fresh environment is made with uv from its cache',
              allow_module_level=True)


def _normalize(name):
  return re.sub(r'[-_.]+', '-', name).lower()


def _pins(filename='requirements.txt'):
  pins = {}
  with open(os.path.join(REPO_ROOT, filename)) as f:
    for line in f:
      line = line.split('#')[0].strip()
      if line:
        name, version = line.split('==')
        pins[_normalize(name)] = version
  return pins


def _source_version():
  with open(os.path.join(REPO_ROOT, 'geom', '_version.py')) as f:
    tree = ast.parse(f.read())
  return next(ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and n.targets[0].id == '__version__')


def _geom_sources():
  out = set()
  for dirpath, dirnames, files in os.walk(os.path.join(REPO_ROOT, 'geom')):
    dirnames[:] = [d for d in dirnames if d != '__pycache__']
    out.update(os.path.relpath(os.path.join(dirpath, f), REPO_ROOT)
               for f in files if f.endswith('.py'))
  return out


def _run(args, **kw):
  result = subprocess.run(args, capture_output=True, text=True,
                          timeout=TIMEOUT_S, **kw)
  assert result.returncode == 0, (
      f'{" ".join(map(str, args))}: exit {result.returncode}\n'
      f'{result.stdout[-3000:]}\n{result.stderr[-5000:]}')
  return result


def _uv_env():
  """The environment of uv's commands and of the fresh interpreter: this
  one's (JAX_PLATFORMS, the suite's XLA_FLAGS) without PYTHON* variables
  or an active virtual environment."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith('PYTHON') and k not in ('VIRTUAL_ENV',
                                                      'UV_PYTHON')}
  if ('TEST_TMPDIR' in env and 'UV_CACHE_DIR' not in env
      and 'XDG_CACHE_HOME' not in env):
    # Under Bazel HOME is the test's own directory; `make` filled the cache
    # of the user's home.
    env['UV_CACHE_DIR'] = os.path.join(pwd.getpwuid(os.getuid()).pw_dir,
                                       '.cache', 'uv')
  return env


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
  """(path of the wheel built from a copy of the checkout, its metadata)."""
  root = tmp_path_factory.mktemp('wheel')
  src, dist = root / 'src', root / 'dist'
  src.mkdir()
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(REPO_ROOT, name), src / name)
  shutil.copytree(os.path.join(REPO_ROOT, 'geom'), src / 'geom',
                  ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
  _run([sys.executable, '-c',
        'import sys; from setuptools import build_meta; '
        'print(build_meta.build_wheel(sys.argv[1]))', str(dist)],
       cwd=src, env=_uv_env())
  (path,) = dist.glob('*.whl')
  with zipfile.ZipFile(path) as z:
    names = z.namelist()
    (metadata,) = [n for n in names if n.endswith('.dist-info/METADATA')]
    metadata = z.read(metadata).decode()
  return path, names, metadata


def _requires(metadata):
  return [Requirement(line.split(':', 1)[1].strip())
          for line in metadata.splitlines() if line.startswith('Requires-Dist:')]


def test_the_wheel_holds_geom_and_its_metadata_only(wheel):
  _, names, metadata = wheel
  version = _source_version()
  info = f'geom-{version}.dist-info/'
  stray = [n for n in names if not (n.startswith('geom/')
                                    or n.startswith(info))]
  assert not stray, f'the wheel holds more than geom/: {stray}'
  modules = {n for n in names if n.startswith('geom/')}
  assert modules == _geom_sources(), (
      f'only in the wheel: {sorted(modules - _geom_sources())}; '
      f'missing from it: {sorted(_geom_sources() - modules)}')
  assert f'\nVersion: {version}\n' in metadata


def test_it_requires_jax_optax_and_numpy_and_no_extra_names_the_lab(wheel):
  requires = _requires(wheel[2])
  core = {_normalize(r.name) for r in requires
          if not r.marker or r.marker.evaluate({'extra': ''})}
  assert core == {'jax', 'optax', 'numpy'}, core
  lab = {_normalize(r.name) for r in requires} & _lab_distributions()
  assert not lab, f'Requires-Dist names packages of the lab: {sorted(lab)}'


def test_version_is_the_installed_metadata():
  assert geom.__version__ == _source_version()
  assert geom.__version__ == importlib.metadata.version('geom')


def _imported_modules(top):
  """Top-level modules the .py files under `top` import (absolute imports)."""
  return python_imports.top_level_imports(os.path.join(REPO_ROOT, top))


@functools.cache
def _lab_distributions():
  """The distributions (normalized) that the lab's code (not tests/) imports,
  and LAB_NAMED; not geom and what geom imports (jax, jaxlib, optax,
  numpy). Some (scipy, ml_dtypes, absl-py) come with jax or optax too."""
  found = set(LAB_NAMED)
  provided = importlib.metadata.packages_distributions()
  for top in LAB:
    for module in _imported_modules(top):
      found |= {_normalize(d) for d in provided.get(module, [])}
  return found - {'geom', 'jax', 'jaxlib', 'optax', 'numpy'}


def _closure(requirements):
  """{name: version} of the requirements and all they require (markers of
  this interpreter, extras followed), at the pins of requirements.txt,
  read from the metadata of the packages installed here at those pins."""
  pins, out = _pins(), {}
  todo = [(r, frozenset()) for r in requirements]
  seen = set()
  while todo:
    requirement, _ = todo.pop()
    name = _normalize(requirement.name)
    extras = frozenset(requirement.extras)
    if (name, extras) in seen:
      continue
    seen.add((name, extras))
    assert name in pins, (f'{requirement} is not pinned in requirements.txt: '
                          'no cache holds it for an offline install')
    assert requirement.specifier.contains(pins[name], prereleases=True), (
        f'{requirement}: requirements.txt pins {name}=={pins[name]}')
    installed = importlib.metadata.distribution(name)
    assert installed.version == pins[name], (
        f'{name} is installed at {installed.version}, pinned {pins[name]} '
        '(run make)')
    out[name] = pins[name]
    for text in installed.requires or []:
      nested = Requirement(text)
      if not nested.marker or any(nested.marker.evaluate({'extra': e})
                                  for e in extras | {''}):
        todo.append((nested, extras))
  return out


@pytest.fixture(scope='module')
def fresh_environment(wheel, tmp_path_factory):
  """(the fresh interpreter, the closure installed with the wheel)."""
  path, _, metadata = wheel
  venv = tmp_path_factory.mktemp('venv') / 'env'
  env = _uv_env()
  outside = str(venv.parent)
  _run([UV, 'venv', '--quiet', '--no-config', '--offline', '--python',
        sys.executable, str(venv)], env=env, cwd=outside)
  python = str(venv / 'bin' / 'python')
  closure = _closure(r for r in _requires(metadata)
                     if not r.marker or r.marker.evaluate({'extra': ''}))
  uv_pip = [UV, 'pip', 'install', '--no-config', '--offline', '--python',
            python]
  hint = ("(uv's cache lacks a pinned package: `make` fills it; "
          f'{env.get("UV_CACHE_DIR", "uv cache dir")})')
  try:
    _run(uv_pip + ['--no-deps'] + [f'{n}=={v}' for n, v in closure.items()],
         env=env, cwd=outside)
  except AssertionError as e:
    raise AssertionError(f'{e}\n{hint}') from None
  # The resolver: with its dependencies, the wheel needs nothing more
  # (offline, anything else would fail; the test below lists what is
  # installed).
  _run(uv_pip + [str(path)], env=env, cwd=outside)
  _run([UV, 'pip', 'check', '--no-config', '--offline', '--python', python],
       env=env, cwd=outside)
  return python, closure


def test_geom_installs_and_imports_from_the_wheel_alone(fresh_environment,
                                                        tmp_path):
  """The checks of the test below, with one method run (the detector)
  before every module of geom is imported: what is installed and what is
  loaded. The other methods' code is the same files the lab's tests run;
  that none of geom's imports, inside functions too, needs more than jax,
  optax and numpy is test_requirements'."""
  _check_the_fresh_environment(*fresh_environment, tmp_path, '--one-method')


@pytest.mark.slow
def test_each_method_runs_from_the_wheel_alone(fresh_environment, tmp_path):
  _check_the_fresh_environment(*fresh_environment, tmp_path)


def _check_the_fresh_environment(python, closure, tmp_path, *args):
  """Runs wheel_check.py (with `args`) in the fresh environment, and
  checks its report: nothing from the checkout, only the wheel and its
  closure installed, no module of the lab loaded, every module listed."""
  script = tmp_path / 'wheel_check.py'
  shutil.copy(os.path.join(REPO_ROOT, 'tests', 'wheel_check.py'), script)
  result = _run([python, '-I', str(script), *args], cwd=tmp_path,
                env=_uv_env())
  report = json.loads(result.stdout.splitlines()[-1])
  checkout = os.path.realpath(REPO_ROOT) + os.sep
  assert not [p for p in report['sys_path']
              if os.path.realpath(p).startswith(checkout)], report['sys_path']

  # Installed: the wheel and the closure of its declared dependencies.
  installed = {_normalize(n): requires
               for n, requires in report['distributions'].items()}
  assert set(installed) == set(closure) | {'geom'}, sorted(installed)
  assert not set(installed) & NEVER, sorted(set(installed) & NEVER)
  # A package the lab uses too is there only because one of geom's
  # dependencies requires it (their own metadata): absl-py for optax,
  # scipy and ml_dtypes for jax.
  required_by = {}
  for name, requires in installed.items():
    for requirement in map(Requirement, requires):
      if not requirement.marker or requirement.marker.evaluate({'extra': ''}):
        required_by.setdefault(_normalize(requirement.name), set()).add(name)
  shared = set(installed) & _lab_distributions()
  unexplained = {d for d in shared if not required_by.get(d, set()) - {'geom'}}
  assert not unexplained, (f'the wheel brought packages of the lab: '
                           f'{sorted(unexplained)}')
  if 'absl-py' in installed:
    assert 'optax' in required_by['absl-py'], required_by['absl-py']

  # Loaded after importing every module of geom: no module of the lab's
  # own, nor of a package of the lab that is not installed there.
  provided = importlib.metadata.packages_distributions()
  absent = _lab_distributions() - set(installed)
  lab_modules = {m for m, dists in provided.items()
                 if {_normalize(d) for d in dists} & absent} | set(LAB)
  loaded = set(report['loaded'])
  assert not loaded & lab_modules, sorted(loaded & lab_modules)
  assert {'geom', 'jax', 'optax', 'numpy'} <= loaded
  assert set(report['modules']) == {
      p[:-len('.py')].replace('/', '.').removesuffix('.__init__')
      for p in _geom_sources()} - {'geom'}
