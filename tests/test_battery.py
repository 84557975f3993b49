"""Every geom transformation through the shared battery (tests/transformation_battery.py)."""

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from tests import transformation_battery as battery

CASES = {c.name: c for c in battery.CASES}
NAMES = sorted(CASES)


def _names(*default):
  """Every case, those not in `default` marked slow (`make test-all` runs
  them). Used for the checks of a wrapper (optax.chain, MultiSteps,
  inject_hyperparams, a sharded state) whose code does not depend on the
  case's options: by default each such check runs on the cases that reach
  it by another path (SAM's perturbation as plain, adaptive, fused, two-call
  or a pluggable ascent; LookSAM's per-parameter g_v; CONGA alone and as
  SAM's base, with its extra update argument). Every case still runs every
  check that reads its options by default: optimisation, jit, dtypes and
  the checkpoint. docs/slow_tests.md lists each slow one with its cover."""
  unknown = set(default) - set(NAMES)
  assert not unknown, unknown
  return [name if name in default else pytest.param(name,
                                                     marks=pytest.mark.slow)
          for name in NAMES]


# tx, loss, needs_grad_fn and extra_arguments are static.
STATIC = (0, 3, 5, 6)


@functools.cache
def _tx(name):
  """One transformation object per case for the whole module: it is a
  static argument of the jitted step, so the tests that step the same
  problem share one compilation."""
  return CASES[name].make()


def _run(tx, params, loss, batch, steps, case, jit=True, state=None):
  state = tx.init(params) if state is None else state
  fn = battery.step
  if jit:
    fn = jax.jit(battery.step, static_argnums=STATIC)
  for _ in range(steps):
    params, state = fn(tx, params, state, loss, batch, case.needs_grad_fn,
                       case.extra_arguments)
  return params, state


def _close(a, b, **kw):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), **kw), a, b)


@pytest.mark.parametrize('name', NAMES)
def test_optimises_the_toy_problem(name):
  case = CASES[name]
  params, loss, batch = battery.problem()
  final, _ = _run(_tx(name), params, loss, batch, 60, case)
  assert loss(final, batch) < 0.7 * loss(params, batch)


@pytest.mark.parametrize('name', NAMES)
def test_jit_gives_the_same_result(name):
  case = CASES[name]
  params, loss, batch = battery.problem()
  eager, _ = _run(_tx(name), params, loss, batch, 4, case, jit=False)
  jitted, _ = _run(_tx(name), params, loss, batch, 4, case)
  _close(eager, jitted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('name', NAMES)
def test_dtypes_are_preserved(name, dtype):
  case = CASES[name]
  params, loss, batch = battery.problem(dtype)
  tx = _tx(name)
  state = tx.init(params)
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  new_params, new_state = jax.jit(battery.step, static_argnums=STATIC)(
      tx, params, state, loss, batch, case.needs_grad_fn,
      case.extra_arguments)
  assert jax.tree.map(lambda x: x.dtype, new_params) == jax.tree.map(
      lambda x: x.dtype, params)
  assert jax.tree.map(lambda x: x.dtype, new_state) == dtypes
  assert all(jnp.isfinite(x.astype(jnp.float32)).all()
             for x in jax.tree.leaves(new_params))


@pytest.mark.parametrize('name', _names(
    'sam', 'asam', 'sam_fused', 'sam_every_3', 'sam_two_call',
    'sam_ascent_adam_kept', 'conga_adam', 'sam_conga_base'))
def test_state_stays_sharded_on_the_mesh(name):
  case = CASES[name]
  params, loss, batch = battery.problem()
  mesh = jax.make_mesh((8,), ('model',),
                       axis_types=(jax.sharding.AxisType.Auto,))
  # Split the hidden dimension over 8 devices.
  param_shardings = {'w1': NamedSharding(mesh, P(None, 'model')),
                     'b1': NamedSharding(mesh, P('model')),
                     'w2': NamedSharding(mesh, P('model', None))}
  repl = NamedSharding(mesh, P())
  tx = _tx(name)
  state_shardings = optax.tree_map_params(
      tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
      transform_non_params=lambda _: repl)
  params = jax.device_put(params, param_shardings)
  state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  step = jax.jit(battery.step, static_argnums=STATIC,
                 out_shardings=(param_shardings, state_shardings))
  new_params, new_state = step(tx, params, state, loss, batch,
                               case.needs_grad_fn, case.extra_arguments)
  specs = lambda t: jax.tree.map(lambda x: x.sharding.spec, t)
  assert specs(new_state) == specs(state)
  assert specs(new_params) == specs(params)
  sharded = [x for x in jax.tree.leaves(new_state)
             if not x.sharding.is_fully_replicated]
  assert sharded, 'no per-parameter state was sharded'


@pytest.mark.parametrize('name', _names(
    'sam', 'sam_fused', 'sam_every_3', 'sam_two_call', 'conga_adam',
    'sam_conga_base'))
def test_gradient_accumulation_over_identical_microbatches(name):
  # Accumulating k equal micro-batches must equal one step on the batch.
  case = CASES[name]
  if not case.accumulates:
    pytest.skip(f'{name}: one update spans several calls')
  params, loss, batch = battery.problem()
  single, _ = _run(_tx(name), params, loss, batch, 3, case)
  accumulated, _ = _run(optax.MultiSteps(_tx(name), every_k_schedule=2),
                        params, loss, batch, 6, case)
  _close(single, accumulated, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', _names(
    'sam', 'sam_two_call', 'conga_adam', 'sam_conga_base'))
