"""The Bazel BUILD files cover every Python file and mirror its imports.

Each BUILD file is parsed as Python (Starlark's syntax here is a subset).
Checks: every .py file in the repo's packages is in some target's srcs;
every import of a repo module from a target's sources is satisfied by the
target itself or one of its direct deps; every dep names a real target.
"""

import ast
import os
import re

import pytest

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, which is what this test checks.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
PACKAGES = ('bench', 'configs', 'geom', 'launch', 'studies', 'tests', 'train')
# Vendored data the Python targets read (no Python in them).
DATA_PACKAGES = ('third_party/xla_gpu_targets',)
RULES = ('py_library', 'py_binary', 'py_test', 'pytest_test', 'filegroup')


def _strings(node):
  if node is None:
    return []
  return [ast.literal_eval(e) for e in node.elts]


def _targets():
  """{'//pkg:name': {'srcs': [paths], 'deps': [labels]}} over all BUILD files."""
  targets = {}
  packages = [''] + sorted(
      os.path.relpath(dirpath, REPO_ROOT)
      for top in PACKAGES
      for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, top))
      if 'BUILD' in files) + list(DATA_PACKAGES)
  for package in packages:
    path = os.path.join(REPO_ROOT, package, 'BUILD')
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for call in ast.walk(tree):
      if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
              and call.func.id in RULES):
        continue
      kw = {k.arg: k.value for k in call.keywords}
      name = ast.literal_eval(kw['name'])
      srcs = _strings(kw.get('srcs'))
      if call.func.id == 'pytest_test':
        srcs = [f'{name}.py', 'pytest_main.py']
      deps = _strings(kw.get('deps')) + _strings(kw.get('data'))
      if call.func.id == 'pytest_test':
        deps.append(':conftest')
      deps = [f'//{package}{d}' if d.startswith(':') else d for d in deps]
      targets[f'//{package}:{name}'] = {
          'srcs': [os.path.join(package, s) for s in srcs], 'deps': deps}
  return targets


def _python_files():
  out = []
  for package in PACKAGES:
    for dirpath, dirnames, files in os.walk(os.path.join(REPO_ROOT, package)):
      dirnames[:] = [d for d in dirnames if d != '__pycache__']
      out += [os.path.relpath(os.path.join(dirpath, f), REPO_ROOT)
              for f in files if f.endswith('.py')]
  return sorted(out)


def _repo_imports(path):
  """Repo files that the module at `path` imports (package __init__ or module)."""
  with open(os.path.join(REPO_ROOT, path)) as f:
    tree = ast.parse(f.read(), path)
  modules = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      modules.add(node.module)
      modules.update(f'{node.module}.{a.name}' for a in node.names)
  files = set()
  for module in modules:
    if module.split('.')[0] not in PACKAGES:
      continue
    base = module.replace('.', '/')
    if os.path.exists(os.path.join(REPO_ROOT, base + '.py')):
      files.add(base + '.py')
  return files


TARGETS = _targets()
OWNERS = {}
for _label, _target in TARGETS.items():
  for _src in _target['srcs']:
    OWNERS.setdefault(_src, set()).add(_label)


def test_every_python_file_belongs_to_a_target():
  orphans = [p for p in _python_files() if p not in OWNERS]
  assert not orphans, f'not in any BUILD target: {orphans}'


def test_every_src_exists():
  missing = [s for t in TARGETS.values() for s in t['srcs']
             if not os.path.exists(os.path.join(REPO_ROOT, s))]
  assert not missing


@pytest.mark.parametrize('label', sorted(TARGETS))
def test_deps_name_real_targets_and_cover_the_imports(label):
  target = TARGETS[label]
  for dep in target['deps']:
    assert dep in TARGETS or dep.startswith('//:'), f'{label}: unknown {dep}'
  provided = set(target['srcs'])
  for dep in target['deps']:
    provided.update(TARGETS.get(dep, {'srcs': []})['srcs'])
  for src in (s for s in target['srcs'] if s.endswith('.py')):
    for imported in _repo_imports(src):
      assert imported in provided, (
          f'{label}: {src} imports {imported}, but no direct dep provides it '
          f'(add one of {sorted(OWNERS.get(imported, ["<no target>"]))})')


