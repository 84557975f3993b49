"""SAM, ASAM and m-sharpness as an Optax transformation, with warm-start,
step windows and hallucinated-minimizer detection.

One SAM step at weights w with loss gradient g:

    e    = rho * g / (|g| + eps)             (ASAM: rho * T^2 g / (|T g| + eps),
                                               T = |w| + eta, elementwise)
    g+   = grad L(w + e)                      (same batch)
    w   <- w + base_optimizer.update(g+, w)

`sam(base_optimizer, rho)` wraps any optax transformation. In the default
(opaque) mode `update(grads, state, params, grad_fn=...)` does the whole
step in one call: `grad_fn(params) -> grads` evaluates the loss gradient at
other weights on the same batch. In two-call (transparent) mode, for loops
that cannot pass `grad_fn`, calls alternate: the first returns the update
to w + e, the second (given g+ at w + e) returns the update that goes back
to w and applies the base step, as `optax.contrib.sam` does.

On top of plain SAM:
- warm-start: the first `warmup_steps` steps are plain base steps on g
  (Park et al., arXiv 2509.21818: a short SGD phase before SAM avoids the
  hallucinated minimizers that SAM alone can converge to);
- a step window: SAM only for `window[0] <= step < window[1]` (the SAM
  mid-training phase of arXiv 2605.02105);
- a detector of hallucinated minimizers (`geom.hallucination`) fed by g
  and g+, with a response: only flag, fall back to plain steps for a while
  (warm restart), or shrink rho.
Steps without SAM never compute the second gradient: the branch is a
`lax.cond` inside jit, so they cost what a base step costs. A caller that
knows the branch on the host can pass `sam_step=True/False` to `update`
and compile each branch without a cond (`StepSchedule` gives the same
answer on the host): on XLA:CPU a convolution's gradient inside a cond
runs about 70x slower than outside (measured), which the trainer avoids
this way. With rho = 0 a step is a plain base step, so the result equals
the base optimizer's exactly.

The perturbation (norm and w + e) is computed in float32 whatever the
parameter dtype, then cast back for `grad_fn`.

m-sharpness: with `batch_axis_name`, `update` runs inside `jax.shard_map`
(or pmap) over that axis with per-device gradients; each device perturbs
with its own gradient, and the perturbed gradients (or, on plain steps,
the gradients) are averaged over the axis before the base optimizer. In
`shard_map`, take the local gradient at the device-varying copy of the
weights, `jax.lax.pcast(params, axis, to='varying')`: the gradient with
respect to replicated weights is already summed over the axis.

Where clipping applies: put `optax.clip_by_global_norm` inside
`base_optimizer` and it clips the gradient the base optimizer steps with
(g+ on SAM steps, g on plain steps). Clipping before SAM would not change
e, since e is normalised.

Which parts are the papers': SAM (Foret et al., 2021), ASAM (Kwon et al.,
2021), m-sharpness (Foret et al.), hallucinated minimizers and the
warm-start remedy (Park et al., 2025/2026), the mid-training window
(arXiv 2605.02105). Ours: the detector statistics and thresholds, the
response policies, and eps in the ASAM denominator.

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
"""

from collections.abc import Callable
import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from geom import hallucination
from geom.kernels import sam_perturb as fused_kernels

Params = Any
Updates = Any
GradFn = Callable[[Params], Updates]
Responses = Literal['flag', 'warm_restart', 'shrink_rho']
RESPONSES = ('flag', 'warm_restart', 'shrink_rho')
MODES = ('opaque', 'two_call')


class TwoCallCache(NamedTuple):
  """What the first call of a two-call SAM step leaves for the second.

  Attributes:
    phase: 0 when the next call brings g at w, 1 when it brings g+ at w + e.
    params: w, the weights before the perturbation.
    grads: g, for the detector statistics.
  """
  phase: jax.Array
  params: Params
  grads: Updates


class SAMState(NamedTuple):
  """State of `sam`.

  Attributes:
    count: completed steps (int32); warm-up and window count these.
    base_state: the base optimizer's state.
    rho: the rho of the last step (float32; 0 on plain steps).
    rho_scale: multiplier of rho, lowered by the 'shrink_rho' response.
    cooldown: plain steps left after a 'warm_restart' response (int32).
    sam_active: whether the last step was a SAM step (bool).
    detector: the hallucination detector's statistics, or None.
    cache: two-call mode only, else None.
  """
  count: jax.Array
  base_state: optax.OptState
  rho: jax.Array
  rho_scale: jax.Array
  cooldown: jax.Array
  sam_active: jax.Array
  detector: hallucination.DetectorState | None
  cache: TwoCallCache | None


