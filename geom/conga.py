"""CONGA, a confidence- and gradient-aware learning rate for test-time
adaptation, as an Optax transformation.

`conga(learning_rate, num_classes=C)` plays the role of
`optax.scale_by_learning_rate`: it multiplies the updates it receives by
-eta_t, so `optax.chain(optax.scale_by_adam(), conga(1e-3, num_classes=10))`
is Adam with the CONGA rate and `optax.chain(optax.trace(0.9), conga(...))`
SGD with momentum. Its update reads `entropies`, the per-sample prediction
entropies (nats) of the batch the gradient comes from
(`entropies_from_logits(logits)` computes them).

One step, with u the update it receives (the gradient, or Adam's direction)::

    c      = #{i : H_i < E0} / #{i},  E0 = margin * ln C      confident fraction
    m, q   = EMAs (decay b, bias-corrected) of u and of |u|^2
    r      = |m|^2 / q  in [0, 1];  n = the EMAs' effective sample count
    SNR    = clip(r - (1 - r) / (n - 1), 0, 1)                  (0 at step 1)
    lo     = eta_min + (eta_base - eta_min) * c
    hi     = max(eta_max * SNR, lo)
    cap    = tau / rms(u);  lo, hi = min(lo, cap), min(hi, cap)
    p      = t / T with total_steps T (t: steps before this one), else
             1 - EMA(mean H) / H_0;  clipped to [0, 1]
    eta    = lo + (hi - lo) * (1 + cos(pi * p)) / 2
    update = -eta * u

What the paper states (only its abstract is public) and each of our
choices with its reason: docs/methods/conga.md, the CONGA page of the
documentation.

Example:

  >>> import jax.numpy as jnp, optax
  >>> from geom import conga
  >>> tx = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=10))
  >>> w = jnp.zeros(3)
  >>> state = tx.init(w)
  >>> logits = jnp.array([[4.0] + [0.0] * 9, [0.0] * 10])  # Confident, not.
  >>> updates, state = tx.update(jnp.ones(3), state, w,
  ...                            entropies=conga.entropies_from_logits(logits))
  >>> d = conga.diagnostics(state)
  >>> float(d['conga_confident_fraction'])
  0.5
  >>> bool(d['conga_lower'] <= d['conga_rate'] <= d['conga_upper'])
  True

References:
  CONGA: Confidence-and-Gradient-Aware Learning Rate Schedule for Test Time
    Adaptation, ICML 2026 (abstract).
  Niu et al., Efficient Test-Time Model Adaptation without Forgetting
    (EATA), ICML 2022. arXiv 2204.02610.
  Niu et al., Towards Stable Test-Time Adaptation in Dynamic Wild World
    (SAR), ICLR 2023. arXiv 2302.12400.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from geom import method_hooks
from geom import tree_norm
from geom import validation

__all__ = [
    'CongaOptions', 'CongaState', 'DIAGNOSTICS', 'conga', 'diagnostics',
    'entropies_from_logits', 'find_state', 'hooks',
]

Updates = Any
_OWNER = 'geom.conga.conga'
# Defaults of the interval's ends, as multiples of the base rate.
_MIN_RATE_FACTOR = 0.1
_MAX_RATE_FACTOR = 10.0
# The statistics see u scaled to at most this norm: its square, and the
# EMAs of squares, stay below float32's maximum (3.4e38).
_STATISTICS_NORM_LIMIT = 1e18
#: Keys of `diagnostics`, and the state field each reports.
DIAGNOSTICS = {
    'conga_rate': 'rate', 'conga_lower': 'lower', 'conga_upper': 'upper',
    'conga_confident_fraction': 'confident_fraction', 'conga_snr': 'snr',
    'conga_progress': 'progress',
}


class CongaState(NamedTuple):
  """State of `conga`; the last six fields are the last step's, for logs.

  Attributes:
    count: completed steps (int32).
    grad_ema: the EMA of the updates received, before bias correction
      (float32, shaped like the parameters).
    sq_norm_ema: the EMA of their squared global norm (float32).
    entropy_ema: the EMA of the batches' mean entropy, before bias
      correction (float32).
    entropy_batches: batches with at least one (finite) entropy (int32).
    initial_entropy: H_0, the mean entropy of the first such batch.
    rate: eta of the last step (float32, as all below).
    lower: the interval's lower bound at the last step.
    upper: its upper bound.
    confident_fraction: the last batch's fraction of entropies below E0.
    snr: the updates' signal-to-noise ratio, in [0, 1].
    progress: adaptation progress, in [0, 1].

  Example:

    >>> import jax.numpy as jnp, optax
    >>> from geom import conga
    >>> tx = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=10))
    >>> state = tx.init(jnp.zeros(3))
    >>> logits = jnp.array([[4.0] + [0.0] * 9, [0.0] * 10])   # Confident, not.
    >>> updates, state = tx.update(jnp.ones(3), state, jnp.zeros(3),
    ...                            entropies=conga.entropies_from_logits(logits))
    >>> s = conga.find_state(state)
    >>> int(s.count), float(s.confident_fraction)
    (1, 0.5)
  """
  count: jax.Array
  grad_ema: Updates
  sq_norm_ema: jax.Array
  entropy_ema: jax.Array
  entropy_batches: jax.Array
  initial_entropy: jax.Array
  rate: jax.Array
  lower: jax.Array
  upper: jax.Array
  confident_fraction: jax.Array
  snr: jax.Array
  progress: jax.Array


@dataclasses.dataclass(frozen=True)
class CongaOptions:
  """`conga`'s arguments (documented there), validated on construction
  (`ArgumentError` names the field), as `geom.sam.SAMOptions`. Numbers may
  be traced (under `optax.inject_hyperparams`), and are then checked where
  they are concrete.

  Example:

    >>> from geom import conga
    >>> try:
    ...   conga.conga(1e-3, num_classes=1)
    ... except ValueError as e:   # geom.ArgumentError, from CongaOptions.
    ...   print(e)
    geom.conga.conga: num_classes=1: must be an integer >= 2
  """
  learning_rate: Any
  num_classes: Any
  min_learning_rate: Any
  max_learning_rate: Any
  margin: Any
  grad_decay: Any
  entropy_decay: Any
  max_update_rms: Any
  total_steps: Any

  def __post_init__(self):
    _validate(self)


def _is_integer(v: Any) -> bool:
  return not isinstance(v, bool) and float(v) == math.floor(float(v))


def _validate(s: CongaOptions) -> None:
  check = lambda name, ok, requirement: validation.check(
      _OWNER, name, getattr(s, name), ok, requirement)
  if callable(s.learning_rate):
    raise validation.ArgumentError(
        _OWNER, 'learning_rate', 'must be a number; for a schedule, use '
        'optax.inject_hyperparams(conga)(learning_rate=schedule, ...)')
  finite = lambda v: -math.inf < v < math.inf
  check('learning_rate', lambda v: finite(v) and v >= 0, 'finite and >= 0')
  check('num_classes', lambda v: _is_integer(v) and v >= 2,
        'an integer >= 2')
  if s.min_learning_rate is not None:
    check('min_learning_rate', lambda v: finite(v) and v >= 0,
          'finite and >= 0')
    if validation.is_concrete(s.learning_rate):
      check('min_learning_rate', lambda v: v <= float(s.learning_rate),
            f'<= learning_rate ({float(s.learning_rate)})')
  if s.max_learning_rate is not None:
    check('max_learning_rate', finite, 'finite')
    if validation.is_concrete(s.learning_rate):
      check('max_learning_rate', lambda v: v >= float(s.learning_rate),
            f'>= learning_rate ({float(s.learning_rate)})')
  check('margin', lambda v: 0 < v <= 1, 'in (0, 1]')
  check('grad_decay', lambda v: 0 < v < 1, 'in (0, 1)')
  check('entropy_decay', lambda v: 0 <= v < 1, 'in [0, 1)')
  check('max_update_rms', lambda v: v > 0, '> 0 (inf: no cap)')
  if s.total_steps is not None:
    check('total_steps', lambda v: _is_integer(v) and v >= 1,
          'an integer >= 1 (or None)')


def _f32(x: Any) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def entropies_from_logits(logits: jax.Array) -> jax.Array:
  """Prediction entropy of each sample, in nats, computed in float32.

  H = -sum_k p_k log p_k with log p from `jax.nn.log_softmax` (stable for
  large logits); a class with logit -inf adds 0, to the value and to the
  gradient (usable as a TTA loss).

  Args:
    logits: (..., num_classes), any float dtype.

  Returns:
    float32 entropies of shape logits.shape[:-1], e.g. (batch,).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import conga
    >>> h = conga.entropies_from_logits(jnp.array([[0.0, 0.0], [0.0, -jnp.inf]]))
    >>> [round(abs(float(v)), 4) for v in h]   # ln 2 for a coin, 0 if certain.
    [0.6931, 0.0]
  """
  z = jnp.asarray(logits).astype(jnp.float32)
  logp = jax.nn.log_softmax(z, axis=-1)
  p = jnp.exp(logp)
  # 0 * log 0 = 0, without 0 * -inf in the value or the gradient.
  safe = jnp.where(p > 0, logp, 0.0)
  return -jnp.sum(p * safe, axis=-1)


def _init(settings: CongaOptions, params: Any) -> CongaState:
  del settings
  zero = jnp.zeros((), jnp.float32)
  return CongaState(
      count=jnp.zeros((), jnp.int32),
      grad_ema=jax.tree.map(
          lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params),
      sq_norm_ema=zero, entropy_ema=zero,
      entropy_batches=jnp.zeros((), jnp.int32), initial_entropy=zero,
      rate=zero, lower=zero, upper=zero, confident_fraction=zero, snr=zero,
      progress=zero)


def _bias_correction(decay: jax.Array, steps: jax.Array) -> jax.Array:
  """1 - decay^steps for steps >= 1 (1 for decay 0), without cancellation."""
  steps = jnp.maximum(steps, 1).astype(jnp.float32)
  return -jnp.expm1(steps * jnp.log(decay))


def _entropy_statistics(entropies: Any, threshold: jax.Array):
  """(confident fraction, mean entropy, whether any entropy is finite)."""
  h = jnp.ravel(jnp.asarray(entropies)).astype(jnp.float32)
  valid = jnp.isfinite(h)
  n = jnp.sum(valid)
  per = 1.0 / jnp.maximum(n, 1).astype(jnp.float32)
  confident = jnp.sum(valid & (h < threshold)).astype(jnp.float32) * per
  mean = jnp.sum(jnp.where(valid, h, 0.0)) * per
  return confident, mean, n > 0


def _snr(grad_ema: Updates, sq_norm_ema: jax.Array, steps: jax.Array,
         decay: jax.Array) -> jax.Array:
  """|E u|^2 / E|u|^2 from the EMAs after `steps` (>= 1) updates."""
  correction = _bias_correction(decay, steps)
  mean_norm = tree_norm.tree_norm_f32(grad_ema) / correction
  mean_sq = sq_norm_ema / correction
  ratio = jnp.where(mean_sq > 0, jnp.square(mean_norm)
                    / jnp.where(mean_sq > 0, mean_sq, 1.0), 0.0)
  ratio = jnp.clip(ratio, 0.0, 1.0)
  # n - 1 = 2 b (1 - b^(t-1)) / ((1 - b)(1 + b^t)), with n = (sum w)^2 /
  # sum w^2 over the EMA's weights w: 0 at step 1.
  excess = (2 * decay * _bias_correction(decay, steps - 1) * (steps > 1)
            / ((1 - decay) * (2 - correction)))
  snr = ratio - (1 - ratio) / jnp.where(excess > 0, excess, 1.0)
  return jnp.where(excess > 0, jnp.clip(snr, 0.0, 1.0), 0.0)


def _update(settings: CongaOptions, updates: Updates, state: CongaState,
            params: Any = None, *, entropies: Any = None,
            **extra_args: Any) -> tuple[Updates, CongaState]:
  del params, extra_args
  if entropies is None:
    raise validation.ArgumentError(
        _OWNER, 'entropies', 'update needs entropies=... (the per-sample '
        'prediction entropies of the batch, in nats; '
        'geom.conga.entropies_from_logits(logits) gives them)')
  s = settings
  base = _f32(s.learning_rate)
  low = (base * _MIN_RATE_FACTOR if s.min_learning_rate is None
         else _f32(s.min_learning_rate))
  high = (base * _MAX_RATE_FACTOR if s.max_learning_rate is None
          else _f32(s.max_learning_rate))
  grad_decay, entropy_decay = _f32(s.grad_decay), _f32(s.entropy_decay)

  # Confidence, and the entropy's EMA (unchanged by an empty batch).
  threshold = _f32(s.margin) * jnp.log(_f32(s.num_classes))
  confident, mean_entropy, any_entropy = _entropy_statistics(entropies,
                                                             threshold)
  first = any_entropy & (state.entropy_batches == 0)
  entropy_batches = state.entropy_batches + any_entropy.astype(jnp.int32)
  entropy_ema = jnp.where(
      any_entropy, entropy_decay * state.entropy_ema
      + (1 - entropy_decay) * mean_entropy, state.entropy_ema)
  initial_entropy = jnp.where(first, mean_entropy, state.initial_entropy)

  # The updates' statistics, on u scaled to a norm of at most the limit.
  # (A norm past float32's range reads inf: then the statistics see the
  # limit, and the cap makes the step 0.)
  u = jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), updates)
  root_size = math.sqrt(max(sum(x.size for x in jax.tree.leaves(u)), 1))
  rms = tree_norm.tree_norm_f32(u) / root_size
  limit = _STATISTICS_NORM_LIMIT / root_size
  scale = jnp.where(rms > limit, limit / rms, 1.0)
  grad_ema = jax.tree.map(
      lambda m, x: grad_decay * m + (1 - grad_decay) * (scale * x),
      state.grad_ema, u)
  sq_norm_ema = (grad_decay * state.sq_norm_ema + (1 - grad_decay)
                 * jnp.square(jnp.minimum(rms, limit) * root_size))
  count = optax.safe_increment(state.count)
  snr = _snr(grad_ema, sq_norm_ema, count, grad_decay)

  # Progress.
  if s.total_steps is None:
    mean = entropy_ema / _bias_correction(entropy_decay, entropy_batches)
    tiny = jnp.finfo(jnp.float32).tiny
    progress = jnp.where(
        entropy_batches > 0,
        1 - mean / jnp.maximum(initial_entropy, tiny), 0.0)
  else:
    progress = state.count.astype(jnp.float32) / _f32(s.total_steps)
  progress = jnp.clip(progress, 0.0, 1.0)

  # The interval, the step-length cap, and the rate inside.
  lower = low + (base - low) * confident
  upper = jnp.maximum(high * snr, lower)
  cap = jnp.where(rms > 0, _f32(s.max_update_rms)
                  / jnp.where(rms > 0, rms, 1.0), jnp.inf)
  lower, upper = jnp.minimum(lower, cap), jnp.minimum(upper, cap)
  rate = lower + 0.5 * (upper - lower) * (1 + jnp.cos(jnp.pi * progress))
  rate = jnp.clip(rate, lower, upper)

  new_updates = jax.tree.map(
      lambda x, x32: (-rate * x32).astype(jnp.asarray(x).dtype), updates, u)
  return new_updates, CongaState(
      count=count, grad_ema=grad_ema, sq_norm_ema=sq_norm_ema,
      entropy_ema=entropy_ema, entropy_batches=entropy_batches,
      initial_entropy=initial_entropy, rate=rate, lower=lower, upper=upper,
      confident_fraction=confident, snr=snr, progress=progress)


def conga(
    learning_rate: float | jax.Array,
    *,
    num_classes: int,
    min_learning_rate: float | None = None,
    max_learning_rate: float | None = None,
    margin: float = 0.4,
    grad_decay: float = 0.9,
    entropy_decay: float = 0.9,
    max_update_rms: float = 1e-2,
    total_steps: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The CONGA learning rate: scales updates by -eta_t (see the module doc).

  Under `optax.inject_hyperparams(conga)(...)` every number is a
  hyperparameter that may change mid-run (`learning_rate` may be a
  schedule there); `num_classes` and `total_steps` become int32
  hyperparameters, which works as well, and `static_args=('num_classes',
  'total_steps')` keeps them Python ints. The injected floats take the
  parameters' dtype (bfloat16 parameters round the rates) unless
  `hyperparam_dtype=jnp.float32` is given; CONGA computes in float32.

  Args:
    learning_rate: eta_base, the rate a fully confident batch gets at
      least; a number or scalar, >= 0.
    num_classes: C, the classes of the predictions the entropies come from
      (an integer >= 2); E0 = margin * ln C.
    min_learning_rate: eta_min, the lower bound when no sample is
      confident; in [0, learning_rate]. None: learning_rate / 10.
    max_learning_rate: eta_max, the upper bound for a noise-free gradient;
      >= learning_rate. None: 10 * learning_rate.
    margin: E0 / ln C, in (0, 1]; 0.4 is EATA's and SAR's.
    grad_decay: decay of the EMAs of the updates and of their squared norm
      that give the SNR, in (0, 1).
    entropy_decay: decay of the EMA of the mean entropy that gives the
      progress without `total_steps`, in [0, 1).
    max_update_rms: tau: no step moves the parameters by more than this
      root-mean-square per parameter; > 0 (inf: no cap).
    total_steps: T, the stream's length in steps when known: progress
      t / T. None: progress from the entropy's reduction.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `CongaState`,
    whose update is `update(updates, state, params=None, *, entropies,
    **extra_args)`: `entropies` holds the per-sample prediction entropies
    (nats) of the batch, shape (batch,) or any shape (non-finite entries
    are ignored); other extra arguments are ignored.

  Raises:
    ArgumentError: (a ValueError) for an invalid argument, naming it; at
      update, when `entropies` is missing.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import conga
    >>> tx = optax.inject_hyperparams(conga.conga, static_args=('num_classes',))(
    ...     learning_rate=1e-3, num_classes=10)
    >>> w = jnp.zeros(3)
    >>> state = tx.init(w)
    >>> entropies = jnp.array([0.1, 2.0, jnp.nan])   # NaN: a padded sample.
    >>> updates, state = jax.jit(tx.update)(jnp.ones(3), state, w,
    ...                                     entropies=entropies)
    >>> float(conga.diagnostics(state)['conga_confident_fraction'])
    0.5
  """
  settings = CongaOptions(
      learning_rate=learning_rate, num_classes=num_classes,
      min_learning_rate=min_learning_rate,
      max_learning_rate=max_learning_rate, margin=margin,
      grad_decay=grad_decay, entropy_decay=entropy_decay,
      max_update_rms=max_update_rms, total_steps=total_steps)
  return optax.GradientTransformationExtraArgs(
      functools.partial(_init, settings), functools.partial(_update, settings))