def _runs_code(init: str) -> bool:
  """Whether a package's __init__.py does more than re-export its package
  (a docstring, `__all__`, `__version__`, imports from the package itself):
  an empty one in its place would change what a program does."""
  package = os.path.dirname(init).replace('/', '.')
  with open(os.path.join(REPO_ROOT, init)) as f:
    body = ast.parse(f.read(), init).body
  for n in body:
    if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant):
      continue
    if isinstance(n, ast.Assign) and all(
        isinstance(t, ast.Name) and t.id in ('__all__', '__version__')
        for t in n.targets):
      continue
    if isinstance(n, ast.ImportFrom) and not n.level and (
        n.module == package or n.module.startswith(package + '.')):
      continue
    return True
  return False


CODE_INITS = {p for p in _python_files()
              if p.endswith('__init__.py') and _runs_code(p)}


def _closure(label):
  seen, todo = set(), [label]
  while todo:
    current = todo.pop()
    if current in seen or current not in TARGETS:
      continue
    seen.add(current)
    todo += TARGETS[current]['deps']
  return {s for t in seen for s in TARGETS[t]['srcs']}


def _enclosing_inits(path):
  parts = path.split('/')[:-1]
  return {'/'.join(parts[:i] + ['__init__.py']) for i in range(1, len(parts) + 1)}


@pytest.mark.parametrize('label', sorted(TARGETS))
def test_packages_whose_init_runs_code_are_in_the_runfiles(label):
  # Bazel puts an EMPTY __init__.py into every runfiles directory that has
  # none: a target that reaches launch/ without //launch:package ran
  # without launch's start-up Ctrl-C handler (a traceback, or a segfault
  # inside jaxlib's import, under `bazel test` only).
  target = TARGETS[label]
  needed = set()
  for src in (s for s in target['srcs'] if s.endswith('.py')):
    needed |= _enclosing_inits(src)
    for imported in _repo_imports(src):
      needed |= _enclosing_inits(imported)
  missing = sorted((needed & CODE_INITS) - _closure(label))
  assert not missing, (
      f'{label} runs {missing} in Python but Bazel would give it an empty '
      'one: add the package target (e.g. //launch:package) to its deps')


_MODULE_NAME = re.compile(r'^(?:launch|studies|bench)(?:\.\w+)+$')
_CONFIG_FLAG = re.compile(r'^--config=(configs/\w+\.py)\b')


def _module_file(name):
  base = name.replace('.', '/')
  for candidate in (base + '.py', base + '/__main__.py'):
    if os.path.exists(os.path.join(REPO_ROOT, candidate)):
      return candidate
  return None


def _started_modules(node):
  """'launch.rl' in `[sys.executable, '-m', 'launch.rl', ...]` or in
  `run_module('launch.rl', ...)`."""
  if isinstance(node, (ast.List, ast.Tuple)):
    items = node.elts
    if (items and isinstance(items[0], ast.Attribute)
        and items[0].attr == 'executable'):
      for flag, module in zip(items, items[1:]):
        if (isinstance(flag, ast.Constant) and flag.value == '-m'
            and isinstance(module, ast.Constant)):
          yield module.value
  elif (isinstance(node, ast.Call) and node.args
        and getattr(node.func, 'attr', getattr(node.func, 'id', None))
        == 'run_module' and isinstance(node.args[0], ast.Constant)):
    yield node.args[0].value


def _files_run_by_name(path):
  """Repo files a test starts by name: a module it runs in a subprocess
  (`python -m launch.rl`), or a config it passes by path
  ('--config=configs/rl.py:gemma')."""
  with open(os.path.join(REPO_ROOT, path)) as f:
    tree = ast.parse(f.read(), path)
  found = set()
  for node in ast.walk(tree):
    for module in _started_modules(node):
      if isinstance(module, str) and _MODULE_NAME.match(module):
        found.add(_module_file(module))
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      config = _CONFIG_FLAG.match(node.value)
      if config and os.path.exists(os.path.join(REPO_ROOT, config.group(1))):
        found.add(config.group(1))
  return found - {None}


@pytest.mark.parametrize('label', sorted(
    l for l in TARGETS if l.startswith('//tests:')))
def test_what_a_test_starts_by_name_is_in_its_runfiles(label):
  # A subprocess (`python -m launch.rl`) imports what its own target would
  # bring: under Bazel only the test's runfiles exist (test_gemma_training
  # ran launch.rl without train/rl/processes.py there).
  needed = set()
  for src in TARGETS[label]['srcs']:
    if src.endswith('.py') and os.path.exists(os.path.join(REPO_ROOT, src)):
      needed |= _files_run_by_name(src)
  missing = sorted(needed - _closure(label))
  assert not missing, (
      f'{label} starts {missing} by name: add their targets to its data '
      '(e.g. //launch:rl, //configs:rl)')
