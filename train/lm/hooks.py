"""Steering any Flax linen model at chosen layers, without editing its code.

`steered(...)` is a context manager around `model.apply` that intercepts
the `__call__` of the modules at the chosen paths (Flax method
interception, `nn.intercept_methods`) and replaces their output's hidden
state by the steered one at the tokens of a mask. A module's output may
be the hidden state itself or a tuple whose first element it is (as in
`train.lm.decoder.Block`, which also returns its keys and values).

Layers are named by index: `layer_paths(params)` lists the model's layer
modules in order, found in the parameter tree by a name pattern
(`block_<i>` here; `layers_<i>` for models built with `nn.scan`-free
lists in the usual Flax style), so an index out of range fails before
anything runs.

The recorder the context manager yields holds, after the apply, the
steering statistics (`geom.steering.SteerStats`) and, when asked, the
per-token norm of each watched layer's output (for the norm ratio at and
after the steered layer).

Example (inside or outside jit):

  with steering_hooks.steered(steer, 'block_2', mask) as rec:
    logits, _ = model.apply({'params': params}, tokens)
  rec.stats.trigger_rate
"""

from collections.abc import Mapping
import contextlib
import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from geom import steering as steering_lib

DEFAULT_LAYER_PATTERN = r'(?:^|/)(?:block|layers)_(\d+)$'


def layer_paths(params: Any, pattern: str = DEFAULT_LAYER_PATTERN) -> list[str]:
  """Module paths ('a/b/block_3') of the layers in `params`, by layer number."""
  found = []

  def walk(tree, path):
    if not isinstance(tree, Mapping):
      return
    for key, sub in tree.items():
      p = f'{path}/{key}' if path else key
      m = re.search(pattern, p)
      if m and isinstance(sub, Mapping):
        found.append((int(m.group(1)), p))
      else:
        walk(sub, p)

  walk(params, '')
  return [p for _, p in sorted(found)]


def resolve_layer(params: Any, layer: int,
                  pattern: str = DEFAULT_LAYER_PATTERN) -> str:
  """The module path of layer `layer`; ValueError naming `layer` if out of range."""
  paths = layer_paths(params, pattern)
  if not paths:
    raise ValueError(f'layer: the model has no modules matching {pattern!r}')
  if not isinstance(layer, int) or not 0 <= layer < len(paths):
    raise ValueError(f'layer={layer!r}: out of range; the model has '
                     f'{len(paths)} layers (valid: 0..{len(paths) - 1})')
  return paths[layer]


@dataclasses.dataclass
class Recorder:
  """What one steered apply saw (values are traced inside jit).

  Attributes:
    stats: the steering statistics at the steered layer (None until run,
      or when nothing was steered).
    norms: per watched layer path, the (batch, seq) norms of its output,
      after steering.
    hidden: per captured layer path, its output (batch, seq, dim), after
      steering.
  """
  stats: steering_lib.SteerStats | None = None
  norms: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  hidden: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


def _split(output):
  if isinstance(output, tuple):
    return output[0], lambda h: (h,) + tuple(output[1:])
  return output, lambda h: h


@contextlib.contextmanager
def steered(steering: steering_lib.Steering | None, layer_path: str | None,
            token_mask: jax.Array | None = None,
            watch: tuple[str, ...] = (), capture: tuple[str, ...] = ()):
  """Steers the output of module `layer_path` during the applies inside the block.

  Args:
    steering: the operator (None: nothing is steered, only watched).
    layer_path: module path of the steered layer (see `resolve_layer`).
    token_mask: (batch, seq) bool, the tokens to steer (None: all).
    watch: module paths whose output norms to record.
    capture: module paths whose outputs to record (e.g. for extraction).

  Yields:
    A `Recorder`, filled once the apply has run.
  """
  recorder = Recorder()
  targets = set(watch) | set(capture) | ({layer_path} if steering is not None else set())

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name != '__call__':
      return out
    path = '/'.join(context.module.path)
    if path not in targets:
      return out
    hidden, rebuild = _split(out)
    if steering is not None and path == layer_path:
      hidden, stats = steering(hidden, token_mask)
      recorder.stats = stats
    if path in watch:
      recorder.norms[path] = jnp.linalg.norm(hidden.astype(jnp.float32),
                                             axis=-1)
    if path in capture:
      recorder.hidden[path] = hidden
    return rebuild(hidden)

  with nn.intercept_methods(interceptor):
    yield recorder
