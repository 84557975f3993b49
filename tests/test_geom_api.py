"""geom's public surface: what it imports, what it exports, how it rejects arguments."""

import ast
import doctest
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import geom
from geom import curvature
from geom import gas
from geom import hallucination
from geom import kernels
from geom import landscapes
from geom import method_hooks
from geom import sam
from geom import steering
from geom import validation
from geom.kernels import sam_perturb
from tests.conftest import REPO_ROOT

GEOM_ROOT = os.path.join(REPO_ROOT, 'geom')
ALLOWED = {'geom', 'jax', 'numpy', 'optax'}
MODULES = (curvature, gas, hallucination, landscapes, method_hooks, sam, steering,
           validation, sam_perturb, kernels, geom)


def _geom_files():
  for dirpath, dirnames, files in os.walk(GEOM_ROOT):
    dirnames[:] = [d for d in dirnames if d != '__pycache__']
    for f in files:
      if f.endswith('.py'):
        yield os.path.join(dirpath, f)


def _top_level_imports(path):
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name.split('.')[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      yield node.module.split('.')[0]


def test_geom_imports_only_the_standard_library_numpy_jax_and_optax():
  found = {}
  for path in _geom_files():
    for name in _top_level_imports(path):
      if name not in ALLOWED and name not in sys.stdlib_module_names:
        found.setdefault(os.path.relpath(path, REPO_ROOT), []).append(name)
  assert not found, f'geom/ imports outside jax, optax, numpy: {found}'


def test_importing_geom_loads_no_trainer_flax_or_data_library():
  # The AST check above misses imports made by what geom imports; this
  # one runs a fresh interpreter and looks at what got loaded.
  code = ('import sys, geom, geom.kernels.sam_perturb; print(" ".join('
          'sorted({m.split(".")[0] for m in sys.modules})))')
  out = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT,
                       capture_output=True, text=True, check=True).stdout
  loaded = set(out.split())
  # (absl comes with optax itself.)
  forbidden = {'flax', 'train', 'orbax', 'tensorflow_datasets',
               'ml_collections', 'configs', 'launch', 'torch', 'tensorflow'}
  assert not loaded & forbidden, sorted(loaded & forbidden)
  assert {'geom', 'jax', 'optax'} <= loaded


@pytest.mark.parametrize('module', MODULES, ids=lambda m: m.__name__)
def test_every_module_lists_public_names_that_exist(module):
  assert module.__all__, module.__name__
  for name in module.__all__:
    assert hasattr(module, name), f'{module.__name__}.{name}'
  # Helpers that are not listed are private (a leading underscore), or
  # modules, types, constants and the typing aliases of signatures.
  for name, value in vars(module).items():
    if name.startswith('_') or name in module.__all__:
      continue
    if callable(value) and getattr(value, '__module__', None) == (
        module.__name__) and not isinstance(value, type):
      pytest.fail(f'{module.__name__}.{name}: a public function that is not '
                  'in __all__')


def test_package_exports_the_method_modules_and_their_classes():
  assert geom.sam is sam and geom.steering is steering
  assert geom.SAMOptions is sam.SAMOptions
  assert geom.MethodHooks is method_hooks.MethodHooks
  assert geom.ArgumentError is validation.ArgumentError
  assert issubclass(geom.ArgumentError, ValueError)


@pytest.mark.parametrize('module', (geom, curvature, gas, hallucination,
                                    method_hooks, validation),
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
  result = doctest.testmod(module, verbose=False)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize('make,owner,argument,value', [
    (lambda: sam.sam(optax.sgd(0.1), rho=-0.5), 'geom.sam.SAMOptions', 'rho',
     -0.5),
    (lambda: sam.sam(optax.sgd(0.1), window=(3, 1)), 'geom.sam.SAMOptions',
     'window', (3, 1)),
    (lambda: sam.sam(optax.sgd(0.1), response='panic'),
     'geom.sam.SAMOptions', 'response', 'panic'),
    (lambda: sam.sam(optax.sgd(0.1), adaptive=True,
                     ascent=optax.contrib.normalize()),
     'geom.sam.SAMOptions', 'adaptive', True),
    (lambda: hallucination.DetectorConfig(ema_decay=1.0),
     'geom.hallucination.DetectorConfig', 'ema_decay', 1.0),
    (lambda: steering.Steering('spherical', jnp.ones(3), kappa=-1.0),
     'geom.steering.Steering', 'kappa', -1.0),
    (lambda: sam_perturb.BlockSizes(pack_below=-1),
     'geom.kernels.sam_perturb.BlockSizes', 'pack_below', -1),
    (lambda: method_hooks.MethodHooks(update_arguments=('labels',)),
     'geom.method_hooks.MethodHooks', 'update_arguments', 'labels'),
])
def test_argument_errors_carry_the_argument(make, owner, argument, value):
  with pytest.raises(validation.ArgumentError) as info:
    make()
  e = info.value
  assert (e.owner, e.argument, e.value) == (owner, argument, value)
  # The message names them, as a function's argument or a class's field.
  assert f'{argument}={value!r}' in str(e)
  assert str(e).startswith(owner)


def test_traced_values_are_not_checked():
  calls = []

  @jax.jit
  def f(x):
    validation.check('f', 'x', x, lambda v: calls.append(v) or False, '> 0')
    return x

  f(-1.0)
  assert not calls


def test_choices_are_listed_in_order():
  with pytest.raises(validation.ArgumentError) as info:
    validation.check_choice('f', 'mode', 'c', ('a', 'b'))
  assert str(info.value) == "f: mode='c'; valid choices: a, b"
  assert info.value.choices == ('a', 'b') and info.value.problem is None
