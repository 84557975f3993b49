"""The layering of train/: a shared core that names no method and no product.

The core (train/*.py and its packages run/, training/, compilation/,
analysis/) reaches a method only through
`geom.method_hooks.MethodHooks`; `train/training/optim.py` is the one module that
maps a method's config block to its geom factory. Products
(train/vision, train/lm, train/steering, train/tta, train/rl) build on
the core, and the core imports none of them.
"""

import ast
import os
import re

import pytest

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, which is what this test reads.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
TRAIN = os.path.join(REPO_ROOT, 'train')
# The core by concern, each package importing only those after it here (and
# train/errors.py, train/fileio.py): compilation for targets builds on the
# training loop, which builds on the run core (a workdir's lock,
# checkpoints, metrics logs and stop signals); analysis (statistics and
# plots) reads the run core's metrics.
CORE_PACKAGES = ('compilation', 'training', 'analysis', 'run')
CORE = sorted([f for f in os.listdir(TRAIN) if f.endswith('.py')] + [
    os.path.join(p, f) for p in CORE_PACKAGES
    for f in os.listdir(os.path.join(TRAIN, p)) if f.endswith('.py')])
# The one bridge from config blocks to geom's factories.
BRIDGE = os.path.join('training', 'optim.py')
PRODUCTS = ('vision', 'lm', 'steering', 'tta', 'rl')
METHOD_WORDS = re.compile(r'\b(sam|asam|hallucinat\w*|steer\w*|conga|gas)\b',
                          re.IGNORECASE)


def _imports(path):
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      yield from (f'{node.module}.{a.name}' for a in node.names)


# __init__.py lists the product subpackages, steering among them.
@pytest.mark.parametrize('name', [f for f in CORE
                                  if f not in (BRIDGE, '__init__.py')])
def test_core_modules_name_no_method(name):
  with open(os.path.join(TRAIN, name)) as f:
    text = f.read()
  hits = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines())
          if METHOD_WORDS.search(line)]
  assert not hits, f'train/{name} names a method: {hits}'
  geom_imports = {m for m in _imports(os.path.join(TRAIN, name))
                  if m.startswith('geom')}
  assert geom_imports <= {'geom.method_hooks', 'geom.validation',
                          'geom.validation.ArgumentError'}, geom_imports


def test_the_loop_and_the_step_builder_do_not_even_contain_the_letters():
  # What `grep -rn sam train/training/{loop,steps,aot}.py` checks.
  for name in ('training/loop.py', 'training/steps.py', 'training/aot.py'):
    with open(os.path.join(TRAIN, name)) as f:
      assert 'sam' not in f.read().lower(), name


@pytest.mark.parametrize('name', CORE)
def test_core_modules_import_no_product(name):
  products = [m for m in _imports(os.path.join(TRAIN, name))
              if m.split('.')[:2][-1] in PRODUCTS and m.startswith('train.')]
  assert not products, f'train/{name} imports {products}'


def test_the_core_packages_import_only_those_below_them():
  # One box each in an import graph: compilation -> training -> analysis
  # -> run, never back up (the check that found metrics on the wrong side
  # of run, and aot on the wrong side of training).
  for i, package in enumerate(CORE_PACKAGES):
    below = set(CORE_PACKAGES[i:]) | {'errors', 'fileio'}
    for f in os.listdir(os.path.join(TRAIN, package)):
      if not f.endswith('.py'):
        continue
      for module in _imports(os.path.join(TRAIN, package, f)):
        parts = module.split('.')
        if parts[0] == 'train' and len(parts) > 1:
          assert parts[1] in below, (
              f'train/{package}/{f} imports {module}: above it')


