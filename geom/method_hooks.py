"""The contract between a geom method and the loop that runs it: `MethodHooks`.

A training loop calls `tx.update(grads, state, params, **extra)`. A plain
optax transformation needs nothing more; a geom method may need things only
the loop can give or use, and says so in one object instead of the loop
knowing the method:

- `update_arguments`: extra keyword arguments its `update` reads, by the
  names in `UPDATE_ARGUMENTS` (SAM: `grad_fn`, the loss gradient at other
  weights on the same batch). A loop passes exactly these, and refuses a
  method that asks for one it cannot produce.
- `variants`: steps of different kinds that are cheaper compiled apart,
  and the host-side rule that picks the kind of each step (SAM's plain
  warm-up steps skip the second gradient; a `lax.cond` between the two
  kinds would cost more than two programs on some backends).
- `diagnostics`: `opt_state -> {name: scalar}` to log each step, and
  `console`, the names worth a place on the progress line.
- `per_device_axis`: the update runs once per device inside
  `jax.shard_map` over this mesh axis, with that device's gradient
  (m-sharpness); `check_per_device_types` False when its code cannot pass
  shard_map's check of device-varying types (Pallas's interpreter).

A method module exports `hooks(...) -> MethodHooks` beside its factory;
`MethodHooks()` describes a plain transformation; `combine` merges the
hooks of methods composed in one optax chain.

Example:

  >>> import optax
  >>> from geom import method_hooks, sam
  >>> options = sam.SAMOptions(rho=0.05, warmup_steps=10)
  >>> tx = sam.from_options(optax.sgd(0.1), options)
  >>> h = sam.hooks(options)
  >>> h.update_arguments, h.variants.values, h.variants.choose(3, None)
  (('grad_fn',), (True, False), False)
"""

from collections.abc import Callable, Hashable, Mapping
import dataclasses
from typing import Any

import jax
import optax

from geom import validation

__all__ = ['UPDATE_ARGUMENTS', 'MethodHooks', 'StepVariants', 'combine',
           'find_state']

#: The extra `update` arguments a loop may be asked for, and their meaning.
UPDATE_ARGUMENTS: Mapping[str, str] = {
    'grad_fn': '`grad_fn(params) -> grads`: the gradient of the same loss on '
               'the same batch, at other weights',
    'entropies': 'per-sample prediction entropies (nats, float32) of the '
                 'batch the gradient comes from, shape (batch,)',
}

