"""The source classifier with its adapted parameters split out.

Every method adapts the normalisation layers' affine parameters (modules
named bn*, leaves scale and bias) and leaves the rest frozen; a
`Classifier` holds both halves and runs the model on a candidate for the
adapted half.
"""

from collections.abc import Mapping
from typing import Any

import flax
import flax.linen as nn
import jax

Flat = dict[str, jax.Array]


def adapted_names(params: Mapping[str, Any], skip: tuple[str, ...] = ()
                  ) -> list[str]:
  """'module/leaf' names of the normalisation layers' affine parameters
  (modules named bn*, leaves scale and bias), minus modules in `skip`."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep='/')
  return sorted(name for name in flat
                if name.split('/')[-1] in ('scale', 'bias')
                and name.split('/')[-2].startswith('bn')
                and name.split('/')[-2] not in skip)


def split(params, names: list[str]) -> tuple[Flat, Flat]:
  """(adapted, frozen) flat dicts of `params`."""
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep='/')
  adapted = {n: flat[n] for n in names}
  frozen = {n: v for n, v in flat.items() if n not in adapted}
  return adapted, frozen


def merge(adapted: Flat, frozen: Flat) -> dict:
  return flax.traverse_util.unflatten_dict({**frozen, **adapted}, sep='/')


class Classifier(flax.struct.PyTreeNode):
  """A pytree of the source model's arrays, so that a jitted step takes
  them as arguments instead of baking them into the program as constants.

  Attributes:
    model: the Flax classifier.
    frozen: the source parameters that are not adapted.
    source: the adapted parameters' source values (EATA's anchor, resets).
    batch_stats: the source model's running BN statistics.
  """
  model: nn.Module = flax.struct.field(pytree_node=False)
  frozen: Flat
  source: Flat
  batch_stats: Any

  def logits(self, adapted: Flat, images: jax.Array,
             batch_statistics: bool) -> jax.Array:
    variables = {'params': merge(adapted, self.frozen)}
    if self.batch_stats:
      variables['batch_stats'] = self.batch_stats
      if batch_statistics:
        # Normalise with the batch's statistics; the updated running
        # averages are dropped (TENT does not keep them).
        return self.model.apply(variables, images, train=True,
                                mutable=['batch_stats'])[0]
    return self.model.apply(variables, images, train=False)


def bind(model: nn.Module, params, batch_stats,
         skip: tuple[str, ...] = ()) -> Classifier:
  """`params` split into adapted (minus modules in `skip`) and frozen."""
  adapted, frozen = split(params, adapted_names(params, skip))
  return Classifier(model=model, frozen=frozen, source=adapted,
                    batch_stats=batch_stats or {})
