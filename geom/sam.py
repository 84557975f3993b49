"""SAM, ASAM and m-sharpness as an Optax transformation, with warm-start,
step windows and hallucinated-minimizer detection.

One SAM step at weights w with loss gradient g::

    e    = rho * g / (|g| + eps)             (ASAM: rho * T^2 g / (|T g| + eps),
                                               T = |w| + eta, elementwise)
    g+   = grad L(w + e)                      (same batch)
    w   <- w + base_optimizer.update(g+, w)

`sam(base_optimizer, rho)` wraps any optax transformation; `update(grads,
state, params, grad_fn=...)` does the whole step (`grad_fn(params) ->
grads` on the same batch), or, in two-call mode, alternates as
`optax.contrib.sam` does. Options: ASAM (`adaptive`), a pluggable
`ascent`, `warmup_steps` and a step `window` (SAM only inside it),
m-sharpness (`batch_axis_name`), LookSAM's reuse (`every=k`: g+ every k
steps, its part orthogonal to g reused in between), AE-SAM's switch
(`ae_margin`: g+ only when |g|^2 is above its running mean by `ae_margin`
running standard deviations), and a hallucinated-minimizer detector
(`geom.hallucination`) with a response (flag, warm restart, shrink rho).
`hooks(options)` tells a loop which steps perturb, so that it compiles
SAM and plain steps apart. Design notes (modes, which steps perturb,
precision, m-sharpness, clipping): docs/methods/sam.md.

Which parts are the papers': SAM (Foret et al., 2021), ASAM (Kwon et al.,
2021), m-sharpness (Foret et al.), hallucinated minimizers and the
warm-start remedy (Park et al., 2025/2026), the mid-training window
(arXiv 2605.02105), LookSAM (Liu et al., 2022: g+ every k steps, g_v =
g+ - |g+| cos(g, g+) g / |g|, reuse steps g + alpha |g| / |g_v| g_v,
alpha 0.7), AE-SAM (Jiang et al., 2023: mu_t = delta mu_{t-1} + (1 -
delta) |g_t|^2, sigma_t^2 = delta sigma_{t-1}^2 + (1 - delta) (|g_t|^2 -
mu_t)^2, SAM iff |g_t|^2 >= mu_t + c_t sigma_t, c_t linear in t). Ours: the
detector statistics and thresholds, the response
policies, eps in the ASAM denominator, and of LookSAM: norms and the
projection over all the weights at once (the paper writes vectors; public
ports work per tensor), the phase counted from the warm-up's end, g_v
cleared by plain steps, g_v = g+ for g = 0 (nothing to project on), g_v =
0 below 1e-5 |g+| (g+ parallel to g), a reuse step with g_v = 0 plain, and
g_v kept in the parameters' dtype; of AE-SAM: mu_0 = sigma_0 = 0, the
statistics fed on every step (warm-up and plain steps included) and not on
a step whose |g| is not finite, |g|^2 capped at float32's largest finite
value / 4 (so |g| = 1e20 keeps them finite), sigma updated as a hypot (no
square of |g|^2 is formed), and c_t any schedule (the paper's is linear).

Example:

  >>> import jax, jax.numpy as jnp, optax
  >>> from geom import sam
  >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
  >>> tx = sam.sam(optax.sgd(0.1), rho=0.05, warmup_steps=2)
  >>> w = jnp.zeros(3)
  >>> state = tx.init(w)
  >>> for _ in range(5):
  ...   updates, state = tx.update(jax.grad(loss)(w), state, w,
  ...                              grad_fn=jax.grad(loss))
  ...   w = optax.apply_updates(w, updates)
  >>> bool(sam.diagnostics(state)['sam_active'])
  True

References:
  Foret et al., Sharpness-Aware Minimization for Efficiently Improving
    Generalization, ICLR 2021. arXiv 2010.01412.
  Kwon et al., ASAM: Adaptive Sharpness-Aware Minimization, ICML 2021.
    arXiv 2102.11600.
  Park, Jang, Ryu & Yang, SAM's hallucinated minimizers, arXiv 2509.21818.
  Sharpness-Aware Pretraining Mitigates Catastrophic Forgetting,
    arXiv 2605.02105.
  Liu, Mai, Chen, Hsieh & You, Towards Efficient and Scalable
    Sharpness-Aware Minimization, CVPR 2022. arXiv 2203.02714.
  Jiang, Yang, Zhang & Kwok, An Adaptive Policy to Employ Sharpness-Aware
    Minimization, ICLR 2023. arXiv 2304.14647.
"""

from collections.abc import Callable
import dataclasses
import functools
import inspect
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from geom import hallucination
from geom import method_hooks
from geom import tree_norm
from geom import validation
from geom.kernels import sam_perturb as fused_kernels

__all__ = [
    'sam', 'SAMOptions', 'from_options', 'SAMState', 'hooks', 'is_sam_step',
    'diagnostics', 'find_state', 'perturbation', 'perturbed_params',
    'TwoCallCache', 'SwitchState',
]

Params = Any
Updates = Any
# grad_fn(params) -> grads, or optax.contrib.sam's grad_fn(params, i).
GradFn = Callable[..., Updates]
Responses = Literal['flag', 'warm_restart', 'shrink_rho']
_RESPONSES = ('flag', 'warm_restart', 'shrink_rho')
_MODES = ('opaque', 'two_call')
_OWNER = 'geom.sam.SAMOptions'


class TwoCallCache(NamedTuple):
  """What the first call of a two-call SAM step leaves for the second.

  Attributes:
    phase: 0 when the next call brings g at w, 1 when it brings g+ at w + e.
    params: w, the weights before the perturbation.
    grads: g, for the detector statistics.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> tx = sam.sam(optax.sgd(0.1), rho=0.05, mode='two_call')
    >>> state = tx.init(jnp.zeros(2))
    >>> int(sam.find_state(state).cache.phase)   # The next call brings g at w.
    0
  """
  phase: jax.Array
  params: Params
  grads: Updates


