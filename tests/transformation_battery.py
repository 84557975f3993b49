"""A shared battery for every geom transformation (after optax's `_common_test.py`).

Each entry of `CASES` builds one configured transformation; `test_battery.py`
runs every entry through the same checks: it optimises a toy problem, runs
under jit with the same result, keeps parameter dtypes (float32 and
bfloat16) and state dtypes, keeps its state sharded on a mesh, works under
`optax.inject_hyperparams`, `optax.MultiSteps` (gradient accumulation) and
`optax.chain`, and its state survives an Orbax checkpoint. A new method
joins by adding a `Case`, naming a numeric hyperparameter and a new value
for it (`changed`) that the inject_hyperparams check sets mid-run.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from geom import hallucination
from geom import sam


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  make: Callable[[], optax.GradientTransformation]
  # Whether update needs grad_fn (the loss gradient at other weights).
  needs_grad_fn: bool = True
  # The factory and its keyword arguments, for inject_hyperparams.
  factory: Callable[..., optax.GradientTransformation] | None = None
  kwargs: dict | None = None
  # Whether k accumulated equal micro-batches equal one step (not for
  # transformations whose update spans several calls).
  accumulates: bool = True
  # (keyword of `factory`, new value): changed in the state of
  # `optax.inject_hyperparams(factory)` mid-run; the value must change
  # the update.
  changed: tuple[str, float] | None = None


def _sam_case(name, **kw):
  kwargs = dict(base_optimizer=optax.sgd(0.05, momentum=0.9), rho=0.05, **kw)
  return Case(name, lambda: sam.sam(**kwargs), factory=sam.sam, kwargs=kwargs,
              changed=('rho', 0.2))


CASES = [
    _sam_case('sam'),
    _sam_case('asam', adaptive=True, eta=0.01),
    _sam_case('sam_warmup', warmup_steps=2),
    _sam_case('sam_window', window=(1, 4)),
    _sam_case('sam_no_detector', detector=None),
    _sam_case('sam_fused', fused=True),
    _sam_case('sam_warm_restart', response='warm_restart',
              detector=hallucination.DetectorConfig(patience=1),
              restart_steps=2),
    Case('sam_two_call',
         lambda: sam.sam(optax.sgd(0.05, momentum=0.9), rho=0.05,
                         mode='two_call'),
         needs_grad_fn=False, factory=sam.sam,
         kwargs=dict(base_optimizer=optax.sgd(0.05, momentum=0.9), rho=0.05,
                     mode='two_call'),
         accumulates=False, changed=('rho', 0.2)),
    # A pluggable ascent (optax's adv_optimizer), its state reset each step
    # or kept (Adam moments carried from one SAM step to the next).
    _sam_case('sam_ascent_adam', ascent=optax.chain(
        optax.contrib.normalize(), optax.adam(0.05))),
    _sam_case('sam_ascent_adam_kept', ascent=optax.chain(
        optax.contrib.normalize(), optax.adam(0.05)), reset_ascent=False),
    # An AdamW base, as the SAM mid-training phase uses.
    Case('sam_adamw_base',
         lambda: sam.sam(optax.adamw(1e-2, weight_decay=1e-4), rho=0.05),
         factory=sam.sam,
         kwargs=dict(base_optimizer=optax.adamw(1e-2, weight_decay=1e-4),
                     rho=0.05),
         changed=('rho', 0.2)),
]


def problem(dtype=jnp.float32):
  """A small regression MLP: (params, loss(params, batch), batch)."""
  k = jax.random.split(jax.random.key(42), 5)
  params = {
      'w1': jax.random.normal(k[0], (8, 16)) * 0.5,
      'b1': jnp.zeros((16,)),
      'w2': jax.random.normal(k[1], (16, 4)) * 0.5,
  }
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  batch = {'x': jax.random.normal(k[2], (64, 8)).astype(dtype),
           'y': jax.random.normal(k[3], (64, 4)).astype(dtype)}

  def loss(p, b):
    h = jnp.tanh(b['x'] @ p['w1'] + p['b1'])
    return jnp.mean(jnp.square(h @ p['w2'] - b['y']).astype(jnp.float32))

  return params, loss, batch


def step(tx, params, state, loss, batch, needs_grad_fn=True):
  """One update of `tx` on `batch`; returns (new params, new state)."""
  grad_fn = lambda p: jax.grad(loss)(p, batch)
  extra = {'grad_fn': grad_fn} if needs_grad_fn else {}
  updates, state = tx.update(grad_fn(params), state, params, **extra)
  return optax.apply_updates(params, updates), state
