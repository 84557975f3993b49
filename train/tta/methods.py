"""Test-time adaptation methods as jitted steps: source, BN statistics, TENT, EATA, SAR.

Each method adapts a classifier trained by `launch.train` on an unlabelled
test stream, one batch at a time, and predicts each batch with the forward
pass it adapts on (online evaluation, as the TENT, EATA and SAR papers
report). Labels never reach a step.

- 'source': the source model as trained (running BN statistics).
- 'bn_stats': normalisation with the test batch's statistics, no update
  (Schneider et al. 2020; Nado et al. 2020).
- 'tent' (Wang et al., ICLR 2021): minimise the mean prediction entropy
  over the normalisation layers' affine parameters, with test-batch
  statistics.
- 'eata' (Niu et al., ICML 2022): entropy on reliable samples only
  (H < E0 = 0.4 ln C), minus redundant ones (|cos(p, m)| >= d_margin,
  with m the moving average of the kept samples' probabilities), each
  weighted by 1 / exp(H - E0), plus an EWC penalty
  alpha sum F (theta - theta_0)^2 with the Fisher F of the source model
  on in-distribution samples (squared gradients of the cross-entropy
  with the model's own predictions, as EATA's code computes it).
- 'sar' (Niu et al., ICLR 2023): reliable entropy (H < E0) minimised with
  SAM: the second gradient is taken at geom.sam's ascent point
  w + rho g / |g| (`geom.sam.perturbation`) on the samples reliable at
  both points, and the base optimizer steps with it. (We call the
  perturbation rather than the `geom.sam.sam` transformation because the
  reset reads the loss at the ascent point, which the transformation's
  `grad_fn` contract does not return.) The moving average of that loss
  (0.9) falling below `reset_below` (0.2 in SAR) resets the model to the
  source. SAR leaves the last block's normalisation alone (layer4 of a
  ResNet); ours skips `bn_hidden`, the last block of the CNN.

No step updates when no sample of a batch passes the filters (as in EATA's
and SAR's code): the parameters and the optimizer state stay as they were.

The learning rate is the config's: a fixed rate (`optax.scale_by_learning_rate`)
or CONGA (`geom.conga.conga`), after Adam's or momentum's direction; CONGA
reads every sample's entropy through the `entropies` update argument.
"""

from collections.abc import Mapping
import dataclasses
import math
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from geom import conga
from geom import sam

METHODS = ('source', 'bn_stats', 'tent', 'eata', 'sar')
ADAPTING = ('tent', 'eata', 'sar')
# SAR's margin, and EATA's: E0 = 0.4 ln C.
MARGIN_FRACTION = 0.4

Flat = dict[str, jax.Array]


# Per-sample prediction entropy in nats, in float32: (batch,). CONGA's, so
# that the loss and the schedule read one entropy (-inf logits included).
entropies = conga.entropies_from_logits


def margin(num_classes: int) -> float:
  """E0 = 0.4 ln C, the entropy below which a prediction counts as reliable."""
  return MARGIN_FRACTION * math.log(num_classes)


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


class AdaptState(NamedTuple):
  """What a method carries from batch to batch (checkpointed).

  Attributes:
    adapted: the adapted parameters ('module/leaf' -> array).
    opt_state: their optimizer's state.
    mean_probs: EATA's moving average of the kept samples' probabilities.
    has_mean: whether `mean_probs` holds one yet.
    loss_ema: SAR's moving average of its second-pass loss.
    has_ema: whether `loss_ema` holds one yet.
    resets: SAR's model resets so far.
    updates: batches that changed the parameters.
  """
  adapted: Flat
  opt_state: Any
  mean_probs: jax.Array
  has_mean: jax.Array
  loss_ema: jax.Array
  has_ema: jax.Array
  resets: jax.Array
  updates: jax.Array


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