def test_inside_chain(name):
  case = CASES[name]
  params, loss, batch = battery.problem()
  plain, _ = _run(_tx(name), params, loss, batch, 3, case)
  chained, _ = _run(optax.chain(_tx(name), optax.scale(1.0)), params, loss,
                    batch, 3, case)
  _close(plain, chained, rtol=1e-6, atol=1e-7)


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float32) -
                                 np.asarray(y, np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize('name', _names(
    'sam', 'asam', 'sam_fused', 'sam_two_call', 'sam_ascent_adam',
    'conga_adam'))
def test_a_hyperparameter_changed_under_inject_hyperparams_takes_effect(name):
  # After the change, the injected transformation must step as the one
  # built with the new value does from the same inner state, and not as
  # the old one: a value read once and kept (at init, or from the last
  # step) would pass a check that never changes it.
  case = CASES[name]
  assert case.changed, f'{name}: name a hyperparameter to change'
  field, value = case.changed
  assert value != case.kwargs[field]
  params, loss, batch = battery.problem()
  steps = lambda tx, p, state: _run(tx, p, loss, batch, 2, case, state=state)
  injected_tx = optax.inject_hyperparams(case.factory)(**case.kwargs)
  plain_tx = _tx(name)  # One object: one compilation for both runs.
  mid, state = steps(injected_tx, params, None)
  plain, _ = steps(plain_tx, params, None)
  _close(mid, plain, rtol=1e-5, atol=1e-6)  # The same until the change.
  old = state.hyperparams[field]
  state = state._replace(hyperparams={
      **state.hyperparams, field: jnp.asarray(value, old.dtype)})
  got, _ = steps(injected_tx, mid, state)
  want, _ = steps(case.factory(**{**case.kwargs, field: value}), mid,
                  state.inner_state)
  _close(got, want, rtol=1e-5, atol=1e-6)
  unchanged, _ = steps(plain_tx, mid, state.inner_state)
  assert _max_diff(got, unchanged) > 1e-4


@pytest.fixture(scope='module')
def checkpointed(tmp_path_factory):
  """{name: (params, state) after 3 steps, (the same restored)}: every
  case's parameters and state through one Orbax save and restore, instead
  of one per case. Restored on the host: Orbax's arrays come back
  committed to a device, which alone would compile each case's step again
  (1.6 s of CPU a case); the values are what the test compares."""
  mid = {}
  for name in NAMES:
    params, loss, batch = battery.problem()
    mid[name] = _run(_tx(name), params, loss, batch, 3, CASES[name])
  tree = {name: {'params': p, 'state': s} for name, (p, s) in mid.items()}
  path = tmp_path_factory.mktemp('battery') / 'ckpt'
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(
        path, jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
  restored = jax.device_get(restored)
  return {name: (mid[name], (restored[name]['params'],
                             restored[name]['state'])) for name in NAMES}


@pytest.mark.parametrize('name', NAMES)
def test_state_survives_a_checkpoint(name, checkpointed):
  case = CASES[name]
  _, loss, batch = battery.problem()
  tx = _tx(name)
  (mid_params, mid_state), (got_p, got_s) = checkpointed[name]
  assert jax.tree.structure(got_s) == jax.tree.structure(mid_state)
  ref_p, ref_s = mid_params, mid_state
  step = jax.jit(battery.step, static_argnums=STATIC)
  for _ in range(2):
    ref_p, ref_s = step(tx, ref_p, ref_s, loss, batch, case.needs_grad_fn,
                        case.extra_arguments)
    got_p, got_s = step(tx, got_p, got_s, loss, batch, case.needs_grad_fn,
                        case.extra_arguments)
  jax.tree.map(np.testing.assert_array_equal, got_p, ref_p)
