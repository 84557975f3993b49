"""The requirement files: exact pins, complete and disjoint layers.

Layers (Makefile; docs/lab/quickstart.md, "Installing"): run (requirements.txt,
requirements-nodeps.txt), test (requirements-test.txt) and compile
(requirements-compile.txt, installed apart into .venv/compile_toolchain).
`make` installs each with --no-deps, so nothing but these checks says a
layer is complete. Checks: every line is an exact pin; no package is in two
files, so each has one version; each pinned package is installed at its
pin, and every requirement of it (with the extras asked for) is pinned in
its layer or a layer below, at a version it accepts; the code outside
tests/ imports only what the run layer installs, and tests/ only what the
run and test layers do; pyproject's `tpu` and `cuda12` extras pin the
versions of the compile layer and of jax.
"""

import functools
import importlib.metadata
import os
import re
import sys
import tomllib

from packaging.requirements import Requirement
import pytest

from tests import python_imports

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, which is what this test reads.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
LAYERS = {
    'run': ('requirements.txt', 'requirements-nodeps.txt'),
    'test': ('requirements-test.txt',),
    'compile': ('requirements-compile.txt',),
}
FILES = [f for files in LAYERS.values() for f in files]
# What a layer may require besides itself.
BELOW = {'run': (), 'test': ('run',), 'compile': ('run',)}
# Installed without some of their requirements on purpose (the files say
# why): imagecorruptions-imaug asks for the GUI build of OpenCV (the
# headless one is pinned); tunix's full requirements and huggingface_hub's
# are not needed for the GRPO loss (None: none of them).
UNMET_ON_PURPOSE = {
    'imagecorruptions-imaug': {'opencv-python'},
    'google-tunix': None,
    'huggingface-hub': None,
}
RUN_CODE = ('geom', 'train', 'configs', 'launch', 'studies', 'bench')
# Imported by a script no layer installs for, on purpose: llama.cpp's
# bindings build from source (7 min on 2 cores), so
# tests/gemma_reference/record_llama_cpp.py records their outputs once and
# the tests read the recording.
NOT_INSTALLED_ON_PURPOSE = {'llama_cpp': 'tests/gemma_reference/'}
PIN = re.compile(r'([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)')


def _normalize(name):
  return re.sub(r'[-_.]+', '-', name).lower()


def _pins(filename):
  """{normalized name: version} of one requirement file."""
  pins = {}
  with open(os.path.join(REPO_ROOT, filename)) as f:
    for number, line in enumerate(f, 1):
      line = line.split('#')[0].strip()
      if not line:
        continue
      match = PIN.fullmatch(line)
      assert match, f'{filename}:{number}: {line!r} is not an exact pin (==)'
      name = _normalize(match.group(1))
      assert name not in pins, f'{filename}:{number}: {name} pinned twice'
      pins[name] = match.group(2)
  return pins


def _layer(layer):
  pins = {}
  for filename in LAYERS[layer]:
    pins.update(_pins(filename))
  return pins


@pytest.mark.parametrize('filename', FILES)
def test_every_line_is_an_exact_pin(filename):
  assert _pins(filename)


def test_no_package_in_two_files():
  seen = {}
  for filename in FILES:
    for name in _pins(filename):
      assert name not in seen, f'{name} is in {seen[name]} and {filename}'
      seen[name] = filename


def _installed(layer):
  """{normalized name: Distribution} where the layer is installed."""
  if layer == 'compile':
    path = os.environ.get('GEOM_COMPILE_TOOLCHAIN') or os.path.join(
        sys.prefix, 'compile_toolchain')
    if not os.path.isdir(path):
      pytest.skip(f'no compile toolchain at {path} (make compile-toolchain)')
    dists = importlib.metadata.distributions(path=[path])
  else:
    dists = importlib.metadata.distributions()
  return {_normalize(d.metadata['Name']): d for d in dists}


