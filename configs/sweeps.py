"""Building blocks for `get_sweep(name)` in config modules.

A sweep is a list of override dicts, `{'dotted.field': value, ...}`, one
per run, applied on top of `get_config(arg)`. `python -m launch.sweep`
expands it into `launch.train` command lines.

  def get_sweep(name):
    return sweeps.select(name, {
        'lr': lambda: sweeps.product({'optimizer.learning_rate': [0.03, 0.1],
                                      'seed': [0, 1, 2]}),
    })

Order is part of the contract: `product` varies the last key fastest (as
nested loops in the order given), `zipped` pairs values position by
position.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
import itertools
from typing import Any

Overrides = dict[str, Any]


def product(axes: Mapping[str, Sequence[Any]]) -> list[Overrides]:
  """Every combination of the axes' values; the last key varies fastest."""
  keys = list(axes)
  for key in keys:
    if isinstance(axes[key], (str, bytes)) or not axes[key]:
      raise ValueError(f'sweep axis {key!r} needs a non-empty list of '
                       f'values, got {axes[key]!r}')
  return [dict(zip(keys, values))
          for values in itertools.product(*(axes[k] for k in keys))]


def zipped(axes: Mapping[str, Sequence[Any]]) -> list[Overrides]:
  """Values taken together position by position (all axes of one length)."""
  lengths = {k: len(v) for k, v in axes.items()}
  if len(set(lengths.values())) > 1:
    raise ValueError(f'zipped sweep axes differ in length: {lengths}')
  return [dict(zip(axes, values)) for values in zip(*axes.values())]


def combine(*parts: Iterable[Overrides]) -> list[Overrides]:
  """The cross product of several sweeps (e.g. zipped pairs x seeds)."""
  out = [{}]
  for part in parts:
    out = [{**a, **b} for a in out for b in part]
  return out


def select(name: str,
           table: Mapping[str, Callable[[], list[Overrides]]]) -> list[Overrides]:
  """`table[name]()`, or a ValueError listing the valid sweep names."""
  if name not in table:
    raise ValueError(f'--sweep={name!r}: unknown sweep; valid choices: '
                     f'{", ".join(map(repr, sorted(table)))}')
  return table[name]()
