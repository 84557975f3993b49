"""Arbitrary weights for an untrained model, drawn by numpy."""

import jax
import jax.numpy as jnp
import numpy as np


def draw(model, seed: int, example_len: int = 8):
  """Weights in `model.init`'s shapes and scales (embeddings N(0, 1),
  kernels lecun-normal, 1-d scales 1), drawn by numpy.

  `model.init` compiles its threefry initialisers for seconds on a CPU,
  jitted or op by op; tests that need only arbitrary weights use these.
  """
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, example_len), jnp.int32))['params']
  rng = np.random.default_rng(seed)

  def one(path, x):
    if x.ndim == 1:
      return np.ones(x.shape, x.dtype)
    std = (1.0 if any(getattr(k, 'key', None) == 'embedding' for k in path)
           else 1 / np.sqrt(np.prod(x.shape[:-1])))
    return (std * rng.standard_normal(x.shape)).astype(x.dtype)

  return jax.device_put(jax.tree_util.tree_map_with_path(one, shapes))
