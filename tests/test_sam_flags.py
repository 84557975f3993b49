"""train.jobs.sam_flags: the SAM radii a study's --rhos gives, from
absl's strings or a settings tuple, and one line naming the flag for each
kind of mistake."""

import pytest

from train.errors import UsageError
from train.jobs import sam_flags


def test_radii_from_strings_and_numbers():
  assert sam_flags.radii('--rhos', ['0.05', '1e-2']) == (0.05, 0.01)
  assert sam_flags.radii('--rhos', (0.5, 2)) == (0.5, 2.0)


@pytest.mark.parametrize('values, problem', [
    ([], 'distinct SAM radii'), (['x'], 'not a list of numbers'),
    ([None], 'not a list of numbers'), (['0.1', '0.10'], 'distinct'),
    ([0.0], 'in \\(0, 10\\)'), ([-1.0], 'in \\(0, 10\\)'),
    ([10.0], 'in \\(0, 10\\)'), ([float('nan')], 'in \\(0, 10\\)')])
def test_bad_radii_name_the_flag(values, problem):
  with pytest.raises(UsageError, match=f'--rhos.*{problem}'):
    sam_flags.radii('--rhos', values)
