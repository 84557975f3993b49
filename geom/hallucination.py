"""Detecting SAM's hallucinated minimizers from the two gradients of each step.

SAM moves with the gradient at the perturbed point, g+ = grad f(w + e). It
can stall where g+ vanishes while g = grad f(w) does not (Park, Jang, Ryu &
Yang, arXiv 2509.21818): a *hallucinated minimizer*, not a stationary point
of f. Both gradients are already computed by every SAM step, so the
statistics are free::

  |g|, |g+|, r = |g+| / |g| and cos(g, g+),

each smoothed by an exponential moving average over SAM steps (minibatch
noise makes single steps unreliable), and a slower average of |g|, the
gradient's own scale. A step is *suspicious* when::

  ratio_ema < ratio_threshold                       (g+ small against g)
  and grad_norm_ema > min_grad_fraction * scale     (g not vanishing, where
                                                     scale = slow EMA of |g|)
  and grad_norm_ema > min_grad_norm                 (absolute; 0: off)

and a hallucination is *flagged* once `patience` consecutive SAM steps are
suspicious. Steps without SAM (warm-up, outside the window, fallback)
leave the statistics unchanged.

Every default test is relative: multiplying the loss by any constant
changes nothing. Why the tests and the 0.5 ratio threshold are what they
are (measured, RESULTS.md "The detector under gradient noise"):
docs/methods/sam.md.

Which parts are the paper's: the definition (g+ = 0, g != 0). Ours: the
statistics, the smoothing, the thresholds and the patience.

Example (a stall: |g| holds at 1 while |g+| is 0.01):

  >>> import jax.numpy as jnp
  >>> from geom import hallucination as h
  >>> config, state = h.DetectorConfig(patience=3), h.init(track_cosine=False)
  >>> for _ in range(3):
  ...   state = h.update(state, config, jnp.array(True), jnp.array(1.0),
  ...                    jnp.array(0.01), None)
  >>> bool(state.flagged), int(state.streak)
  (True, 3)

References:
  Park, Jang, Ryu & Yang, hallucinated minimizers of SAM, arXiv 2509.21818
  (v2, February 2026).
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from geom import validation

__all__ = ['DetectorConfig', 'DetectorState', 'init', 'restart',
           'step_statistics', 'update']


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
  """Thresholds of the hallucination detector.

  Attributes:
    ema_decay: weight of the past in the moving averages (0: no smoothing).
    ratio_threshold: a step is suspicious when the averaged |g+| / |g| is
      below this.
    min_grad_fraction: ... and the averaged |g| is above this fraction of
      the gradient's scale (its slow average; a |g| that has fallen far
      below its own level is a genuine stationary point, not a
      hallucination). 0 turns this test off.
    scale_decay: weight of the past in the slow average of |g| (>=
      ema_decay, so that the scale lags the fast average).
    min_grad_norm: ... and the averaged |g| is above this absolute value
      (0, the default, turns it off: an absolute floor depends on the
      loss's scale).
    patience: consecutive suspicious SAM steps before a flag.
    track_cosine: also track cos(g, g+) (not used by the flag). Off by
      default: it needs the perturbation kept until the second gradient
      is complete, one more parameter-sized buffer at peak (measured on an
      MLP SAM step: +29% peak memory, +6% time; without it the detector
      costs nothing measurable).

  Example:

    >>> import optax
    >>> from geom import hallucination, sam
    >>> config = hallucination.DetectorConfig(patience=5)
    >>> config.ratio_threshold, config.patience
    (0.5, 5)
    >>> tx = sam.sam(optax.sgd(0.1), rho=0.05, detector=config,
    ...              response='warm_restart')
  """
  ema_decay: float = 0.9
  ratio_threshold: float = 0.5
  min_grad_fraction: float = 0.1
  scale_decay: float = 0.99
  min_grad_norm: float = 0.0
  patience: int = 20
  track_cosine: bool = False

  def __post_init__(self):
    owner = 'geom.hallucination.DetectorConfig'
    validation.check(owner, 'ema_decay', self.ema_decay,
                     lambda v: 0 <= v < 1, 'in [0, 1)')
    validation.check(owner, 'ratio_threshold', self.ratio_threshold,
                     lambda v: 0 < v < math.inf, 'finite and > 0')
    validation.check(owner, 'min_grad_fraction', self.min_grad_fraction,
                     lambda v: 0 <= v < math.inf, 'finite and >= 0')
    validation.check(owner, 'scale_decay', self.scale_decay,
                     lambda v: self.ema_decay <= v < 1,
                     f'in [ema_decay, 1) = [{self.ema_decay}, 1)')
    validation.check(owner, 'min_grad_norm', self.min_grad_norm,
                     lambda v: 0 <= v < math.inf, 'finite and >= 0')
    validation.check(owner, 'patience', self.patience, lambda v: v >= 1,
                     '>= 1')


class DetectorState(NamedTuple):
  """Detector statistics (float32 scalars unless noted).

  Attributes:
    grad_norm, perturbed_grad_norm, cosine: the last SAM step's |g|, |g+|
      and cos(g, g+) (cosine None unless tracked).
    grad_norm_ema, ratio_ema, cosine_ema: their moving averages (ratio =
      |g+| / |g|), bias-corrected.
    grad_norm_scale: the slow moving average of |g| (`scale_decay`),
      bias-corrected.
    sam_steps: number of SAM steps seen (int32).
    streak: consecutive suspicious SAM steps (int32).
    flagged: whether a hallucination is flagged now (bool).
    flagged_steps: number of steps at which it was flagged (int32).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import hallucination as h
    >>> state = h.init(track_cosine=False)
    >>> state = h.update(state, h.DetectorConfig(), jnp.array(True),
    ...                  jnp.array(1.0), jnp.array(0.25), None)
    >>> round(float(state.ratio_ema), 4), int(state.sam_steps)
    (0.25, 1)
  """
  grad_norm: jax.Array
  perturbed_grad_norm: jax.Array
  cosine: jax.Array | None
  grad_norm_ema: jax.Array
  grad_norm_scale: jax.Array
  ratio_ema: jax.Array
  cosine_ema: jax.Array | None
  sam_steps: jax.Array
  streak: jax.Array
  flagged: jax.Array
  flagged_steps: jax.Array


def init(track_cosine: bool = True) -> DetectorState:
  """Zero statistics (with the cosine's when `track_cosine`).

  Example:

    >>> from geom import hallucination as h
    >>> state = h.init(track_cosine=False)
    >>> int(state.sam_steps), state.cosine is None
    (0, True)
  """
  f = lambda: jnp.zeros((), jnp.float32)
  i = lambda: jnp.zeros((), jnp.int32)
  return DetectorState(
      grad_norm=f(), perturbed_grad_norm=f(),
      cosine=f() if track_cosine else None, grad_norm_ema=f(),
      grad_norm_scale=f(), ratio_ema=f(),
      cosine_ema=f() if track_cosine else None,
      sam_steps=i(), streak=i(), flagged=jnp.zeros((), jnp.bool_),
      flagged_steps=i())


def step_statistics(grad_norm: jax.Array, perturbed_grad_norm: jax.Array,
                    inner_product: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(|g+| / |g|, cos(g, g+)) from norms and <g, g+>, safe at zero.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import hallucination as h
    >>> ratio, cosine = h.step_statistics(jnp.array(2.0), jnp.array(1.0),
    ...                                   jnp.array(-2.0))   # <g, g+> = -2
    >>> float(ratio), float(cosine)
    (0.5, -1.0)
    >>> [float(v) for v in h.step_statistics(jnp.array(0.0), jnp.array(0.0),
    ...                                      jnp.array(0.0))]   # Safe at zero.
    [0.0, 0.0]
  """
  tiny = jnp.finfo(jnp.float32).tiny
  ratio = perturbed_grad_norm / jnp.maximum(grad_norm, tiny)
  cosine = inner_product / jnp.maximum(grad_norm * perturbed_grad_norm, tiny)
  return ratio, jnp.clip(cosine, -1.0, 1.0)


def update(state: DetectorState, config: DetectorConfig, sam_step: jax.Array,
           grad_norm: jax.Array, perturbed_grad_norm: jax.Array,
           inner_product: jax.Array | None) -> DetectorState:
  """Folds one step in; a step with `sam_step` False leaves `state` as is.

  `inner_product` is <g, g+>, or None when the cosine is not tracked.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import hallucination as h
    >>> config, state = h.DetectorConfig(patience=2), h.init(track_cosine=False)
    >>> plain = jnp.array(False)   # A step without SAM changes nothing.
    >>> h.update(state, config, plain, jnp.array(1.0), jnp.array(0.0),
    ...          None).sam_steps.item()
    0
    >>> for _ in range(2):   # A stall: |g| = 1, |g+| = 0.01.
    ...   state = h.update(state, config, jnp.array(True), jnp.array(1.0),
    ...                    jnp.array(0.01), None)
    >>> bool(state.flagged), int(state.flagged_steps)
    (True, 1)
  """
  grad_norm = grad_norm.astype(jnp.float32)
  perturbed_grad_norm = perturbed_grad_norm.astype(jnp.float32)
  ratio, cosine = step_statistics(
      grad_norm, perturbed_grad_norm,
      jnp.zeros(()) if inner_product is None else inner_product)
  n = state.sam_steps + 1

  def ema(avg, x, d=config.ema_decay):
    # Bias-corrected: avg_n = (d avg_{n-1} (1 - d^{n-1}) + (1 - d) x) / (1 - d^n).
    prev_weight = 1.0 - d ** (n - 1).astype(jnp.float32)
    norm = 1.0 - d ** n.astype(jnp.float32)
    return (d * avg * prev_weight + (1.0 - d) * x) / norm

  grad_norm_ema = ema(state.grad_norm_ema, grad_norm)
  grad_norm_scale = ema(state.grad_norm_scale, grad_norm, config.scale_decay)
  ratio_ema = ema(state.ratio_ema, ratio)
  suspicious = ((ratio_ema < config.ratio_threshold)
                & (grad_norm_ema > config.min_grad_fraction * grad_norm_scale)
                & (grad_norm_ema > config.min_grad_norm))
  streak = jnp.where(suspicious, state.streak + 1, 0)
  flagged = streak >= config.patience
  tracked = state.cosine is not None
  new = DetectorState(
      grad_norm=grad_norm, perturbed_grad_norm=perturbed_grad_norm,
      cosine=cosine if tracked else None, grad_norm_ema=grad_norm_ema,
      grad_norm_scale=grad_norm_scale, ratio_ema=ratio_ema,
      cosine_ema=ema(state.cosine_ema, cosine) if tracked else None,
      sam_steps=n,
      streak=streak.astype(jnp.int32), flagged=flagged,
      flagged_steps=state.flagged_steps + flagged.astype(jnp.int32))
  return jax.tree.map(lambda a, b: jnp.where(sam_step, a, b), new, state)


def restart(state: DetectorState) -> DetectorState:
  """Forgets the averages (after a response), keeps the flagged-step count.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import hallucination as h
    >>> config, state = h.DetectorConfig(patience=1), h.init(track_cosine=False)
    >>> state = h.update(state, config, jnp.array(True), jnp.array(1.0),
    ...                  jnp.array(0.01), None)
    >>> state = h.restart(state)
    >>> bool(state.flagged), int(state.sam_steps), int(state.flagged_steps)
    (False, 0, 1)
  """
  fresh = init(track_cosine=state.cosine is not None)
  return fresh._replace(flagged_steps=state.flagged_steps)
