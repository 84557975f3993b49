"""'sar' (Niu et al., ICLR 2023): reliable entropy (H < E0) minimised with
SAM.

The second gradient is taken at geom.sam's ascent point w + rho g / |g|
(`geom.sam.perturbation`) on the samples reliable at both points, and the
base optimizer steps with it. (We call the perturbation rather than the
`geom.sam.sam` transformation because the reset reads the loss at the
ascent point, which the transformation's `grad_fn` contract does not
return.) The moving average of that loss (0.9) falling below `reset_below`
(0.2 in SAR) resets the model to the source. SAR leaves the last block's
normalisation alone (layer4 of a ResNet); ours skips `bn_hidden`, the last
block of the CNN.
"""

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from geom import sam
from train.tta import interface


class SarState(NamedTuple):
  """adapted, opt_state, updates: as TENT's (`tent.TentState`);
  loss_ema: the moving average of the second-pass loss; has_ema: whether
  `loss_ema` holds one yet; resets: model resets so far."""
  adapted: interface.Flat
  opt_state: Any
  updates: jax.Array
  loss_ema: jax.Array
  has_ema: jax.Array
  resets: jax.Array


class Sar(interface.Method):
  """SAR: a SAM step on the reliable entropy, and resets on collapse."""
  SKIP: ClassVar[tuple[str, ...]] = ('bn_hidden',)

  def init(self) -> SarState:
    source = self.classifier.source
    return SarState(
        adapted=source, opt_state=self.tx.init(source),
        updates=jnp.zeros((), jnp.int32), loss_ema=jnp.zeros((), jnp.float32),
        has_ema=jnp.zeros((), bool), resets=jnp.zeros((), jnp.int32))

  def _reliable_entropy(self, adapted, images, keep=None):
    """(mean entropy over the samples reliable here (and in `keep`), (logits,
    entropies, those samples))."""
    logits = self.classifier.logits(adapted, images, True)
    h = interface.entropies(logits)
    reliable = jax.lax.stop_gradient(h) < interface.margin(
        self.settings.num_classes)
    if keep is not None:
      reliable = keep & reliable
    return jnp.sum(jnp.where(reliable, h, 0.0)) / jnp.maximum(
        jnp.sum(reliable), 1), (logits, h, reliable)

  def step(self, state: SarState, images: jax.Array
           ) -> tuple[SarState, dict[str, jax.Array]]:
    (_, (logits, h, keep1)), grads = jax.value_and_grad(
        self._reliable_entropy, has_aux=True)(state.adapted, images)
    # SAM's ascent point w + rho g / |g| (geom.sam's definition), and the
    # reliable entropy and its gradient there.
    e, _ = sam.perturbation(grads, state.adapted, self.settings.rho)
    (loss2, (_, _, keep2)), grads2 = jax.value_and_grad(
        self._reliable_entropy, has_aux=True)(
            sam.perturbed_params(state.adapted, e), images, keep1)
    gate = jnp.any(keep1)
    new = interface.gated_update(self.tx, state, grads2, h, gate)
    new, reset = self._average_or_reset(new, loss2,
                                        gate & (jnp.sum(keep2) > 0))
    return new, interface.outputs(logits, h, loss2, jnp.mean(keep1), gate,
                                  reset)

  def _average_or_reset(self, new: SarState, loss2, has_loss
                        ) -> tuple[SarState, jax.Array]:
    """`loss2` folded into the moving average, and the model reset to the
    source if the average fell below `reset_below`: (state, reset)."""
    decay = self.settings.ema_decay
    ema = jnp.where(new.has_ema, decay * new.loss_ema + (1 - decay) * loss2,
                    loss2)
    ema = jnp.where(has_loss, ema, new.loss_ema)
    has_ema = new.has_ema | has_loss
    reset = has_ema & (ema < self.settings.reset_below)
    fresh = self.init()
    new = jax.tree.map(lambda a, b: jnp.where(reset, a, b),
                       fresh._replace(resets=new.resets + 1,
                                      updates=new.updates),
                       new._replace(loss_ema=ema, has_ema=has_ema))
    return new, reset
