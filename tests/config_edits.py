"""Config changes named by dotted paths, as `--config.a.b=v` would make them."""

from typing import Any, Mapping

import ml_collections


def apply(config: ml_collections.ConfigDict,
          changes: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Sets each `'a.b.c': value` of `changes` in `config`; returns it."""
  for path, value in changes.items():
    *parents, name = path.split('.')
    block = config
    for parent in parents:
      block = block[parent]
    block[name] = value
  return config
