"""No function over 80 lines and no class over 150 in geom/, train/, launch/
and studies/, docstrings included (what the reader of a unit holds in mind
at once; a long docstring's rationale belongs in docs/)."""

import ast
import os

import pytest

# Under Bazel the test runs from a runfiles tree of symlinks: follow them to
# the source tree, which is what this test reads.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
TREES = ('geom', 'train', 'launch', 'studies')
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 150


def _python_files():
  for top in TREES:
    for dirpath, dirnames, files in os.walk(os.path.join(REPO_ROOT, top)):
      dirnames[:] = sorted(d for d in dirnames if d != '__pycache__')
      for f in sorted(files):
        if f.endswith('.py'):
          yield os.path.relpath(os.path.join(dirpath, f), REPO_ROOT)


def long_units(source: str, path: str = '<source>') -> list[str]:
  """'path:line kind name (n lines)' for every unit over its limit."""
  out = []
  for node in ast.walk(ast.parse(source, path)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      kind, limit = 'def', MAX_FUNCTION_LINES
    elif isinstance(node, ast.ClassDef):
      kind, limit = 'class', MAX_CLASS_LINES
    else:
      continue
    # From the first decorator: it is part of what a reader reads.
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = node.end_lineno - first + 1
    if lines > limit:
      out.append(f'{path}:{node.lineno} {kind} {node.name} ({lines} lines)')
  return out


def test_the_counter_sees_nested_functions_methods_and_decorators():
  body = '\n'.join(f'  x{i} = {i}' for i in range(MAX_FUNCTION_LINES - 1))
  fits = f'def f():\n{body}\n'
  assert long_units(fits) == []
  assert long_units(f'@deco\n{fits}') == [
      f'<source>:2 def f ({MAX_FUNCTION_LINES + 1} lines)']
  nested = 'class C:\n  def g(self):\n    def h():\n' + '\n'.join(
      f'      y{i} = {i}' for i in range(MAX_FUNCTION_LINES)) + '\n'
  assert [u.split()[2] for u in long_units(nested)] == ['g', 'h']
  big = 'class D:\n' + '\n'.join(f'  z{i} = {i}' for i in range(
      MAX_CLASS_LINES)) + '\n'
  assert long_units(big) == [f'<source>:1 class D ({MAX_CLASS_LINES + 1} lines)']


@pytest.mark.parametrize('top', TREES)
def test_no_long_functions_or_classes(top):
  found = []
  for path in _python_files():
    if path.startswith(top + os.sep):
      with open(os.path.join(REPO_ROOT, path)) as f:
        found += long_units(f.read(), path)
  assert not found, '\n'.join(found)
