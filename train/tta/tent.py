"""'tent' (Wang et al., ICLR 2021): minimise the mean prediction entropy
over the normalisation layers' affine parameters, with test-batch
statistics."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from train.tta import interface


class TentState(NamedTuple):
  """adapted: the adapted parameters; opt_state: their optimizer's state;
  updates: batches that changed the parameters."""
  adapted: interface.Flat
  opt_state: Any
  updates: jax.Array


class Tent(interface.Method):
  """Entropy minimisation on every batch."""

  def init(self) -> TentState:
    source = self.classifier.source
    return TentState(adapted=source, opt_state=self.tx.init(source),
                     updates=jnp.zeros((), jnp.int32))

  def step(self, state: TentState, images: jax.Array
           ) -> tuple[TentState, dict[str, jax.Array]]:
    def loss_fn(adapted):
      logits = self.classifier.logits(adapted, images, True)
      h = interface.entropies(logits)
      return jnp.mean(h), (logits, h)

    (loss, (logits, h)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.adapted)
    gate = jnp.asarray(images.shape[0] > 0)
    state = interface.gated_update(self.tx, state, grads, h, gate)
    return state, interface.outputs(logits, h, loss, 1.0, gate, False)
