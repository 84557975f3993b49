"""The methods that predict without adapting: 'source' (the model as
trained, running BN statistics) and 'bn_stats' (normalisation with the test
batch's statistics, no update; Schneider et al. 2020; Nado et al. 2020)."""

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from train.tta import interface


class Unadapted(NamedTuple):
  """The source's adapted parameters, as they stay."""
  adapted: interface.Flat


class _Predict(interface.Method):
  """Predicts with the source parameters; nothing changes."""
  BATCH_STATISTICS: ClassVar[bool] = False

  def init(self) -> Unadapted:
    return Unadapted(adapted=self.classifier.source)

  def step(self, state: Unadapted, images: jax.Array
           ) -> tuple[Unadapted, dict[str, jax.Array]]:
    logits = self.classifier.logits(state.adapted, images,
                                    self.BATCH_STATISTICS)
    h = interface.entropies(logits)
    return state, interface.outputs(logits, h, jnp.mean(h), 1.0, False,
                                    False)


class Source(_Predict):
  """'source': the model as trained."""


class BNStats(_Predict):
  """'bn_stats': normalisation with the test batch's statistics."""
  BATCH_STATISTICS: ClassVar[bool] = True