class SwitchState(NamedTuple):
  """AE-SAM's running statistics of |g|^2 and its decisions (`ae_margin`).

  Attributes:
    mean: mu, the running mean of |g|^2 (float32).
    std: sigma, the running standard deviation of |g|^2 (float32).
    sq_grad_norm: |g|^2 of the last step (float32, capped; see `sam`).
    threshold: mu + c sigma the last step compared |g|^2 with (float32).
    sam_steps: steps that computed g+ (int32): chosen by the switch and
      not made plain by the warm-up, the window or a warm restart.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
    >>> tx = sam.sam(optax.sgd(0.1), rho=0.05, ae_margin=0.0)
    >>> w = jnp.zeros(2)
    >>> updates, state = tx.update(jax.grad(loss)(w), tx.init(w), w,
    ...                            grad_fn=jax.grad(loss))
    >>> s = sam.find_state(state).switch   # mu = 0.1 |g|^2, |g|^2 = 8
    >>> round(float(s.mean), 4), bool(sam.find_state(state).sam_active)
    (0.8, True)
  """
  mean: jax.Array
  std: jax.Array
  sq_grad_norm: jax.Array
  threshold: jax.Array
  sam_steps: jax.Array


class SAMState(NamedTuple):
  """State of `sam`.

  Attributes:
    count: completed steps (int32); warm-up and window count these.
    base_state: the base optimizer's state.
    rho: the rho of the last step (float32; 0 on steps without g+).
    rho_scale: multiplier of rho, lowered by the 'shrink_rho' response.
    cooldown: plain steps left after a 'warm_restart' response (int32).
    sam_active: whether the last step computed g+ (bool; False on plain
      and on LookSAM's reuse steps).
    detector: the hallucination detector's statistics, or None.
    cache: two-call mode only, else None.
    ascent_state: the `ascent` transformation's state, or None.
    orthogonal: `every` > 1 only, else None: g_v, the part of the last g+
      orthogonal to its g (the parameters' dtype; zeros after a plain step).
    switch: `ae_margin` set only, else None: AE-SAM's `SwitchState`.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
    >>> tx = sam.sam(optax.sgd(0.1), rho=0.05)
    >>> w = jnp.zeros(2)
    >>> state = tx.init(w)
    >>> updates, state = tx.update(jax.grad(loss)(w), state, w,
    ...                            grad_fn=jax.grad(loss))
    >>> s = sam.find_state(state)
    >>> int(s.count), bool(s.sam_active), round(float(s.rho), 4)
    (1, True, 0.05)
  """
  count: jax.Array
  base_state: optax.OptState
  rho: jax.Array
  rho_scale: jax.Array
  cooldown: jax.Array
  sam_active: jax.Array
  detector: hallucination.DetectorState | None
  cache: TwoCallCache | None
  ascent_state: optax.OptState | None = None
  orthogonal: Updates | None = None
  switch: SwitchState | None = None


