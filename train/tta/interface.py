"""What every test-time adaptation method shares: its settings, the
interface the loop calls (`init`, `step`), its outputs and the gated
optimizer step of the adapting methods."""

import dataclasses
import math
from typing import ClassVar, Protocol

import flax
import jax
import jax.numpy as jnp
import optax

from geom import conga
from train.tta import classifier as classifier_lib

Flat = classifier_lib.Flat
# SAR's margin, and EATA's: E0 = 0.4 ln C.
MARGIN_FRACTION = 0.4

# Per-sample prediction entropy in nats, in float32: (batch,). CONGA's, so
# that the loss and the schedule read one entropy (-inf logits included).
entropies = conga.entropies_from_logits


def margin(num_classes: int) -> float:
  """E0 = 0.4 ln C, the entropy below which a prediction counts as reliable."""
  return MARGIN_FRACTION * math.log(num_classes)


@dataclasses.dataclass(frozen=True)
class Settings:
  """A method's hyperparameters (from the config's method block)."""
  method: str
  num_classes: int
  d_margin: float = 0.05          # EATA's redundancy threshold.
  fisher_alpha: float = 2000.0    # EATA's EWC weight.
  reset_below: float = 0.2        # SAR's collapse threshold.
  rho: float = 0.05               # SAR's SAM radius.
  ema_decay: float = 0.9          # SAR's loss average and EATA's m.


class State(Protocol):
  """What a method carries from batch to batch (checkpointed): a NamedTuple
  of its own, holding at least the adapted parameters."""
  adapted: Flat


class Method(flax.struct.PyTreeNode):
  """A method bound to a source model: `init()` and a pure `step`.

  A pytree of its arrays (the classifier's, and EATA's Fisher), so that a
  jitted `step(method, state, images)` takes them as arguments. Each
  method is a subclass with a state NamedTuple of its own.

  Attributes:
    settings: the method and its hyperparameters.
    classifier: the source model, its adapted parameters split out.
    tx: the optimizer of the adapted parameters (unused by the methods
      that do not adapt).
  """
  settings: Settings = flax.struct.field(pytree_node=False)
  classifier: classifier_lib.Classifier
  tx: optax.GradientTransformationExtraArgs = flax.struct.field(
      pytree_node=False)
  # Normalisation modules whose parameters the method leaves alone.
  SKIP: ClassVar[tuple[str, ...]] = ()

  def init(self) -> State:
    raise NotImplementedError

  def step(self, state: State, images: jax.Array
           ) -> tuple[State, dict[str, jax.Array]]:
    """Adapts on `images` and predicts them: (state, outputs).

    outputs: 'pred' (batch,) int32, 'entropy' (batch,), 'loss', 'kept'
    (fraction of the batch the method's filters kept), 'updated' (bool),
    'reset' (bool).
    """
    raise NotImplementedError


def outputs(logits, h, loss, kept, updated, reset) -> dict[str, jax.Array]:
  """A step's outputs (see `Method.step`)."""
  return {'pred': jnp.argmax(logits, -1).astype(jnp.int32), 'entropy': h,
          'loss': jnp.asarray(loss, jnp.float32),
          'kept': jnp.asarray(kept, jnp.float32),
          'updated': jnp.asarray(updated, bool),
          'reset': jnp.asarray(reset, bool)}


def gated_update(tx: optax.GradientTransformationExtraArgs, state, grads,
                 h: jax.Array, gate: jax.Array, **extra):
  """One optimizer step on `state`'s adapted parameters if `gate` (a state
  with `adapted`, `opt_state` and `updates`); CONGA reads the entropies
  `h` through the update's `entropies` argument."""
  updates, opt_state = tx.update(grads, state.opt_state, state.adapted,
                                 entropies=h, **extra)
  new = optax.apply_updates(state.adapted, updates)
  pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(gate, x, y), a, b)
  return state._replace(adapted=pick(new, state.adapted),
                        opt_state=pick(opt_state, state.opt_state),
                        updates=state.updates + gate.astype(jnp.int32))
