"""Config changes named by dotted paths, as `--config.a.b=v` would make them."""

import ast
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


def apply_flags(config: ml_collections.ConfigDict,
                flags) -> ml_collections.ConfigDict:
  """Applies `--config.a.b=v` flags as the launcher's command line would:
  `v` a Python literal, else a string (`--config.scheduler=gas`)."""
  for flag in flags:
    path, value = flag[len('--config.'):].split('=', 1)
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    apply(config, {path: value})
  return config