Diagnostics = Callable[[optax.OptState], Mapping[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class StepVariants:
  """Kinds of steps compiled apart, and how the host picks one per step.

  Attributes:
    argument: the keyword of `update` that fixes the kind at trace time
      (SAM: 'sam_step').
    values: the kinds; a loop compiles one program per value.
    choose: `(step, opt_state) -> value` on the host, before the step runs;
      `step` is the number of completed updates. It must agree with what
      `update` decides by itself when the keyword is not given.
    reads_state: whether `choose` reads `opt_state` (a transfer from the
      devices each step); False means `opt_state` may be None.

  Example:

    >>> from geom import method_hooks
    >>> v = method_hooks.StepVariants(
    ...     argument='sam_step', values=(False, True),
    ...     choose=lambda step, opt_state: step >= 10)
    >>> v.choose(3, None), v.choose(12, None)
    (False, True)
  """
  argument: str
  values: tuple[Hashable, ...]
  choose: Callable[[int, optax.OptState], Hashable]
  reads_state: bool = False

  def __post_init__(self):
    if len(self.values) < 2:
      raise validation.ArgumentError(
          'geom.method_hooks.StepVariants', 'values',
          'needs at least two kinds of step', value=self.values)


@dataclasses.dataclass(frozen=True)
class MethodHooks:
  """What a method needs from the loop that runs it (see the module docstring).

  Attributes:
    name: the method, for messages ('none' for a plain transformation).
    update_arguments: extra keyword arguments of `update`, from
      `UPDATE_ARGUMENTS`.
    variants: steps compiled apart, or None for one kind.
    diagnostics: `opt_state -> {name: scalar}`, or None.
    console: the diagnostics shown on the progress line.
    per_device_axis: mesh axis over which `update` runs per device inside
      `jax.shard_map`, or None.
    check_per_device_types: shard_map's `check_vma` for that per-device
      update.

  Example:

    >>> from geom import method_hooks, sam
    >>> h = sam.hooks(sam.SAMOptions(rho=0.05, warmup_steps=10))
    >>> h.name, h.update_arguments, h.variants.argument
    ('sam', ('grad_fn',), 'sam_step')
    >>> method_hooks.MethodHooks().update_arguments  # A plain transformation.
    ()
  """
  name: str = 'none'
  update_arguments: tuple[str, ...] = ()
  variants: StepVariants | None = None
  diagnostics: Diagnostics | None = None
  console: tuple[str, ...] = ()
  per_device_axis: str | None = None
  check_per_device_types: bool = True

  def __post_init__(self):
    for argument in self.update_arguments:
      validation.check_choice('geom.method_hooks.MethodHooks',
                              'update_arguments', argument, UPDATE_ARGUMENTS)


def _merge_diagnostics(parts: list[Diagnostics]) -> Diagnostics | None:
  if not parts:
    return None
  if len(parts) == 1:
    return parts[0]

  def merged(opt_state: optax.OptState) -> dict[str, jax.Array]:
    out = {}
    for part in parts:
      values = part(opt_state)
      clash = sorted(set(out) & set(values))
      if clash:
        raise validation.ArgumentError(
            'geom.method_hooks.combine', 'hooks',
            f'two methods report the diagnostic {clash[0]!r}')
      out.update(values)
    return out

  return merged


def combine(*hooks: MethodHooks) -> MethodHooks:
  """The hooks of methods composed in one chain.

  Arguments are the union; at most one method may have step variants and
  at most one per-device axis (two would need a product of programs, or
  nested shard_maps, which no loop here runs).

  Raises:
    ArgumentError: two methods have variants, or different per-device axes.

  Example:

    >>> from geom import conga, method_hooks, sam
    >>> h = method_hooks.combine(sam.hooks(sam.SAMOptions(rho=0.05)),
    ...                          conga.hooks())
    >>> h.name, h.update_arguments
    ('sam+conga', ('grad_fn', 'entropies'))
  """
  owner = 'geom.method_hooks.combine'
  active = [h for h in hooks if h != MethodHooks()]
  if not active:
    return MethodHooks()
  if len(active) == 1:
    return active[0]
  with_variants = [h.name for h in active if h.variants is not None]
  if len(with_variants) > 1:
    raise validation.ArgumentError(
        owner, 'hooks', f'{" and ".join(with_variants)} both choose their '
        'kind of step on the host; only one method may')
  axes = {h.per_device_axis for h in active} - {None}
  if len(axes) > 1:
    raise validation.ArgumentError(
        owner, 'hooks', f'different per-device axes {sorted(axes)}')
  return MethodHooks(
      name='+'.join(h.name for h in active),
      update_arguments=tuple(dict.fromkeys(
          a for h in active for a in h.update_arguments)),
      variants=next((h.variants for h in active if h.variants), None),
      diagnostics=_merge_diagnostics(
          [h.diagnostics for h in active if h.diagnostics is not None]),
      console=tuple(dict.fromkeys(c for h in active for c in h.console)),
      per_device_axis=next(iter(axes), None),
      check_per_device_types=all(h.check_per_device_types for h in active))


def find_state(opt_state: optax.OptState, state_type: type[Any]) -> Any:
  """The (first) `state_type` instance inside any optax state (chain,
  inject_hyperparams, MultiSteps, a method wrapping another), or None.

  Example:

    >>> import jax.numpy as jnp, optax
    >>> from geom import method_hooks, sam
    >>> tx = optax.chain(optax.clip(1.0), sam.sam(optax.sgd(0.1), rho=0.05))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> type(method_hooks.find_state(state, sam.SAMState)).__name__
    'SAMState'
    >>> method_hooks.find_state(optax.sgd(0.1).init(0.0), sam.SAMState) is None
    True
  """
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, state_type))
           if isinstance(s, state_type)]
  return found[0] if found else None
