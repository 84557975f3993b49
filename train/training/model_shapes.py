"""A model's variables as shapes, traced once per model in a process.

`abstract_variables(init_variables)` is `jax.eval_shape(init_variables,
key)`: the variables' shapes and dtypes, boxed with their logical axes.
A run asks for them when it is assembled, again for each run it loads,
and the RL job's checks and compile-only programs ask too; each asking
traced the model's whole `init`. Given a `functools.partial` of a
module-level function over hashable arguments (a flax module compares by
its fields), the shapes are traced once and shared; anything else is
traced each time. The result is shared: read it, never change it.
"""

import functools
from typing import Any, Callable, Mapping

import jax


def abstract_variables(
    init_variables: Callable[[jax.Array], Mapping[str, Any]]) -> Any:
  """`jax.eval_shape(init_variables, jax.random.key(0))`, cached as above."""
  if isinstance(init_variables, functools.partial):
    key = (init_variables.func, init_variables.args,
           tuple(sorted(init_variables.keywords.items())))
    try:
      hash(key)
    except TypeError:  # An argument holds an array.
      pass
    else:
      return _cached(key)
  return _trace(init_variables)


def _trace(init_variables) -> Any:
  return jax.eval_shape(init_variables, jax.random.key(0))


@functools.lru_cache(maxsize=32)
def _cached(key) -> Any:
  func, args, keywords = key
  return _trace(functools.partial(func, *args, **dict(keywords)))
