"""What the Python files of a folder import, read from their syntax."""

import ast
import os


def top_level_imports(folder: str) -> set[str]:
  """Top-level modules the .py files under `folder` import (absolute
  imports only: a relative one names a module of the same package)."""
  modules = set()
  for dirpath, dirnames, files in os.walk(folder):
    dirnames[:] = [d for d in dirnames if d != '__pycache__']
    for filename in (f for f in files if f.endswith('.py')):
      path = os.path.join(dirpath, filename)
      with open(path) as f:
        tree = ast.parse(f.read(), path)
      for node in ast.walk(tree):
        if isinstance(node, ast.Import):
          modules.update(a.name.split('.')[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
          modules.add(node.module.split('.')[0])
  return modules
