"""docs/slow_tests.md lists every `slow` test once, with the fast test that
covers it and what that one leaves out, and no test that is not slow."""

import glob
import os

from tests import conftest

DOC = os.path.join(conftest.REPO_ROOT, 'docs', 'slow_tests.md')


def _rows() -> list[list[str]]:
  with open(DOC) as f:
    return [[cell.strip() for cell in line.strip().strip('|').split('|')]
            for line in f if line.startswith('| test')]


def test_every_slow_test_has_one_row_with_its_cover(request):
  items = list(request.session.items) + conftest.DESELECTED
  slow = {i.nodeid.removeprefix('tests/') for i in items
          if i.get_closest_marker('slow')}
  rows = _rows()
  listed = [row[0] for row in rows]
  assert len(listed) == len(set(listed)), 'a test listed twice'
  assert all(len(row) == 4 and all(row) for row in rows), [
      row[0] for row in rows if len(row) != 4 or not all(row)]
  assert not slow - set(listed), sorted(slow - set(listed))
  # Rows of tests that are not slow (or gone) only show when every test
  # file was collected.
  # Under Bazel this file runs alone from a runfiles tree that holds only
  # its own test file: the source tree's tests/ says what "every" is.
  files = {os.path.basename(str(i.path)) for i in items}
  tests_dir = os.path.dirname(os.path.realpath(__file__))
  if files >= {os.path.basename(p) for p in glob.glob(
      os.path.join(tests_dir, 'test_*.py'))}:
    assert not set(listed) - slow, sorted(set(listed) - slow)