def find_state(opt_state: optax.OptState) -> CongaState | None:
  """The (first) `CongaState` inside any optax state (chain, inject,
  MultiSteps), or None when there is none.

  Example:

    >>> import jax.numpy as jnp, optax
    >>> from geom import conga
    >>> tx = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=10))
    >>> state = tx.init(jnp.zeros(3))
    >>> logits = jnp.array([[4.0] + [0.0] * 9, [0.0] * 10])   # Confident, not.
    >>> updates, state = tx.update(jnp.ones(3), state, jnp.zeros(3),
    ...                            entropies=conga.entropies_from_logits(logits))
    >>> type(conga.find_state(state)).__name__
    'CongaState'
    >>> conga.find_state(optax.sgd(0.1).init(jnp.zeros(3))) is None
    True
  """
  return method_hooks.find_state(opt_state, CongaState)


def diagnostics(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """CONGA's last step from an optimizer state that contains a `conga` state.

  Returns:
    float32 scalars: 'conga_rate' (eta), 'conga_lower' and 'conga_upper'
    (the interval), 'conga_confident_fraction' (c), 'conga_snr' and
    'conga_progress' (p).

  Raises:
    ArgumentError: if `opt_state` contains no `conga` state.

  Example:

    >>> import jax.numpy as jnp, optax
    >>> from geom import conga
    >>> tx = optax.chain(optax.scale_by_adam(), conga.conga(1e-3, num_classes=10))
    >>> state = tx.init(jnp.zeros(3))
    >>> logits = jnp.array([[4.0] + [0.0] * 9, [0.0] * 10])   # Confident, not.
    >>> updates, state = tx.update(jnp.ones(3), state, jnp.zeros(3),
    ...                            entropies=conga.entropies_from_logits(logits))
    >>> sorted(conga.diagnostics(state)) == sorted(conga.DIAGNOSTICS)
    True
    >>> d = conga.diagnostics(state)
    >>> bool(d['conga_lower'] <= d['conga_rate'] <= d['conga_upper'])
    True
  """
  state = find_state(opt_state)
  if state is None:
    raise validation.ArgumentError(
        'geom.conga.diagnostics', 'opt_state',
        'the optimizer state contains no geom.conga.conga state')
  return {key: getattr(state, field) for key, field in DIAGNOSTICS.items()}


def hooks() -> method_hooks.MethodHooks:
  """What a loop needs to run `conga`: the batch's `entropies` at update,
  and its diagnostics (the rate on the progress line).

  Example:

    >>> from geom import conga
    >>> h = conga.hooks()
    >>> h.update_arguments, h.console
    (('entropies',), ('conga_rate',))
  """
  return method_hooks.MethodHooks(
      name='conga', update_arguments=('entropies',), diagnostics=diagnostics,
      console=('conga_rate',))