@dataclasses.dataclass(frozen=True)
class StepSchedule:
  """Which steps may be SAM steps: from `warmup_steps` on, inside `window`.

  Callable on a step count, a Python int (on the host) or a traced array
  (in jit), with the same answer: `sam` uses it on the device, and a
  trainer can use it on the host to pick the branch (see `sam_step`).
  """
  warmup_steps: int = 0
  window: tuple[int, int | None] | None = None

  def __call__(self, count):
    due = count >= self.warmup_steps
    if self.window is not None:
      due = due & (count >= self.window[0])
      if self.window[1] is not None:
        due = due & (count < self.window[1])
    return due


def _is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _is_static(value: Any) -> bool:
  """A Python number fixed at construction (not a schedule, not traced)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(name: str, value: Any, ok: Callable[[Any], bool], want: str):
  """Validates a concrete argument (values traced by inject_hyperparams pass)."""
  if _is_concrete(value) and not ok(value):
    raise ValueError(f'geom.sam.sam: {name}={value!r}: must be {want}')


def tree_norm_f32(tree: Any) -> jax.Array:
  """Global L2 norm, accumulated in float32 (also for bfloat16 leaves)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in leaves))


def tree_vdot_f32(a: Any, b: Any) -> jax.Array:
  return sum(jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def perturbation(grads: Updates, params: Params, rho: jax.Array | float, *,
                 adaptive: bool = False, eta: float = 0.01,
                 eps: float = 1e-12) -> tuple[Updates, jax.Array]:
  """The SAM (or ASAM) ascent step e, in float32, and the norm it divides by.

  Args:
    grads: g at `params`.
    params: w.
    rho: radius of the neighbourhood.
    adaptive: ASAM: e = rho T^2 g / (|T g| + eps) with T = |w| + eta.
    eta: ASAM's offset, > 0.
    eps: added to the norm, so that g = 0 gives e = 0, not NaN.

  Returns:
    (e as a float32 tree shaped like `params`, |g| or |T g| as float32).
  """
  g = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
  if adaptive:
    t = jax.tree.map(lambda w: jnp.abs(w.astype(jnp.float32)) + eta, params)
    norm = tree_norm_f32(jax.tree.map(jnp.multiply, t, g))
    scale = rho / (norm + eps)
    e = jax.tree.map(lambda ti, gi: scale * ti * ti * gi, t, g)
  else:
    norm = tree_norm_f32(g)
    scale = rho / (norm + eps)
    e = jax.tree.map(lambda gi: scale * gi, g)
  return e, norm


def _inner_with_grad(w_adv, params, g_adv, norm, rho, adaptive, eta, eps):
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
    if adaptive:
      d = d / jnp.square(jnp.abs(w.astype(jnp.float32)) + eta)
    return d

  applied = jax.tree.map(direction, w_adv, params)
  return (norm + eps) / rho * tree_vdot_f32(applied, g_adv)


def perturbed_params(params: Params, e: Updates) -> Params:
  """w + e, added in float32 and cast back to each parameter's dtype."""
  return jax.tree.map(
      lambda w, ei: (w.astype(jnp.float32) + ei).astype(w.dtype), params, e)


def _cast_like(tree: Any, like: Any) -> Any:
  return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


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
) -> optax.GradientTransformationExtraArgs:
  """Sharpness-aware minimization around any optax optimizer.

  Args:
    base_optimizer: the optimizer that steps with the SAM gradient g+
      (e.g. `optax.sgd(0.1, momentum=0.9)`, `optax.adamw(...)`, a chain).
    rho: radius, a float >= 0 or a schedule of the step count.
    adaptive: ASAM (scale-invariant neighbourhood T = |w| + eta).
    eta: ASAM's offset, > 0.
    eps: added to the perturbation's norm (g = 0 gives e = 0).
    warmup_steps: the first steps are plain base steps on g (no second
      gradient). >= 0.
    window: (start, stop): SAM only for start <= step < stop (stop None:
      no end); other steps are plain. Must not be empty.
    batch_axis_name: m-sharpness: the mapped axis (inside `jax.shard_map`
      or pmap) whose devices each perturb with their own gradient; the
      resulting gradients are averaged over it. None: `grads` are already
      global.
    detector: thresholds of the hallucination detector, or None to skip it.
    response: what a flagged hallucination does: 'flag' (only record it),
      'warm_restart' (`restart_steps` plain steps, then SAM again) or
      'shrink_rho' (multiply rho by `shrink_factor`).
    restart_steps: plain steps of a warm restart, >= 1.
    shrink_factor: rho's multiplier on each 'shrink_rho' response, in (0, 1).
    mode: 'opaque' (one call, needs `grad_fn`) or 'two_call' (alternating
      calls, no `grad_fn`; keeps a copy of w and g in the state).
    fused: compute w + e with the Pallas kernels of
      `geom.kernels.sam_perturb` (one norm pass and one update pass over
      all leaves) instead of jnp; equal to the unfused result to float32
      rounding (relative 1e-6 on the norm).

  Returns:
    An `optax.GradientTransformationExtraArgs`. In opaque mode its update
    is `update(grads, state, params, *, grad_fn, sam_step=None,
    **extra_args)`: `sam_step` (a Python bool) fixes the branch of this
    step at trace time instead of deciding it on the device (the caller
    then follows `StepSchedule(warmup_steps, window)`, rho > 0 and, with
    'warm_restart', a zero `cooldown`); other extra arguments go to the
    base optimizer.

  Raises:
    ValueError: for invalid arguments, naming the argument.
  """
  _check('rho', rho, lambda r: callable(r) or r >= 0, '>= 0 (or a schedule)')
  _check('eta', eta, lambda v: v > 0, '> 0')
  _check('eps', eps, lambda v: v >= 0, '>= 0')
  _check('warmup_steps', warmup_steps, lambda v: v >= 0, '>= 0')
  _check('restart_steps', restart_steps, lambda v: v >= 1, '>= 1')
  _check('shrink_factor', shrink_factor, lambda v: 0 < v < 1, 'in (0, 1)')
  if window is not None:
    if len(window) != 2:
      raise ValueError(f'geom.sam.sam: window={window!r}: must be '
                       '(start, stop) with stop None for no end')
    start, stop = window
    if start < 0 or (stop is not None and stop <= start):
      raise ValueError(f'geom.sam.sam: window={window!r}: empty or negative '
                       '(need 0 <= start < stop)')
  if response not in RESPONSES:
    raise ValueError(f'geom.sam.sam: response={response!r}; valid choices: '
                     f'{", ".join(RESPONSES)}')
  if response != 'flag' and detector is None:
    raise ValueError(f'geom.sam.sam: response={response!r} needs a detector '
                     '(detector=None)')
  if mode not in MODES:
    raise ValueError(f'geom.sam.sam: mode={mode!r}; valid choices: '
                     f'{", ".join(MODES)}')
  if mode == 'two_call' and batch_axis_name is not None:
    raise ValueError('geom.sam.sam: batch_axis_name (m-sharpness) needs '
                     "mode='opaque'")
  base = optax.with_extra_args_support(base_optimizer)
  track_cosine = detector is not None and detector.track_cosine
  static_zero_rho = _is_static(rho) and float(rho) == 0.0
  # Whether some step may be a plain base step, which needs a branch.
  always_sam = (_is_static(rho) and float(rho) > 0
                and _is_static(warmup_steps) and int(warmup_steps) == 0
                and window is None and response != 'warm_restart')

  def rho_at(count):
    value = rho(count) if callable(rho) else rho
    return jnp.asarray(value, jnp.float32)

  schedule = StepSchedule(warmup_steps, window)

  def sam_wanted(state: SAMState, rho_t: jax.Array) -> jax.Array:
    return schedule(state.count) & (state.cooldown == 0) & (rho_t > 0)

  def ascent_point(grads, params, rho_t):
    """(w + e, the norm e divides by)."""
    if fused:
      return fused_kernels.sam_perturb(params, grads, rho_t,
                                       adaptive=adaptive, eta=eta, eps=eps)
    e, norm = perturbation(grads, params, rho_t, adaptive=adaptive, eta=eta,
                           eps=eps)
    return perturbed_params(params, e), norm

  def mean_over_axis(tree):
    if batch_axis_name is None:
      return tree
    return jax.lax.pmean(tree, batch_axis_name)

  def respond(state: SAMState, det, sam_step: jax.Array):
    """The response to a flag; returns (detector, rho_scale, cooldown)."""
    cooldown = jnp.where(~sam_step & (state.cooldown > 0),
                         state.cooldown - 1, state.cooldown)
    rho_scale = state.rho_scale
    if det is None:
      return None, rho_scale, cooldown
    fired = det.flagged & sam_step
    if response == 'warm_restart':
      cooldown = jnp.where(fired, jnp.asarray(restart_steps, jnp.int32),
                           cooldown)
    elif response == 'shrink_rho':
      rho_scale = jnp.where(fired, rho_scale * shrink_factor, rho_scale)
    if response != 'flag':
      det = jax.tree.map(lambda a, b: jnp.where(fired, a, b),
                         hallucination.restart(det), det)
    return det, rho_scale, cooldown

  def init_fn(params: Params) -> SAMState:
    cache = None
    if mode == 'two_call':
      cache = TwoCallCache(phase=jnp.zeros((), jnp.int32), params=params,
                           grads=jax.tree.map(jnp.zeros_like, params))
    return SAMState(
        count=jnp.zeros((), jnp.int32),
        base_state=base.init(params),
        rho=jnp.zeros((), jnp.float32),
        rho_scale=jnp.ones((), jnp.float32),
        cooldown=jnp.zeros((), jnp.int32),
        sam_active=jnp.zeros((), jnp.bool_),
        detector=(None if detector is None
                  else hallucination.init(detector.track_cosine)),
        cache=cache)

  def opaque_update(grads, state: SAMState, params=None, *, grad_fn=None,
                    sam_step: bool | None = None, **extra_args):
    if params is None:
      raise ValueError('geom.sam.sam: update needs params (the weights w).')
    if grad_fn is None:
      raise ValueError(
          'geom.sam.sam: update needs grad_fn=lambda params: grads (the loss '
          "gradient at other weights, same batch) in mode='opaque'; pass it, "
          "or use mode='two_call' for loops that cannot.")
    rho_t = rho_at(state.count) * state.rho_scale
    active = sam_wanted(state, rho_t)

    def sam_grads(_):
      w_adv, norm = ascent_point(grads, params, rho_t)
      grad_norm = tree_norm_f32(grads) if adaptive else norm
      g_adv = _cast_like(grad_fn(w_adv), grads)
      inner = None
      if track_cosine:
        inner = _inner_with_grad(w_adv, params, g_adv, norm, rho_t, adaptive,
                                 eta, eps)
      stats = (grad_norm, tree_norm_f32(g_adv), inner)
      if batch_axis_name is not None:
        stats = jax.lax.pmean(stats, batch_axis_name)
      return mean_over_axis(g_adv), stats

    def plain_grads(_):
      zero = jnp.zeros((), jnp.float32)
      return mean_over_axis(grads), (zero, zero,
                                     zero if track_cosine else None)

    if static_zero_rho or sam_step is False:
      # The base optimizer's own computation, nothing else.
      step_grads, stats = plain_grads(None)
      active = jnp.array(False)
    elif sam_step:
      step_grads, stats = sam_grads(None)
      active = jnp.array(True)
    elif always_sam:
      # No step can be plain: straight-line code, which XLA schedules
      # with the memory of a hand-written SAM step (a cond's output
      # would hold one more gradient-sized buffer).
      step_grads, stats = sam_grads(None)
    else:
      step_grads, stats = jax.lax.cond(active, sam_grads, plain_grads, None)
    updates, base_state = base.update(step_grads, state.base_state, params,
                                      **extra_args)
    det = state.detector
    if det is not None:
      det = hallucination.update(det, detector, active, *stats)
    det, rho_scale, cooldown = respond(state, det, active)
    return updates, SAMState(
        count=state.count + 1, base_state=base_state,
        rho=jnp.where(active, rho_t, 0.0).astype(jnp.float32),
        rho_scale=rho_scale, cooldown=cooldown, sam_active=active,
        detector=det, cache=None)

  def two_call_update(grads, state: SAMState, params=None, *, grad_fn=None,
                      sam_step=None, **extra_args):
    del grad_fn  # Not used: the second call brings g+.
    if sam_step is not None:
      raise ValueError("geom.sam.sam: sam_step is for mode='opaque'")
    if params is None:
      raise ValueError('geom.sam.sam: update needs params (the weights w).')
    cache = state.cache
    second = cache.phase == 1  # grads is g+ at w + e; cache.params is w.
    rho_t = rho_at(state.count) * state.rho_scale
    ascend = ~second & sam_wanted(state, rho_t)
    # The base step runs outside any branch, so a plain step is the base
    # optimizer's own computation; on an ascent call its result is dropped.
    w = jax.tree.map(lambda c, p: jnp.where(second, c, p), cache.params,
                     params)
    base_updates, base_state = base.update(grads, state.base_state, w,
                                           **extra_args)
    w_adv, _ = ascent_point(grads, params, rho_t)
    updates = jax.tree.map(
        lambda u, wa, p, w0: jnp.where(
            ascend, wa - p, jnp.where(second, w0 - p + u, u)).astype(p.dtype),
        base_updates, w_adv, params, cache.params)
    det = state.detector
    if det is not None:
      det = hallucination.update(
          det, detector, second, tree_norm_f32(cache.grads),
          tree_norm_f32(grads),
          tree_vdot_f32(cache.grads, grads) if track_cosine else None)
    det, rho_scale, cooldown = respond(state, det, ascend | second)
    keep = lambda new, old: jax.tree.map(
        lambda a, b: jnp.where(ascend, b, a), new, old)
    new_cache = TwoCallCache(
        phase=ascend.astype(jnp.int32),
        params=jax.tree.map(lambda p, c: jnp.where(ascend, p, c), params,
                            cache.params),
        grads=jax.tree.map(lambda g, c: jnp.where(ascend, g.astype(c.dtype), c),
                           grads, cache.grads))
    return updates, SAMState(
        count=state.count + (~ascend).astype(jnp.int32),
        base_state=keep(base_state, state.base_state),
        rho=jnp.where(ascend | second, jnp.where(ascend, rho_t, state.rho),
                      0.0).astype(jnp.float32),
        rho_scale=rho_scale, cooldown=cooldown, sam_active=ascend | second,
        detector=det, cache=new_cache)

  update_fn = opaque_update if mode == 'opaque' else two_call_update
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_state(opt_state: Any) -> SAMState | None:
  """The (first) SAMState inside any optax state (chain, inject, MultiSteps)."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, SAMState))
           if isinstance(s, SAMState)]
  return found[0] if found else None


def diagnostics(opt_state: Any) -> dict[str, jax.Array]:
  """SAM's statistics from an optimizer state that contains a `sam` state.

  Returns:
    A dict of scalars: `sam_active` (the last step used SAM), `rho` (its
    rho), `grad_norm` |g|, `perturbed_grad_norm` |g+|, `grad_ratio`
    |g+|/|g| and `cosine` cos(g, g+) of the last SAM step, their moving
    averages `grad_norm_ema`, `grad_ratio_ema`, `cosine_ema`,
    `hallucination` (flagged now), `hallucination_steps` (steps flagged so
    far), `sam_steps` (SAM steps so far) and `cooldown` (plain steps left
    of a warm restart). The cosines only when the detector tracks them. Without a
    detector, only `sam_active`, `rho` and `cooldown`.

  Raises:
    ValueError: if `opt_state` contains no `sam` state.
  """
  state = find_state(opt_state)
  if state is None:
    raise ValueError('geom.sam.diagnostics: the optimizer state contains no '
                     'geom.sam.sam state')
  out = {'sam_active': state.sam_active, 'rho': state.rho,
         'cooldown': state.cooldown}
  det = state.detector
  if det is not None:
    ratio, _ = hallucination.step_statistics(
        det.grad_norm, det.perturbed_grad_norm, det.grad_norm)
    out.update(
        grad_norm=det.grad_norm, perturbed_grad_norm=det.perturbed_grad_norm,
        grad_ratio=ratio, grad_norm_ema=det.grad_norm_ema,
        grad_ratio_ema=det.ratio_ema, hallucination=det.flagged,
        hallucination_steps=det.flagged_steps, sam_steps=det.sam_steps)
    if det.cosine is not None:
      out.update(cosine=det.cosine, cosine_ema=det.cosine_ema)
  return out
