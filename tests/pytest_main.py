"""Entry point of every Bazel py_test: runs one test file under pytest.

A test file run as a plain script would skip conftest.py (8 simulated
devices, private data directory) and pyproject.toml (markers, options).
"""

import sys

import pytest

if __name__ == '__main__':
  sys.exit(pytest.main(['-p', 'no:cacheprovider', *sys.argv[1:]]))