@pytest.mark.parametrize('layer', sorted(LAYERS))
def test_each_layer_is_installed_at_its_pins_and_complete(layer):
  pins = _layer(layer)
  available = dict(pins)
  for below in BELOW[layer]:
    available.update(_layer(below))
  installed = _installed(layer)
  problems = []
  for name, version in sorted(pins.items()):
    if name not in installed:
      problems.append(f'{name}=={version} is not installed')
    elif installed[name].version != version:
      problems.append(f'{name} is {installed[name].version}, pinned {version}')
  # (package, extras asked for) still to check; extras add requirements.
  todo = [(name, frozenset()) for name in pins if name in installed]
  done = set()
  while todo:
    name, extras = todo.pop()
    if (name, extras) in done or name not in installed:
      continue
    done.add((name, extras))
    exempt = UNMET_ON_PURPOSE.get(name, set())
    for text in installed[name].requires or []:
      requirement = Requirement(text)
      if requirement.marker and not any(
          requirement.marker.evaluate({'extra': extra})
          for extra in extras | {''}):
        continue
      dependency = _normalize(requirement.name)
      if exempt is None or dependency in exempt:
        continue
      if dependency not in available:
        problems.append(f'{name} requires {requirement}, which no file of '
                        f'the {layer} layer or below pins')
      elif not requirement.specifier.contains(available[dependency],
                                              prereleases=True):
        problems.append(f'{name} requires {requirement}, pinned '
                        f'{dependency}=={available[dependency]}')
      elif dependency in pins:
        todo.append((dependency, frozenset(requirement.extras)))
  assert not problems, f'{layer} layer: ' + '; '.join(problems)


def _third_party_imports(top):
  """Top-level modules imported by .py files under `top`, not the repo's."""
  modules = python_imports.top_level_imports(os.path.join(REPO_ROOT, top))
  local = set(RUN_CODE) | {'tests'}
  return sorted(m for m in modules
                if m not in sys.stdlib_module_names and m not in local)


@functools.cache
def _packages_distributions():
  return importlib.metadata.packages_distributions()


def _distributions(module):
  """The installed distributions that provide a top-level module."""
  return {_normalize(d) for d in _packages_distributions().get(module, [])}


@pytest.mark.parametrize('top', RUN_CODE + ('tests',))
def test_imports_come_from_the_layers_that_install_them(top):
  layers = ('run', 'test') if top == 'tests' else ('run',)
  allowed = {name for layer in layers for name in _layer(layer)}
  files = ', '.join(f for layer in layers for f in LAYERS[layer])
  for module in _third_party_imports(top):
    if (module in NOT_INSTALLED_ON_PURPOSE
        and NOT_INSTALLED_ON_PURPOSE[module].startswith(top + '/')):
      continue
    dists = _distributions(module)
    assert dists, f'{top}/ imports {module}, which no installed package provides'
    assert dists & allowed, (f'{top}/ imports {module} (from {sorted(dists)}), '
                             f'which none of {files} pins')


def test_extras_pin_the_compile_layer_and_jax():
  with open(os.path.join(REPO_ROOT, 'pyproject.toml'), 'rb') as f:
    extras = tomllib.load(f)['project']['optional-dependencies']
  run, compile_layer = _layer('run'), _layer('compile')

  def pins(requirements):
    out = {}
    for requirement in requirements:
      match = re.fullmatch(r'([A-Za-z0-9._-]+)(\[[^\]]*\])?==(\S+)', requirement)
      assert match, f'pyproject extra {requirement!r} is not an exact pin'
      out[_normalize(match.group(1))] = match.group(3)
    return out

  assert pins(extras['tpu']) == {'jax': run['jax']}
  assert pins(extras['cuda12']) == {
      name: compile_layer[name]
      for name in ('jax-cuda12-plugin', 'jax-cuda12-pjrt')}
  assert compile_layer['jax-cuda12-plugin'] == run['jaxlib']
  assert 'libtpu' in compile_layer