def test_products_depend_on_each_other_only_where_documented():
  # The steering evaluation runs the LM and steers its layers through
  # train.lm.hooks (steering -> lm); test-time adaptation adapts
  # the image classifiers on corrupted images (tta -> vision); RL trains
  # the decoder LM as its policy (rl -> lm). Vision stands alone.
  allowed = {('steering', 'lm'): None, ('tta', 'vision'): None,
             ('rl', 'lm'): None}
  for product in PRODUCTS:
    for f in os.listdir(os.path.join(TRAIN, product)):
      if not f.endswith('.py'):
        continue
      for module in _imports(os.path.join(TRAIN, product, f)):
        parts = module.split('.')
        if parts[0] != 'train' or len(parts) < 2 or parts[1] not in PRODUCTS:
          continue
        other = parts[1]
        if other == product:
          continue
        edge = allowed.get((product, other), set())
        target = '.'.join(parts[:3])
        assert edge is None or target in edge, (
            f'train/{product}/{f} imports {module}')


def test_benchmarks_import_no_other_benchmark_with_flags():
  # Each benchmark is a main with its own absl flags: importing another
  # one defines its flags twice and the importer dies at start-up
  # (bench.generation.gemma did, through the steering benchmark's --steps).
  # Shared code lives in flag-free modules. Benchmarks sit in bench/'s
  # subpackages by subject, so the walk goes down into them.
  modules = {}
  for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, 'bench')):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(dirpath, f)
        name = os.path.relpath(path, REPO_ROOT)[:-len('.py')]
        modules[name.replace(os.sep, '.')] = path
  assert 'bench.generation.steering' in modules, sorted(modules)
  defines = {m for m, path in modules.items()
             if 'flags.DEFINE' in open(path).read()}
  for module, path in sorted(modules.items()):
    imported = {d for m in _imports(path) for d in defines
                if m == d or m.startswith(d + '.')}
    assert not imported, f'{module} imports {imported}'


def test_nothing_but_tests_imports_studies():
  # Studies sit on top: they import train/, launch/ and configs/, and no
  # library, trainer, entry point, config or benchmark imports a study.
  for top in ('geom', 'train', 'launch', 'configs', 'bench'):
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, top)):
      for f in files:
        if not f.endswith('.py'):
          continue
        path = os.path.join(dirpath, f)
        studies = [m for m in _imports(path)
                   if m == 'studies' or m.startswith('studies.')]
        assert not studies, f'{os.path.relpath(path, REPO_ROOT)} imports {studies}'


def test_only_launch_and_above_import_the_launchers_library():
  # train/jobs runs what launch's mains ask for (exit codes, multi-host
  # start, compile and sweep jobs): the core and the products it runs
  # never reach up into it.
  jobs = os.path.join(TRAIN, 'jobs')
  for dirpath, _, files in os.walk(TRAIN):
    if dirpath.startswith(jobs):
      continue
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(dirpath, f)
        up = [m for m in _imports(path) if m.startswith('train.jobs')
              or m.startswith('launch')]
        assert not up, f'{os.path.relpath(path, REPO_ROOT)} imports {up}'


# A flax example's main.py is about 60 lines; ours carry a docstring with
# their commands and the flags: 'about 100 lines' leaves room for those.
MAX_ENTRY_POINT_LINES = 110


@pytest.mark.parametrize('name', sorted(
    f for f in os.listdir(os.path.join(REPO_ROOT, 'launch'))
    if f.endswith('.py')))
def test_launch_holds_only_thin_entry_points(name):
  with open(os.path.join(REPO_ROOT, 'launch', name)) as f:
    lines = f.read().count('\n')
  assert lines <= MAX_ENTRY_POINT_LINES, (
      f'launch/{name} has {lines} lines: its work belongs in train/ (or in '
      'its study\'s room), its main in launch/')


def test_no_study_lives_outside_studies():
  # A study's code, configs and results live in studies/<name>/; the
  # library, the trainers and the entry points hold none.
  for top in ('launch', 'train', 'configs'):
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, top)):
      studies = [f for f in files if f.endswith('.py') and 'study' in f]
      assert not studies, f'{os.path.relpath(dirpath, REPO_ROOT)}: {studies}'
  assert not os.path.exists(os.path.join(REPO_ROOT, 'results')), (
      'results/ moved into the studies\' rooms (studies/<name>/results/)')
