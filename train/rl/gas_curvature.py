"""GAS's curvature probe: |lambda_max| of the answer-token NLL on each
difficulty's last learner batch, every `gas.curvature_every` versions
(`geom.gas.curvature`), for the scheduler (`train.rl.scheduler.Gas`)."""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from geom import gas
from train.rl import grpo


class Curvature:
  """Keeps each difficulty's last learner batch and estimates the
  curvature there when a version asks for it."""

  def __init__(self, every: int, rows: int, iters: int, method: str,
               temperature: float, seed: int):
    self._every, self._rows, self._iters = every, rows, iters
    self._method, self._temperature, self._seed = method, temperature, seed
    self._last_batch: dict[int, Any] = {}  # Difficulty -> a learner batch.

  def needed(self, version: int) -> bool:
    return bool(self._every) and version % self._every == 0

  def remember(self, difficulty: int, batch: Any) -> None:
    """Keeps a learner batch of `difficulty` for the next estimate."""
    self._last_batch[difficulty] = batch

  def estimate(self, model, params, version: int) -> dict[int, float]:
    """|lambda_max| of the answer-token NLL on each difficulty's last batch."""
    out = {}
    for d in sorted(self._last_batch):
      batch = self._last_batch[d]
      rows = min(self._rows, batch.tokens.shape[0])
      sub = jax.tree.map(lambda x: x[:rows], batch)
      key = jax.random.fold_in(jax.random.key(self._seed + 7919),
                               version * 64 + d)
      out[d] = float(batch_curvature(model, params, sub, key,
                                     self._temperature, self._method,
                                     self._iters))
    return out


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def batch_curvature(model, params: Any, batch: grpo.Batch, key: jax.Array,
                    temperature: float, method: str, iters: int
                    ) -> jax.Array:
  """|lambda_max| of the mean answer-token NLL of `batch` at `params`: the
  curvature a policy-gradient step on these samples sees (geom.gas)."""

  def nll(p):
    logps = grpo.sequence_log_probs(model, p, batch.tokens, batch.valid,
                                    temperature)
    mask = batch.loss_mask
    return -jnp.sum(logps * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  return gas.curvature(nll, params, key, method, iters)