@flax.struct.dataclass
class Method:
  """A method bound to a source model: `init()` and a pure `step`.

  A pytree of its arrays (the source model's and EATA's Fisher), so that
  a jitted `Method.step(method, state, images)` takes them as arguments
  instead of baking them into the program as constants.

  Attributes:
    settings: the method and its hyperparameters.
    model: the Flax classifier.
    frozen: the source parameters that are not adapted.
    source: the adapted parameters' source values (EATA's anchor, resets).
    batch_stats: the source model's running BN statistics.
    tx: the optimizer of the adapted parameters.
    fisher: EATA's Fisher diagonal over the adapted parameters, else None.
  """
  settings: Settings = flax.struct.field(pytree_node=False)
  model: nn.Module = flax.struct.field(pytree_node=False)
  frozen: Flat
  source: Flat
  batch_stats: Any
  tx: optax.GradientTransformationExtraArgs = flax.struct.field(
      pytree_node=False)
  fisher: Flat | None = None

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

  def init(self) -> AdaptState:
    c = self.settings.num_classes
    return AdaptState(
        adapted=self.source, opt_state=self.tx.init(self.source),
        mean_probs=jnp.zeros((c,), jnp.float32),
        has_mean=jnp.zeros((), bool), loss_ema=jnp.zeros((), jnp.float32),
        has_ema=jnp.zeros((), bool), resets=jnp.zeros((), jnp.int32),
        updates=jnp.zeros((), jnp.int32))

  def step(self, state: AdaptState, images: jax.Array
           ) -> tuple[AdaptState, dict[str, jax.Array]]:
    """Adapts on `images` and predicts them: (state, outputs).

    outputs: 'pred' (batch,) int32, 'entropy' (batch,), 'loss', 'kept'
    (fraction of the batch the method's filters kept), 'updated' (bool),
    'reset' (bool).
    """
    method = self.settings.method
    if method in ('source', 'bn_stats'):
      logits = self.logits(state.adapted, images, method == 'bn_stats')
      h = entropies(logits)
      return state, self._outputs(logits, h, jnp.mean(h), 1.0, False, False)
    return {'tent': self._tent, 'eata': self._eata, 'sar': self._sar}[method](
        state, images)

  @staticmethod
  def _outputs(logits, h, loss, kept, updated, reset):
    return {'pred': jnp.argmax(logits, -1).astype(jnp.int32), 'entropy': h,
            'loss': jnp.asarray(loss, jnp.float32),
            'kept': jnp.asarray(kept, jnp.float32),
            'updated': jnp.asarray(updated, bool),
            'reset': jnp.asarray(reset, bool)}

  def _apply(self, state, grads, h, gate, **extra):
    """One optimizer step on the adapted parameters if `gate`."""
    updates, opt_state = self.tx.update(grads, state.opt_state, state.adapted,
                                        entropies=h, **extra)
    new = optax.apply_updates(state.adapted, updates)
    pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(gate, x, y), a, b)
    return state._replace(adapted=pick(new, state.adapted),
                          opt_state=pick(opt_state, state.opt_state),
                          updates=state.updates + gate.astype(jnp.int32))

  def _tent(self, state, images):
    def loss_fn(adapted):
      logits = self.logits(adapted, images, True)
      h = entropies(logits)
      return jnp.mean(h), (logits, h)

    (loss, (logits, h)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.adapted)
    gate = jnp.asarray(images.shape[0] > 0)
    state = self._apply(state, grads, h, gate)
    return state, self._outputs(logits, h, loss, 1.0, gate, False)

  def _eata_filter(self, state, logits, h):
    """(kept mask, weights) of EATA's two filters."""
    e0 = margin(self.settings.num_classes)
    reliable = h < e0
    probs = jax.nn.softmax(logits.astype(jnp.float32), -1)
    m = state.mean_probs
    cos = jnp.abs(probs @ m) / jnp.maximum(
        jnp.linalg.norm(probs, axis=-1) * jnp.linalg.norm(m), 1e-8)
    distinct = jnp.where(state.has_mean, cos < self.settings.d_margin, True)
    keep = reliable & distinct
    return keep, jnp.where(keep, jnp.exp(-(h - e0)), 0.0), probs

  def _eata(self, state, images):
    settings = self.settings

    def loss_fn(adapted):
      logits = self.logits(adapted, images, True)
      h = entropies(logits)
      keep, weights, probs = self._eata_filter(
          state, jax.lax.stop_gradient(logits), jax.lax.stop_gradient(h))
      n = jnp.maximum(jnp.sum(keep), 1)
      ent = jnp.sum(weights * h) / n
      ewc = sum(jnp.sum(self.fisher[k] * jnp.square(adapted[k] - self.source[k]))
                for k in adapted)
      return ent + settings.fisher_alpha * ewc, (logits, h, keep, probs)

    (loss, (logits, h, keep, probs)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.adapted)
    gate = jnp.any(keep)
    state = self._apply(state, grads, h, gate)
    kept_mean = (jnp.sum(jnp.where(keep[:, None], probs, 0.0), 0)
                 / jnp.maximum(jnp.sum(keep), 1))
    decay = settings.ema_decay
    mean = jnp.where(state.has_mean, decay * state.mean_probs
                     + (1 - decay) * kept_mean, kept_mean)
    state = state._replace(
        mean_probs=jnp.where(gate, mean, state.mean_probs),
        has_mean=state.has_mean | gate)
    return state, self._outputs(logits, h, loss, jnp.mean(keep), gate, False)

  def _sar(self, state, images):
    e0 = margin(self.settings.num_classes)

    def first(adapted):
      logits = self.logits(adapted, images, True)
      h = entropies(logits)
      keep = jax.lax.stop_gradient(h) < e0
      return jnp.sum(jnp.where(keep, h, 0.0)) / jnp.maximum(
          jnp.sum(keep), 1), (logits, h, keep)

    (_, (logits, h, keep1)), grads = jax.value_and_grad(
        first, has_aux=True)(state.adapted)

    def second(adapted):
      h2 = entropies(self.logits(adapted, images, True))
      keep2 = keep1 & (jax.lax.stop_gradient(h2) < e0)
      n = jnp.sum(keep2)
      return jnp.sum(jnp.where(keep2, h2, 0.0)) / jnp.maximum(n, 1), n

    # SAM's ascent point w + rho g / |g| (geom.sam's definition), and the
    # reliable entropy and its gradient there.
    e, _ = sam.perturbation(grads, state.adapted, self.settings.rho)
    (loss2, n2), grads2 = jax.value_and_grad(second, has_aux=True)(
        sam.perturbed_params(state.adapted, e))
    gate = jnp.any(keep1)
    new = self._apply(state, grads2, h, gate)
    has_loss = gate & (n2 > 0)
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
    return new, self._outputs(logits, h, loss2, jnp.mean(keep1), gate, reset)