def _is_static(value: Any) -> bool:
  """A Python number fixed at construction (not a schedule, not traced)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SAMOptions:
  """Everything `sam` is configured with but the base optimizer.

  Validated on construction (`ArgumentError` names the field). The fields
  are `sam`'s keyword arguments, documented there; numbers may be traced
  (under `optax.inject_hyperparams`), and are then checked where they were
  concrete.

  Example:

    >>> import optax
    >>> from geom import sam
    >>> options = sam.SAMOptions(rho=0.05, warmup_steps=10)
    >>> tx = sam.from_options(optax.sgd(0.1), options)   # = sam.sam(...)
    >>> options.never_perturbs, options.may_skip, options.scheduled_rho(3)
    (False, True, 0.0)
    >>> try:
    ...   sam.SAMOptions(rho=-0.1)
    ... except ValueError as e:   # geom.ArgumentError names the field.
    ...   print(e.argument, e.value)
    rho -0.1
  """
  rho: float | optax.Schedule = 0.05
  adaptive: bool = False
  eta: float = 0.01
  eps: float = 1e-12
  warmup_steps: int = 0
  window: tuple[int, int | None] | None = None
  batch_axis_name: str | None = None
  detector: hallucination.DetectorConfig | None = (
      hallucination.DetectorConfig())
  response: Responses = 'flag'
  restart_steps: int = 100
  shrink_factor: float = 0.5
  mode: Literal['opaque', 'two_call'] = 'opaque'
  fused: bool = False
  ascent: optax.GradientTransformation | None = None
  reset_ascent: bool = True
  every: int = 1
  alpha: float = 0.7
  ae_margin: float | optax.Schedule | None = None
  ae_decay: float = 0.9
  ae_select: bool | None = None

  def __post_init__(self):
    check = functools.partial(validation.check, _OWNER)
    check('rho', self.rho, lambda r: 0 <= r < math.inf,
          'finite and >= 0 (or a schedule)')
    check('eta', self.eta, lambda v: 0 < v < math.inf, 'finite and > 0')
    check('eps', self.eps, lambda v: 0 <= v < math.inf, 'finite and >= 0')
    check('warmup_steps', self.warmup_steps, lambda v: v >= 0, '>= 0')
    check('restart_steps', self.restart_steps, lambda v: v >= 1, '>= 1')
    check('shrink_factor', self.shrink_factor, lambda v: 0 < v < 1,
          'in (0, 1)')
    check('every', self.every, lambda v: v >= 1 and v == int(v),
          'an integer >= 1')
    check('alpha', self.alpha, lambda v: 0 <= v < math.inf, 'finite and >= 0')
    check('ae_decay', self.ae_decay, lambda v: 0 < v < 1, 'in (0, 1)')
    if self.ae_margin is not None and not callable(self.ae_margin):
      check('ae_margin', self.ae_margin, math.isfinite,
            'finite (or a schedule, or None for no switch)')
    # Checked where concrete (inject_hyperparams builds with a concrete
    # every at init); there, a traced every is not read.
    if validation.is_concrete(self.every) and int(self.every) != 1:
      if self.mode == 'two_call':
        raise validation.ArgumentError(
            _OWNER, 'every', "LookSAM's reuse (every > 1) needs "
            "mode='opaque'", value=self.every)
      if self.batch_axis_name is not None:
        raise validation.ArgumentError(
            _OWNER, 'every', "LookSAM's reuse (every > 1) is not supported "
            'with m-sharpness (batch_axis_name)', value=self.every)
    if self.window is not None:
      if len(self.window) != 2:
        raise validation.ArgumentError(
            _OWNER, 'window', 'must be (start, stop) with stop None for no '
            'end', value=self.window)
      start, stop = self.window
      if start < 0 or (stop is not None and stop <= start):
        raise validation.ArgumentError(
            _OWNER, 'window', 'empty or negative (need 0 <= start < stop)',
            value=self.window)
    validation.check_choice(_OWNER, 'response', self.response, _RESPONSES)
    if self.response != 'flag' and self.detector is None:
      raise validation.ArgumentError(
          _OWNER, 'response', 'needs a detector (detector=None)',
          value=self.response)
    validation.check_choice(_OWNER, 'mode', self.mode, _MODES)
    if self.mode == 'two_call' and self.batch_axis_name is not None:
      raise validation.ArgumentError(
          _OWNER, 'batch_axis_name', "m-sharpness needs mode='opaque'",
          value=self.batch_axis_name)
    if self.ascent is not None:
      for name in ('adaptive', 'fused'):
        if getattr(self, name):
          raise validation.ArgumentError(
              _OWNER, name, 'the ascent is either ASAM/the fused kernel or '
              'an `ascent` transformation, not both', value=True)
      if self.batch_axis_name is not None and not self.reset_ascent:
        raise validation.ArgumentError(
            _OWNER, 'reset_ascent', 'must be True with m-sharpness (a kept '
            'ascent state would differ from device to device)', value=False)
    _check_switch(self)

  @property
  def never_perturbs(self) -> bool:
    """Whether rho is a constant 0 (every step is the base optimizer's)."""
    return _is_static(self.rho) and float(self.rho) == 0.0

  @property
  def switches(self) -> bool:
    """Whether AE-SAM's switch chooses the SAM steps (`ae_margin` set)."""
    return self.ae_margin is not None

  @property
  def reuses(self) -> bool:
    """Whether some step may reuse g_v (`every` > 1, or traced; never in
    two-call mode, with m-sharpness or with AE-SAM's switch)."""
    if (self.mode == 'two_call' or self.batch_axis_name is not None
        or self.switches):
      return False
    return not (_is_static(self.every) and int(self.every) == 1)

  @property
  def may_skip(self) -> bool:
    """Whether some step may skip g+ (on plain or reuse steps)."""
    return not (not self.reuses and not self.switches
                and _is_static(self.rho) and float(self.rho) > 0
                and _is_static(self.warmup_steps)
                and int(self.warmup_steps) == 0
                and self.window is None and self.response != 'warm_restart')

  def scheduled_rho(self, count: int | jax.Array) -> float | jax.Array:
    """rho at step `count`: the schedule, 0 in the warm-up and outside the
    window. A Python float for a Python `count` and static settings (no
    device work: a trainer asks this on the host every step)."""
    rho = self.rho(count) if callable(self.rho) else self.rho
    due = count >= self.warmup_steps
    if self.window is not None:
      start, stop = self.window
      due = due & (count >= start)
      if stop is not None:
        due = due & (count < stop)
    if isinstance(due, bool) and _is_static(rho):
      return float(rho) if due else 0.0
    return jnp.where(due, jnp.asarray(rho, jnp.float32), 0.0)


def _check_switch(options: SAMOptions) -> None:
  """AE-SAM's switch is one rule for which steps compute g+; it excludes
  the others."""
  if options.ae_select is not None and not options.switches:
    raise validation.ArgumentError(
        _OWNER, 'ae_select', "is an option of AE-SAM's switch: set "
        'ae_margin too', value=options.ae_select)
  if options.switches:
    # Each of these is another rule for which steps compute g+.
    every = (int(options.every) if validation.is_concrete(options.every)
             else 1)
    for name, clash, why in (
        ('every', every != 1, "LookSAM's reuse (every > 1)"),
        ('mode', options.mode != 'opaque', "mode='two_call'"),
        ('batch_axis_name', options.batch_axis_name is not None,
         'm-sharpness (each device would decide on its own |g|)')):
      if clash:
        raise validation.ArgumentError(
            _OWNER, 'ae_margin', "AE-SAM's switch is not supported with "
            f'{why}: drop {name} or set ae_margin=None',
            value=options.ae_margin)


def is_sam_step(options: SAMOptions, count: int | jax.Array,
                cooldown: int | jax.Array = 0,
                rho_scale: float | jax.Array = 1.0) -> bool | jax.Array:
  """Whether step `count` perturbs (computes g+): its effective rho is > 0
  and, with `every` = k > 1, it is a multiple of k steps after the first
  step SAM may run (the warm-up's end, the window's start).

  Args:
    options: the SAM configuration.
    count: completed steps (a Python int on the host, or traced).
    cooldown: plain steps left of a warm restart (`SAMState.cooldown`).
    rho_scale: `SAMState.rho_scale`.

  Returns:
    A Python bool for Python arguments and static settings; else an array.

  Example:

    >>> from geom import sam
    >>> options = sam.SAMOptions(rho=0.05, window=(10, 20))
    >>> [sam.is_sam_step(options, step) for step in (9, 10, 19, 20)]
    [False, True, True, False]
    >>> options = sam.SAMOptions(rho=0.05, warmup_steps=2, every=3)
    >>> [sam.is_sam_step(options, step) for step in range(7)]
    [False, False, True, False, False, True, False]
  """
  due = _effective_rho(options, count, cooldown, rho_scale) > 0
  return due & _on_phase(options, count)


def _on_phase(options: SAMOptions, count):
  """Whether step `count` is one of every k from the first SAM may run."""
  if not options.reuses:
    return True
  start = options.warmup_steps
  if options.window is not None:
    start = (max(start, options.window[0]) if _is_static(start)
             else jnp.maximum(start, options.window[0]))
  return (count - start) % options.every == 0


def _effective_rho(options, count, cooldown, rho_scale):
  rho = options.scheduled_rho(count)
  if isinstance(rho, float) and _is_static(cooldown) and _is_static(
      rho_scale):
    return rho * rho_scale if cooldown == 0 else 0.0
  return jnp.where(cooldown == 0, jnp.asarray(rho, jnp.float32) * rho_scale,
                   0.0).astype(jnp.float32)


# Global L2 norms: float32, and finite at |g| = 1e20 and non-zero at 1e-25
# (as the fused kernel's), so the ascent step keeps its length rho there.
_tree_norm_f32 = tree_norm.tree_norm_f32


def _tree_vdot_f32(a: Any, b: Any) -> jax.Array:
  return sum(jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def perturbation(grads: Updates, params: Params, rho: jax.Array | float, *,
                 adaptive: bool = False, eta: float = 0.01,
                 eps: float = 1e-12) -> tuple[Updates, jax.Array]:
  """The SAM (or ASAM) ascent step e, in float32, and the norm it divides by.

  The plain-jnp definition of the default ascent (the fused kernel computes
  the same); `perturbed_params(params, e)` is the point SAM evaluates g+ at.

  Args:
    grads: g at `params`.
    params: w.
    rho: radius of the neighbourhood.
    adaptive: ASAM: e = rho T^2 g / (|T g| + eps) with T = |w| + eta.
    eta: ASAM's offset, > 0.
    eps: added to the norm, so that g = 0 gives e = 0, not NaN.

  Returns:
    (e as a float32 tree shaped like `params`, |g| or |T g| as float32).

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import sam
    >>> e, norm = sam.perturbation(jnp.array([3.0, 4.0]), jnp.zeros(2), rho=0.5)
    >>> [round(float(v), 4) for v in e], float(norm)
    ([0.3, 0.4], 5.0)
    >>> e, norm = sam.perturbation(jnp.array([1.0, 1.0]), jnp.array([1.0, 0.0]),
    ...                            rho=0.5, adaptive=True, eta=0.0)   # ASAM
    >>> [round(float(v), 4) for v in e]   # T = |w|: the zero weight stays put.
    [0.5, 0.0]
  """
  g = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
  if adaptive:
    t = jax.tree.map(lambda w: jnp.abs(w.astype(jnp.float32)) + eta, params)
    norm = _tree_norm_f32(jax.tree.map(jnp.multiply, t, g))
    scale = rho / (norm + eps)
    e = jax.tree.map(lambda ti, gi: scale * ti * ti * gi, t, g)
  else:
    norm = _tree_norm_f32(g)
    scale = rho / (norm + eps)
    e = jax.tree.map(lambda gi: scale * gi, g)
  return e, norm


def perturbed_params(params: Params, e: Updates) -> Params:
  """w + e, added in float32 and cast back to each parameter's dtype.

  Example:

    >>> import jax.numpy as jnp
    >>> from geom import sam
    >>> w = {'a': jnp.ones(2, jnp.bfloat16)}
    >>> e, _ = sam.perturbation({'a': jnp.array([3.0, 4.0])}, w, rho=0.5)
    >>> w_adv = sam.perturbed_params(w, e)
    >>> w_adv['a'].dtype, w_adv['a'].tolist()
    (dtype(bfloat16), [1.296875, 1.3984375])
  """
  return jax.tree.map(
      lambda w, ei: (w.astype(jnp.float32) + ei).astype(w.dtype), params, e)


def _cast_like(tree: Any, like: Any) -> Any:
  return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def _inner_with_grad(options, w_adv, params, g_adv, norm, rho):
  """<g, g+> from the perturbation actually applied, w_adv - w.

  e is g scaled (SAM: rho / (|g| + eps); ASAM: elementwise by rho T^2 /
  (|T g| + eps)), so g is recovered from w_adv - w, which SAM holds anyway:
  keeping g itself alive through the second gradient would cost one more
  gradient-sized buffer. In float32 the rounding of w + e changes the
  result by about 1e-7 |w| / |e| per element; in bfloat16 it measures the
  perturbation that was really applied.
  """
  def direction(wa, w):
    d = wa.astype(jnp.float32) - w.astype(jnp.float32)
    if options.adaptive:
      d = d / jnp.square(jnp.abs(w.astype(jnp.float32)) + options.eta)
    return d

  applied = jax.tree.map(direction, w_adv, params)
  return (norm + options.eps) / rho * _tree_vdot_f32(applied, g_adv)


def _ascent_point(options: SAMOptions, grads, params, rho, ascent_state):
  """(w + e, the norm the detector reads (|g| or |T g|), the ascent state)."""
  if options.ascent is not None:
    step, ascent_state = options.ascent.update(grads, ascent_state, params)
    # optax's convention: the transformation returns a descent step.
    e = jax.tree.map(lambda s: -rho * s.astype(jnp.float32), step)
    return perturbed_params(params, e), _tree_norm_f32(grads), ascent_state
  if options.fused:
    w_adv, norm = fused_kernels.sam_perturb(
        params, grads, rho, adaptive=options.adaptive, eta=options.eta,
        eps=options.eps)
    return w_adv, norm, ascent_state
  e, norm = perturbation(grads, params, rho, adaptive=options.adaptive,
                         eta=options.eta, eps=options.eps)
  return perturbed_params(params, e), norm, ascent_state


def _next_ascent_state(options: SAMOptions, params, new, old, perturbed):
  """The ascent state after a step: reset after a perturbation if asked."""
  if options.ascent is None:
    return None
  if options.reset_ascent:
    return jax.tree.map(lambda fresh, kept: jnp.where(perturbed, fresh, kept),
                        options.ascent.init(params), old)
  return jax.tree.map(lambda a, b: jnp.where(perturbed, a, b), new, old)


# g_v below this fraction of |g+| counts as 0 (g+ parallel to g): float32
# rounding leaves about 1e-7 |g+| of the projection, which the reuse step
# would otherwise rescale to alpha |g|.
_PARALLEL_RTOL = 1e-5


def _orthogonal(grads: Updates, g_adv: Updates, like: Params) -> Updates:
  """LookSAM's g_v = g+ - <g, g+> g / |g|^2, in float32, cast like `like`."""
  g_norm = _tree_norm_f32(grads)
  inv = jnp.where(g_norm > 0, 1.0 / g_norm, 0.0)
  unit = jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)
  along = _tree_vdot_f32(unit, g_adv)
  g_v = jax.tree.map(lambda u, gs: gs.astype(jnp.float32) - along * u, unit,
                     g_adv)
  keep = _tree_norm_f32(g_v) > _PARALLEL_RTOL * _tree_norm_f32(g_adv)
  return jax.tree.map(lambda v, p: jnp.where(keep, v, 0.0).astype(p.dtype),
                      g_v, like)


def _reused(options: SAMOptions, grads: Updates, g_v: Updates,
            reuse: jax.Array) -> Updates:
  """LookSAM's g + alpha |g| / |g_v| g_v where `reuse`, else g exactly."""
  v_norm = _tree_norm_f32(g_v)
  scale = jnp.where(reuse & (v_norm > 0),
                    options.alpha * _tree_norm_f32(grads) / v_norm, 0.0)
  return jax.tree.map(
      lambda g, v: jnp.where(reuse, (g.astype(jnp.float32) + scale * v.astype(
          jnp.float32)).astype(g.dtype), g), grads, g_v)


# |g|^2 is capped here so that its running statistics stay finite for any
# finite |g| (|g| = 1e20 squares to 1e40, past float32's 3.4e38).
_SQ_NORM_CAP = 3.4e38 / 4


def _switch(options: SAMOptions, switch: SwitchState, grads: Updates,
            count: jax.Array) -> tuple[SwitchState, jax.Array]:
  """AE-SAM's statistics after this step's |g|^2, and whether it asks SAM."""
  norm = _tree_norm_f32(grads)
  finite = jnp.isfinite(norm)
  sq = jnp.where(finite, jnp.minimum(jnp.square(norm), _SQ_NORM_CAP), 0.0)
  delta = jnp.asarray(options.ae_decay, jnp.float32)
  mean = delta * switch.mean + (1 - delta) * sq
  # sigma^2 = delta sigma^2 + (1 - delta) (sq - mean)^2, without squaring.
  std = jnp.hypot(jnp.sqrt(delta) * switch.std,
                  jnp.sqrt(1 - delta) * jnp.abs(sq - mean))
  mean = jnp.where(finite, mean, switch.mean)
  std = jnp.where(finite, std, switch.std)
  margin = (options.ae_margin(count) if callable(options.ae_margin)
            else options.ae_margin)
  threshold = mean + jnp.asarray(margin, jnp.float32) * std
  chosen = finite & (sq >= threshold)
  return SwitchState(mean=mean, std=std, sq_grad_norm=sq,
                     threshold=threshold, sam_steps=switch.sam_steps), chosen


def _one_argument(grad_fn: GradFn) -> Callable[[Params], Updates]:
  """`grad_fn` as grad_fn(params): optax's grad_fn(params, i) gets i = 0."""
  try:
    parameters = inspect.signature(grad_fn).parameters.values()
  except (TypeError, ValueError):  # No signature: take it as one argument.
    return grad_fn
  positional = (inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD)
  required = [p for p in parameters
              if p.kind in positional and p.default is p.empty]
  if len(required) == 2:
    return lambda p: grad_fn(p, 0)
  return grad_fn


def _mean_over_axis(options: SAMOptions, tree):
  if options.batch_axis_name is None:
    return tree
  return jax.lax.pmean(tree, options.batch_axis_name)


def _respond(options: SAMOptions, state: SAMState, det, sam_step: jax.Array):
  """The response to a flag; returns (detector, rho_scale, cooldown)."""
  cooldown = jnp.where(~sam_step & (state.cooldown > 0),
                       state.cooldown - 1, state.cooldown)
  rho_scale = state.rho_scale
  if det is None:
    return None, rho_scale, cooldown
  fired = det.flagged & sam_step
  if options.response == 'warm_restart':
    cooldown = jnp.where(fired, jnp.asarray(options.restart_steps, jnp.int32),
                         cooldown)
  elif options.response == 'shrink_rho':
    rho_scale = jnp.where(fired, rho_scale * options.shrink_factor, rho_scale)
  if options.response != 'flag':
    det = jax.tree.map(lambda a, b: jnp.where(fired, a, b),
                       hallucination.restart(det), det)
  return det, rho_scale, cooldown


def _init(options: SAMOptions, base: optax.GradientTransformationExtraArgs,
          params: Params) -> SAMState:
  cache = None
  if options.mode == 'two_call':
    cache = TwoCallCache(phase=jnp.zeros((), jnp.int32), params=params,
                         grads=jax.tree.map(jnp.zeros_like, params))
  detector = options.detector
  return SAMState(
      count=jnp.zeros((), jnp.int32),
      base_state=base.init(params),
      rho=jnp.zeros((), jnp.float32),
      rho_scale=jnp.ones((), jnp.float32),
      cooldown=jnp.zeros((), jnp.int32),
      sam_active=jnp.zeros((), jnp.bool_),
      detector=(None if detector is None
                else hallucination.init(detector.track_cosine)),
      cache=cache,
      ascent_state=(None if options.ascent is None
                    else options.ascent.init(params)),
      orthogonal=(jax.tree.map(jnp.zeros_like, params) if options.reuses
                  else None),
      switch=(SwitchState(*(jnp.zeros((), jnp.float32),) * 4,
                          sam_steps=jnp.zeros((), jnp.int32))
              if options.switches else None))


def _check_call(params, grad_fn, needs_grad_fn: bool):
  if params is None:
    raise validation.ArgumentError('geom.sam.sam', 'params',
                                   'update needs params (the weights w)')
  if needs_grad_fn and grad_fn is None:
    raise validation.ArgumentError(
        'geom.sam.sam', 'grad_fn',
        'update needs grad_fn=lambda params: grads (the loss gradient at '
        "other weights, same batch) in mode='opaque'; pass it, or use "
        "mode='two_call' for loops that cannot.")


def _step_gradients(options: SAMOptions, sam_step, active, sam_grads,
                    plain_grads):
  """(the gradient the base steps with, the detector's statistics, the
  ascent state, g_v, whether g+ was computed): from `sam_grads` or
  `plain_grads` as `sam_step`, the options and `active` choose."""
  if options.never_perturbs or sam_step is False:
    # The base optimizer's own computation (or a reuse step), nothing else.
    return (*plain_grads(None), jnp.array(False))
  elif sam_step:
    return (*sam_grads(None), jnp.array(True))
  elif options.switches:
    # Skip g+ in a cond, or compute both and keep the switch's pick (no
    # conditional: see `sam`'s ae_select); None picks by platform.
    select = lambda: jax.tree.map(lambda a, b: jnp.where(active, a, b),
                                  sam_grads(None), plain_grads(None))
    skip = lambda: jax.lax.cond(active, sam_grads, plain_grads, None)
    if options.ae_select is None:
      picked = jax.lax.platform_dependent(cpu=select, default=skip)
    else:
      picked = select() if options.ae_select else skip()
    return (*picked, active)
  elif not options.may_skip:
    # No step can be plain: straight-line code, which XLA schedules with
    # the memory of a hand-written SAM step (a cond's output would hold
    # one more gradient-sized buffer).
    return (*sam_grads(None), active)
  else:
    return (*jax.lax.cond(active, sam_grads, plain_grads, None), active)


def _opaque_update(options: SAMOptions,
                   base: optax.GradientTransformationExtraArgs,
                   grads: Updates, state: SAMState, params: Params = None, *,
                   grad_fn: GradFn | None = None,
                   sam_step: bool | None = None,
                   **extra_args) -> tuple[Updates, SAMState]:
  _check_call(params, grad_fn, needs_grad_fn=True)
  grad_fn = _one_argument(grad_fn)
  rho = _effective_rho(options, state.count, state.cooldown, state.rho_scale)
  due = rho > 0  # SAM's steps: full (g+) or, with every > 1, reuse steps.
  active = due & _on_phase(options, state.count)  # Computes g+.
  switch = state.switch
  if options.switches:
    if sam_step is not None:
      raise validation.ArgumentError(
          'geom.sam.sam', 'sam_step', "AE-SAM's switch (ae_margin) decides "
          'on the device which steps are SAM steps; call update without '
          'sam_step', value=sam_step)
    switch, chosen = _switch(options, switch, grads, state.count)
    active = active & chosen
  tracked = options.detector is not None and options.detector.track_cosine
  reuses = options.reuses

  def sam_grads(_):
    w_adv, norm, ascent_state = _ascent_point(options, grads, params, rho,
                                              state.ascent_state)
    grad_norm = (_tree_norm_f32(grads) if options.adaptive else norm)
    g_adv = _cast_like(grad_fn(w_adv), grads)
    inner = None
    if tracked:
      inner = (_tree_vdot_f32(grads, g_adv) if options.ascent is not None
               else _inner_with_grad(options, w_adv, params, g_adv, norm, rho))
    stats = (grad_norm, _tree_norm_f32(g_adv), inner)
    if options.batch_axis_name is not None:
      stats = jax.lax.pmean(stats, options.batch_axis_name)
    g_v = _orthogonal(grads, g_adv, params) if reuses else None
    return _mean_over_axis(options, g_adv), stats, ascent_state, g_v

  def plain_grads(_):  # Plain steps, and LookSAM's reuse steps (no g+).
    zero = jnp.zeros((), jnp.float32)
    step_grads, g_v = _mean_over_axis(options, grads), None
    if reuses:
      step_grads = _reused(options, step_grads, state.orthogonal, due)
      g_v = jax.tree.map(lambda v: jnp.where(due, v, jnp.zeros_like(v)),
                         state.orthogonal)
    return (step_grads, (zero, zero, zero if tracked else None),
            state.ascent_state, g_v)

  step_grads, stats, ascent_state, g_v, active = _step_gradients(
      options, sam_step, active, sam_grads, plain_grads)
  updates, base_state = base.update(step_grads, state.base_state, params,
                                    **extra_args)
  det = state.detector
  if det is not None:  # Fed by steps with g+ only (not reuse steps).
    det = hallucination.update(det, options.detector, active, *stats)
  det, rho_scale, cooldown = _respond(options, state, det, active)
  if switch is not None:
    switch = switch._replace(
        sam_steps=switch.sam_steps + active.astype(jnp.int32))
  return updates, SAMState(
      count=state.count + 1, base_state=base_state,
      rho=jnp.where(active, rho, 0.0).astype(jnp.float32),
      rho_scale=rho_scale, cooldown=cooldown, sam_active=active,
      detector=det, cache=None,
      ascent_state=_next_ascent_state(options, params, ascent_state,
                                      state.ascent_state, active),
      orthogonal=g_v, switch=switch)


def _two_call_update(options: SAMOptions,
                     base: optax.GradientTransformationExtraArgs,
                     grads: Updates, state: SAMState, params: Params = None, *,
                     grad_fn: GradFn | None = None,
                     sam_step: bool | None = None,
                     **extra_args) -> tuple[Updates, SAMState]:
  del grad_fn  # Not used: the second call brings g+.
  if sam_step is not None:
    raise validation.ArgumentError('geom.sam.sam', 'sam_step',
                                   "is for mode='opaque'", value=sam_step)
  _check_call(params, None, needs_grad_fn=False)
  cache = state.cache
  second = cache.phase == 1  # grads is g+ at w + e; cache.params is w.
  rho = _effective_rho(options, state.count, state.cooldown, state.rho_scale)
  ascend = ~second & (rho > 0)
  # The base step runs outside any branch, so a plain step is the base
  # optimizer's own computation; on an ascent call its result is dropped.
  w = jax.tree.map(lambda c, p: jnp.where(second, c, p), cache.params,
                   params)
  base_updates, base_state = base.update(grads, state.base_state, w,
                                         **extra_args)
  w_adv, _, ascent_state = _ascent_point(options, grads, params, rho,
                                         state.ascent_state)
  updates = jax.tree.map(
      lambda u, wa, p, w0: jnp.where(
          ascend, wa - p, jnp.where(second, w0 - p + u, u)).astype(p.dtype),
      base_updates, w_adv, params, cache.params)
  det = state.detector
  if det is not None:
    det = hallucination.update(
        det, options.detector, second, _tree_norm_f32(cache.grads),
        _tree_norm_f32(grads),
        (_tree_vdot_f32(cache.grads, grads) if options.detector.track_cosine
         else None))
  det, rho_scale, cooldown = _respond(options, state, det, ascend | second)
  keep = lambda new, old: jax.tree.map(
      lambda a, b: jnp.where(ascend, b, a), new, old)
  new_cache = TwoCallCache(
      phase=ascend.astype(jnp.int32),
      params=jax.tree.map(lambda p, c: jnp.where(ascend, p, c), params,
                          cache.params),
      grads=jax.tree.map(lambda g, c: jnp.where(ascend, g.astype(c.dtype), c),
                         grads, cache.grads))
  if options.ascent is None:
    next_ascent = None
  else:
    # The ascent call advances the state; the second call may reset it.
    kept = jax.tree.map(lambda a, b: jnp.where(ascend, a, b), ascent_state,
                        state.ascent_state)
    next_ascent = _next_ascent_state(options, cache.params, kept, kept,
                                     second)
  return updates, SAMState(
      count=state.count + (~ascend).astype(jnp.int32),
      base_state=keep(base_state, state.base_state),
      rho=jnp.where(ascend | second, jnp.where(ascend, rho, state.rho),
                    0.0).astype(jnp.float32),
      rho_scale=rho_scale, cooldown=cooldown, sam_active=ascend | second,
      detector=det, cache=new_cache, ascent_state=next_ascent)


def from_options(base_optimizer: optax.GradientTransformation,
                 options: SAMOptions) -> optax.GradientTransformationExtraArgs:
  """`sam` from a `SAMOptions` (the object `hooks` reads too).

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> options = sam.SAMOptions(rho=0.05, adaptive=True)
    >>> tx = sam.from_options(optax.adam(1e-3), options)
    >>> loop_needs = sam.hooks(options)   # The same options, read by the loop.
    >>> loop_needs.update_arguments
    ('grad_fn',)
  """
  base = optax.with_extra_args_support(base_optimizer)
  update = _opaque_update if options.mode == 'opaque' else _two_call_update
  return optax.GradientTransformationExtraArgs(
      functools.partial(_init, options, base),
      functools.partial(update, options, base))


def sam(
    base_optimizer: optax.GradientTransformation,
    rho: float | optax.Schedule = 0.05,
    *,
    adaptive: bool = False,
    eta: float = 0.01,
    eps: float = 1e-12,
    warmup_steps: int = 0,
    window: tuple[int, int | None] | None = None,
    batch_axis_name: str | None = None,
    detector: hallucination.DetectorConfig | None = (
        hallucination.DetectorConfig()),
    response: Responses = 'flag',
    restart_steps: int = 100,
    shrink_factor: float = 0.5,
    mode: Literal['opaque', 'two_call'] = 'opaque',
    fused: bool = False,
    ascent: optax.GradientTransformation | None = None,
    reset_ascent: bool = True,
    every: int = 1,
    alpha: float = 0.7,
    ae_margin: float | optax.Schedule | None = None,
    ae_decay: float = 0.9,
    ae_select: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Sharpness-aware minimization around any optax optimizer.

  Args:
    base_optimizer: the optimizer that steps with g+ (any optax one).
    rho: radius, a float >= 0 or a schedule of the step count.
    adaptive: ASAM (scale-invariant neighbourhood T = |w| + eta).
    eta: ASAM's offset, > 0.
    eps: added to the perturbation's norm (g = 0 gives e = 0).
    warmup_steps: the first steps are plain base steps on g, >= 0.
    window: (start, stop): SAM only for start <= step < stop (None: no end).
    batch_axis_name: m-sharpness: the mapped axis (`jax.shard_map`, pmap)
      whose devices each perturb with their own gradient, averaged over it.
    detector: thresholds of the hallucination detector, or None to skip it.
    response: on a flag: 'flag' (record it), 'warm_restart'
      (`restart_steps` plain steps) or 'shrink_rho' (rho * `shrink_factor`).
    restart_steps: plain steps of a warm restart, >= 1.
    shrink_factor: rho's multiplier on each 'shrink_rho' response, in (0, 1).
    mode: 'opaque' (one call, needs `grad_fn`) or 'two_call' (alternating
      calls, no `grad_fn`; keeps a copy of w and g in the state).
    fused: w + e by `geom.kernels.sam_perturb`'s Pallas kernels.
    ascent: an optax transformation as `optax.contrib.sam`'s `adv_optimizer`
      (e = -rho * its update), not with `adaptive`/`fused`. None: rho g / |g|.
    reset_ascent: restart `ascent`'s state at every SAM step (optax's
      `reset_state`); False keeps it (e.g. Adam moments) between them.
    every: LookSAM: g+ on every k-th step only, g plus the stored part of
      g+ orthogonal to its g in between (opaque mode). 1: SAM.
    alpha: LookSAM's weight of that part on the reuse steps, >= 0.
    ae_margin: AE-SAM's c (a float or a schedule): g+ only on steps with
      |g|^2 >= mu + c sigma, their running mean and deviation; None: off.
    ae_decay: AE-SAM's delta, the statistics' decay, in (0, 1).
    ae_select: True: g+ on every step, the switch's pick kept; False: g+
      skipped in a `lax.cond`; None: True on CPU only (docs/methods/sam.md).

  Returns:
    An `optax.GradientTransformationExtraArgs`; opaque mode's update is
    `update(grads, state, params, *, grad_fn, sam_step=None, **extra)`:
    `grad_fn(params)` (or `grad_fn(params, i)`) the gradient at other weights,
    same batch; `sam_step` (bool) fixes at trace time whether g+ is computed.

  Raises:
    ArgumentError: (a ValueError) for an invalid argument, naming it.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
    >>> tx, w = sam.sam(optax.sgd(0.1), rho=0.05), jnp.zeros(2)
    >>> updates, state = tx.update(jax.grad(loss)(w), tx.init(w), w,
    ...                            grad_fn=jax.grad(loss))
    >>> [round(float(u), 4) for u in updates]   # -0.1 g+, g+ at w + e
    [0.2071, 0.2071]
  """
  fields = dict(locals())  # The arguments: SAMOptions' fields and the base.
  return from_options(fields.pop('base_optimizer'), SAMOptions(**fields))


def find_state(opt_state: optax.OptState) -> SAMState | None:
  """The (first) `SAMState` inside any optax state (chain, inject, MultiSteps),
  or None when there is none.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
    >>> tx = sam.sam(optax.sgd(0.1), rho=0.05)
    >>> w = jnp.zeros(2)
    >>> state = tx.init(w)
    >>> updates, state = tx.update(jax.grad(loss)(w), state, w,
    ...                            grad_fn=jax.grad(loss))
    >>> chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
    >>> type(sam.find_state(chained.init(w))).__name__
    'SAMState'
    >>> sam.find_state(optax.sgd(0.1).init(w)) is None
    True
  """
  return method_hooks.find_state(opt_state, SAMState)


def diagnostics(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """SAM's statistics from an optimizer state that contains a `sam` state.

  Returns:
    A dict of scalars: `sam_active` (the last step used SAM), `rho` (its
    rho), `grad_norm` |g|, `perturbed_grad_norm` |g+|, `grad_ratio`
    |g+|/|g| and `cosine` cos(g, g+) of the last SAM step, their moving
    averages `grad_norm_ema`, `grad_ratio_ema`, `cosine_ema`, the slow
    average `grad_norm_scale` (the detector's scale of |g|),
    `hallucination` (flagged now), `hallucination_steps` (steps flagged so
    far), `sam_steps` (SAM steps so far) and `cooldown` (plain steps left
    of a warm restart). The cosines only when the detector tracks them.
    Without a detector, only `sam_active`, `rho` and `cooldown`. With
    AE-SAM's switch also `ae_sq_grad_norm` |g|^2, `ae_mean`, `ae_std`,
    `ae_threshold` (mu + c sigma, which |g|^2 was compared with) and
    `ae_sam_steps` (steps that computed g+).

  Raises:
    ArgumentError: if `opt_state` contains no `sam` state.

  Example:

    >>> import jax, jax.numpy as jnp, optax
    >>> from geom import sam
    >>> loss = lambda w: jnp.sum((w - 1.0) ** 2)
    >>> tx = sam.sam(optax.sgd(0.1), rho=0.05)
    >>> w = jnp.zeros(2)
    >>> state = tx.init(w)
    >>> updates, state = tx.update(jax.grad(loss)(w), state, w,
    ...                            grad_fn=jax.grad(loss))
    >>> d = sam.diagnostics(state)
    >>> bool(d['sam_active']), round(float(d['grad_norm']), 4)   # |g| at w
    (True, 2.8284)
    >>> bool(d['hallucination'])
    False
  """
  state = find_state(opt_state)
  if state is None:
    raise validation.ArgumentError(
        'geom.sam.diagnostics', 'opt_state',
        'the optimizer state contains no geom.sam.sam state')
  out = {'sam_active': state.sam_active, 'rho': state.rho,
         'cooldown': state.cooldown}
  if state.switch is not None:
    out.update(ae_sq_grad_norm=state.switch.sq_grad_norm,
               ae_mean=state.switch.mean, ae_std=state.switch.std,
               ae_threshold=state.switch.threshold,
               ae_sam_steps=state.switch.sam_steps)
  det = state.detector
  if det is not None:
    ratio, _ = hallucination.step_statistics(
        det.grad_norm, det.perturbed_grad_norm, det.grad_norm)
    out.update(
        grad_norm=det.grad_norm, perturbed_grad_norm=det.perturbed_grad_norm,
        grad_ratio=ratio, grad_norm_ema=det.grad_norm_ema,
        grad_norm_scale=det.grad_norm_scale, grad_ratio_ema=det.ratio_ema,
        hallucination=det.flagged,
        hallucination_steps=det.flagged_steps, sam_steps=det.sam_steps)
    if det.cosine is not None:
      out.update(cosine=det.cosine, cosine_ema=det.cosine_ema)
  return out


def hooks(options: SAMOptions) -> method_hooks.MethodHooks:
  """What a training loop needs to run `from_options(base, options)`.

  Opaque mode asks for `grad_fn`; when some steps may be plain (warm-up,
  window, a schedule reaching 0, warm restarts), the loop may compile a
  SAM and a plain step (`sam_step=True/False`) and pick one per step with
  `is_sam_step` on the host, which reads the warm restart's cooldown from
  the state only when `response='warm_restart'`. AE-SAM's switch decides
  on the device, so the loop compiles one step. m-sharpness asks for a
  per-device update over `batch_axis_name`.

  Example:

    >>> import optax
    >>> from geom import sam
    >>> h = sam.hooks(sam.SAMOptions(rho=0.05, warmup_steps=2))
    >>> h.update_arguments, h.variants.argument
    (('grad_fn',), 'sam_step')
    >>> [h.variants.choose(step, None) for step in range(4)]   # On the host.
    [False, False, True, True]
  """
  variants = None
  # AE-SAM's switch decides on the device, from this step's |g|: one
  # compiled step, which skips g+ in a cond.
  if (options.mode == 'opaque' and options.may_skip
      and not options.never_perturbs and not options.switches):
    reads_state = options.response == 'warm_restart'

    def choose(step: int, opt_state: optax.OptState) -> bool:
      cooldown = 0
      if reads_state:
        cooldown = int(jax.device_get(find_state(opt_state).cooldown))
      return bool(is_sam_step(options, step, cooldown))

    variants = method_hooks.StepVariants('sam_step', (True, False), choose,
                                         reads_state)
  console = (('grad_ratio_ema', 'hallucination_steps')
             if options.detector is not None else ())
  if options.switches:
    console += ('ae_sam_steps',)
  return method_hooks.MethodHooks(
      name='sam',
      update_arguments=('grad_fn',) if options.mode == 'opaque' else (),
      variants=variants, diagnostics=diagnostics, console=console,
      per_device_axis=options.batch_axis_name,
      # Pallas's interpreter (CPU) rejects device-varying operands.
      check_per_device_types=not (options.fused
                                  and fused_kernels.interprets_by_default()))
