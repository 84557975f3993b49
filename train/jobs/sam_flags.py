"""SAM's flags that several studies share, parsed and checked before anything runs.

`radii('--rhos', values)`: SAM radii from a list flag (strings, as
absl gives them, or numbers, as a study's settings hold them).
"""

from collections.abc import Sequence

from train.errors import UsageError

__all__ = ['radii']


def radii(flag: str, values: Sequence[str | float]) -> tuple[float, ...]:
  """Distinct SAM radii in (0, 10), as floats.

  Raises:
    UsageError: naming `flag`, for an empty list, a value that is not a
      number, a repeated radius or one outside (0, 10).
  """
  shown = ','.join(map(str, values))
  try:
    rhos = tuple(float(v) for v in values)
  except (TypeError, ValueError):
    raise UsageError(flag, shown, 'not a list of numbers') from None
  if not rhos or len(set(rhos)) != len(rhos) or not all(
      0 < r < 10 for r in rhos):
    raise UsageError(flag, shown, 'needs distinct SAM radii in (0, 10)')
  return rhos