def fisher_diagonal(method: Method, batches: list[jax.Array]) -> Flat:
  """EATA's Fisher: the mean over `batches` (clean, in-distribution images)
  of the squared gradient of the cross-entropy against the source model's
  own predictions, for the adapted parameters."""
  def loss(adapted, images):
    logits = method.logits(adapted, images, True)
    labels = jnp.argmax(jax.lax.stop_gradient(logits), -1)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels))

  # Whole programs (op by op, each leaf's zeros, square, sum and division
  # compiled for itself).
  @jax.jit
  def accumulate(total, source, images):
    return jax.tree.map(lambda t, g: t + jnp.square(g), total,
                        jax.grad(loss)(source, images))

  total = jax.jit(lambda s: jax.tree.map(jnp.zeros_like, s))(method.source)
  for images in batches:
    total = accumulate(total, method.source, images)
  return jax.jit(lambda t: jax.tree.map(
      lambda x: x / max(len(batches), 1), t))(total)


def make(settings: Settings, model: nn.Module, params, batch_stats,
         tx: optax.GradientTransformationExtraArgs,
         fisher_batches: list[jax.Array] | None = None) -> Method:
  """A method on the source model `params`/`batch_stats`.

  Args:
    settings: the method and its hyperparameters.
    model: the classifier.
    params: its trained parameters (as `launch.train` saved them).
    batch_stats: its running BN statistics ({} without BatchNorm).
    tx: the optimizer of the adapted parameters (unused by source and
      bn_stats).
    fisher_batches: EATA's in-distribution images.
  """
  method = bind(settings, model, *jax.device_put((params, batch_stats)), tx)
  if settings.method == 'eata':
    method = method.replace(
        fisher=fisher_diagonal(method, fisher_batches or []))
  return method


def bind(settings: Settings, model: nn.Module, params, batch_stats,
         tx: optax.GradientTransformationExtraArgs,
         fisher: Flat | None = None) -> Method:
  """The method on `params` as they are (arrays or their abstract shapes:
  `launch.compile` binds a method to shapes only); `fisher` given."""
  skip = ('bn_hidden',) if settings.method == 'sar' else ()
  adapted, frozen = split(params, adapted_names(params, skip))
  return Method(settings=settings, model=model, frozen=frozen,
                source=adapted, batch_stats=batch_stats or {},
                tx=optax.with_extra_args_support(tx), fisher=fisher)
