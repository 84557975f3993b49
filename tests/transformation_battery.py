"""A shared battery for every geom transformation (after optax's `_common_test.py`).

Each entry of `CASES` builds one configured transformation; `test_battery.py`
runs every entry through the same checks: it optimises a toy problem, runs
under jit with the same result, keeps parameter dtypes (float32 and
bfloat16) and state dtypes, keeps its state sharded on a mesh, works under
`optax.inject_hyperparams`, `optax.MultiSteps` (gradient accumulation) and
`optax.chain`, and its state survives an Orbax checkpoint. A new method
joins by adding a `Case`, naming a numeric hyperparameter and a new value
for it (`changed`) that the inject_hyperparams check sets mid-run, and the
extra `update` arguments it needs: `grad_fn` (`needs_grad_fn`) and those of
`EXTRA_ARGUMENTS` (`extra_arguments`), which `step` computes from the toy
problem.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from geom import conga
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
  # Extra update arguments besides grad_fn, from `EXTRA_ARGUMENTS`.
  extra_arguments: tuple[str, ...] = ()


NUM_OUTPUTS = 4
# The toy model's outputs times this are the logits whose entropies CONGA
# reads: about half of the samples are confident (H < 0.4 ln 4) at first.
LOGIT_SCALE = 2.0


def _sam_case(name, **kw):
  kwargs = dict(base_optimizer=optax.sgd(0.05, momentum=0.9), rho=0.05, **kw)
  return Case(name, lambda: sam.sam(**kwargs), factory=sam.sam, kwargs=kwargs,
              changed=('rho', 0.2))


# Factories with explicit arguments: inject_hyperparams injects each one.
def _adam_conga(learning_rate, num_classes, max_update_rms=1e-2,
                total_steps=None):
  return optax.chain(optax.scale_by_adam(), conga.conga(
      learning_rate, num_classes=num_classes, max_update_rms=max_update_rms,
      total_steps=total_steps))


def _momentum_conga(learning_rate, num_classes, max_update_rms=1e-2,
                    total_steps=None):
  return optax.chain(optax.trace(0.9), conga.conga(
      learning_rate, num_classes=num_classes, max_update_rms=max_update_rms,
      total_steps=total_steps))


def _conga_case(name, factory, **kwargs):
  return Case(name, lambda: factory(**kwargs), needs_grad_fn=False,
              factory=factory, kwargs=kwargs,
              changed=('learning_rate', 3 * kwargs['learning_rate']),
              extra_arguments=('entropies',))


CASES = [
    _sam_case('sam'),
    _sam_case('asam', adaptive=True, eta=0.01),
    _sam_case('sam_warmup', warmup_steps=2),
    _sam_case('sam_window', window=(1, 4)),
    _sam_case('sam_no_detector', detector=None),
    _sam_case('sam_fused', fused=True),
    # LookSAM's reuse: g+ on steps 0, 3, ...; g_v reused in between.
    _sam_case('sam_every_3', every=3, alpha=0.7),
    # AE-SAM's switch: g+ only where |g|^2 >= its running mean.
    _sam_case('sam_ae', ae_margin=0.0),
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
    # CONGA as the learning rate of Adam (progress from the entropies) and
    # of SGD with momentum (progress t / T, the step cap binding at first),
    # and as the base optimizer's rate under SAM (SAR with CONGA).
    _conga_case('conga_adam', _adam_conga, learning_rate=0.01,
                num_classes=NUM_OUTPUTS, max_update_rms=0.1),
    _conga_case('conga_momentum', _momentum_conga, learning_rate=0.02,
                num_classes=NUM_OUTPUTS, total_steps=60),
    Case('sam_conga_base',
         lambda: sam.sam(_adam_conga(0.01, NUM_OUTPUTS, max_update_rms=0.1),
                         rho=0.05),
         factory=sam.sam,
         kwargs=dict(base_optimizer=_adam_conga(0.01, NUM_OUTPUTS,
                                                max_update_rms=0.1),
                     rho=0.05),
         changed=('rho', 0.2), extra_arguments=('entropies',)),
]


def forward(params, x):
  """The toy MLP: (batch, 8) -> (batch, NUM_OUTPUTS)."""
  return jnp.tanh(x @ params['w1'] + params['b1']) @ params['w2']


def entropies(params, batch):
  """Entropies (nats, float32) of softmax(LOGIT_SCALE * outputs): (batch,)."""
  logits = LOGIT_SCALE * forward(params, batch['x']).astype(jnp.float32)
  return -jnp.sum(jax.nn.softmax(logits) * jax.nn.log_softmax(logits), -1)


# name -> (params, batch) -> the extra update argument of that name.
EXTRA_ARGUMENTS = {'entropies': entropies}


def problem(dtype=jnp.float32):
  """A small regression MLP: (params, loss(params, batch), batch).

  One `loss` per dtype for the whole session: it is a static argument of
  the jitted steps, so tests stepping the same transformation share their
  compilations. The dicts are fresh copies.
  """
  params, loss, batch = _problem(jnp.dtype(dtype))
  return dict(params), loss, dict(batch)


@functools.cache
def _problem(dtype):
  k = jax.random.split(jax.random.key(42), 5)
  params = {
      'w1': jax.random.normal(k[0], (8, 16)) * 0.5,
      'b1': jnp.zeros((16,)),
      'w2': jax.random.normal(k[1], (16, NUM_OUTPUTS)) * 0.5,
  }
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  batch = {'x': jax.random.normal(k[2], (64, 8)).astype(dtype),
           'y': jax.random.normal(k[3], (64, NUM_OUTPUTS)).astype(dtype)}

  def loss(p, b):
    return jnp.mean(jnp.square(forward(p, b['x']) - b['y']).astype(
        jnp.float32))

  return params, loss, batch


def step(tx, params, state, loss, batch, needs_grad_fn=True,
         extra_arguments=()):
  """One update of `tx` on `batch`; returns (new params, new state).

  `extra_arguments` names the update arguments of `EXTRA_ARGUMENTS` to
  pass besides `grad_fn`, computed at `params` on `batch`.
  """
  grad_fn = lambda p: jax.grad(loss)(p, batch)
  extra = {'grad_fn': grad_fn} if needs_grad_fn else {}
  extra.update({name: EXTRA_ARGUMENTS[name](params, batch)
                for name in extra_arguments})
  updates, state = tx.update(grad_fn(params), state, params, **extra)
  return optax.apply_updates(params, updates), state
