"""The method-hook contract: SAM's hooks agree with SAM itself, hooks compose,
and a method the trainer has never heard of plugs in through its hooks alone."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import digits
from geom import hallucination
from geom import method_hooks
from geom import sam
from geom import validation
from tests import transformation_battery as battery
from train.training import aot
from train.training import input_pipeline
from train.training import loop
from train.training import optim
from train.errors import ConfigError
from train.vision import datasets
from train.vision import experiment
from train.vision import trainer


def _device_choices(options, steps):
  """sam_active of each step, as the transformation decides on the device."""
  params, loss, batch = battery.problem()
  grad = jax.grad(lambda p: loss(p, batch))
  tx = sam.from_options(optax.sgd(0.05), options)
  step = jax.jit(lambda p, s: tx.update(grad(p), s, p, grad_fn=grad))
  state, active, states = tx.init(params), [], []
  for _ in range(steps):
    states.append(state)
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
    active.append(bool(state.sam_active))
  return active, states


@pytest.mark.parametrize('options', [
    sam.SAMOptions(rho=0.05, warmup_steps=3),
    sam.SAMOptions(rho=0.05, window=(2, 5)),
    sam.SAMOptions(rho=0.05, warmup_steps=1, window=(4, None)),
    sam.SAMOptions(rho=optax.linear_schedule(0.1, 0.0, 4)),
    # A stall that trips at once: warm restarts of 2 plain steps.
    sam.SAMOptions(rho=0.05, response='warm_restart', restart_steps=2,
                   detector=hallucination.DetectorConfig(
                       patience=1, ratio_threshold=10.0)),
], ids=['warmup', 'window', 'warmup_and_open_window', 'schedule_to_zero',
        'warm_restart'])
def test_host_choice_agrees_with_the_device_at_every_step(options):
  hooks = sam.hooks(options)
  active, states = _device_choices(options, 9)
  assert True in active and False in active
  host = [hooks.variants.choose(i, s) for i, s in enumerate(states)]
  assert host == active
  # It reads the state only where it has to (a transfer each step).
  assert hooks.variants.reads_state == (options.response == 'warm_restart')


def test_hooks_without_plain_steps_have_no_variants():
  assert sam.hooks(sam.SAMOptions(rho=0.05)).variants is None
  assert sam.hooks(sam.SAMOptions(rho=0.0)).variants is None  # All plain.
  two_call = sam.hooks(sam.SAMOptions(rho=0.05, warmup_steps=3,
                                      mode='two_call'))
  assert two_call.variants is None and two_call.update_arguments == ()
  m = sam.hooks(sam.SAMOptions(batch_axis_name='data'))
  assert m.per_device_axis == 'data' and m.update_arguments == ('grad_fn',)


def test_is_sam_step_on_the_host_is_plain_python():
  options = sam.SAMOptions(rho=0.05, warmup_steps=2, window=(0, 5))
  got = [sam.is_sam_step(options, i) for i in range(7)]
  assert got == [False, False, True, True, True, False, False]
  assert all(type(x) is bool for x in got)  # No device work per step.
  assert sam.is_sam_step(options, 3, cooldown=1) is False
  traced = jax.jit(lambda c: sam.is_sam_step(options, c))
  assert [bool(traced(i)) for i in range(7)] == got


def _diag(name):
  return lambda state: {name: jnp.zeros(())}


def test_combine_merges_arguments_and_diagnostics_and_refuses_conflicts():
  variants = method_hooks.StepVariants('kind', (0, 1), lambda s, _: s % 2)
  a = method_hooks.MethodHooks(name='a', update_arguments=('grad_fn',),
                               diagnostics=_diag('x'), console=('x',),
                               variants=variants)
  b = method_hooks.MethodHooks(name='b', diagnostics=_diag('y'),
                               per_device_axis='data',
                               check_per_device_types=False)
  both = method_hooks.combine(a, method_hooks.MethodHooks(), b)
  assert both.name == 'a+b' and both.update_arguments == ('grad_fn',)
  assert set(both.diagnostics(None)) == {'x', 'y'}
  assert both.variants is variants and both.per_device_axis == 'data'
  assert not both.check_per_device_types
  assert method_hooks.combine() == method_hooks.MethodHooks()
  assert method_hooks.combine(a) is a
  with pytest.raises(validation.ArgumentError, match='only one method'):
    method_hooks.combine(a, method_hooks.MethodHooks(name='c',
                                                     variants=variants))
  with pytest.raises(validation.ArgumentError, match='per-device axes'):
    method_hooks.combine(b, method_hooks.MethodHooks(name='d',
                                                     per_device_axis='x'))
  clash = method_hooks.combine(a, method_hooks.MethodHooks(
      name='e', diagnostics=_diag('x')))
  with pytest.raises(validation.ArgumentError, match="diagnostic 'x'"):
    clash.diagnostics(None)
  with pytest.raises(validation.ArgumentError, match='at least two'):
    method_hooks.StepVariants('kind', (0,), lambda s, _: 0)


# A method the trainer has never heard of: on odd steps it keeps the
# weights (a variant the host picks by parity), it needs the loss gradient
# at other weights (and checks it is the gradient at `params`), and it
# reports how often it was called.
def _parity_method(base, cfg):
  del cfg
  base = optax.with_extra_args_support(base)

  def init(params):
    return {'base': base.init(params), 'calls': jnp.zeros((), jnp.int32),
            'grad_error': jnp.zeros((), jnp.float32),
            'grad_norm': jnp.zeros((), jnp.float32)}

  def update(grads, state, params, *, grad_fn, parity):
    updates, base_state = base.update(grads, state['base'], params)
    error = optax.tree.norm(jax.tree.map(jnp.subtract, grad_fn(params),
                                         grads))
    if parity == 'odd':
      updates = jax.tree.map(jnp.zeros_like, updates)
    return updates, {'base': base_state, 'calls': state['calls'] + 1,
                     'grad_error': error, 'grad_norm': optax.tree.norm(grads)}

  hooks = method_hooks.MethodHooks(
      name='parity', update_arguments=('grad_fn',),
      variants=method_hooks.StepVariants(
          'parity', ('even', 'odd'),
          lambda step, _: 'odd' if step % 2 else 'even'),
      diagnostics=lambda s: {'calls': s['calls'],
                             'grad_error': s['grad_error'],
                             'grad_norm': s['grad_norm']},
      console=('calls',))
  return optax.GradientTransformationExtraArgs(init, update), hooks, None


def test_a_new_method_plugs_in_through_its_hooks_alone(tmp_path, monkeypatch):
  monkeypatch.setitem(optim.METHODS, 'parity', _parity_method)
  # runlocal's MLP: the trainer's path is the CNN's, at half the compiles.
  config = digits.get_config('runlocal,model=mlp')
  config.optimizer.warmup_steps = 0
  config.optimizer.parity = {'enabled': True}
  config.num_steps, config.log_every = 6, 1
  config.eval_every = config.checkpoint_every = 6
  exp = experiment.build(config, str(tmp_path))
  assert exp.hooks.name == 'parity'
  train_data = datasets.load_split('digits', 'train', None)
  compiled = aot.compile_steps(exp, train_data)
  assert set(compiled.variants) == {'even', 'odd'}
  batches = input_pipeline.TrainBatches(train_data, config.batch_size, 0)
  state = exp.init_state()
  for step in range(4):
    before = jax.device_get(state.params)
    host = next(batches.iterate(step, step + 1,
                                indices_only=compiled.data_on_device))
    state, metrics = compiled.train(
        state, input_pipeline.to_global(host, exp.batch_sharding), step)
    after = jax.device_get(state.params)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(after), jax.tree.leaves(before)))
    assert (moved == 0) == (step % 2 == 1), (step, moved)
    assert int(metrics['opt/calls']) == step + 1
    # grad_fn is the loss gradient: at the same weights it gives g back, to
    # float32 rounding (the step's gradient and grad_fn's are separate
    # computations that XLA may fuse and reassociate differently: 3.7e-4
    # at |g| of 2-6 on one AVX-512 host, 0 on others). Another batch or
    # other weights give an error of the order of |g|.
    assert (float(metrics['opt/grad_error'])
            < 1e-3 * float(metrics['opt/grad_norm']))

  # And the whole run: the loop logs its diagnostics, nothing else changes.
  final = loop.train_and_evaluate(
      experiment.build(config, str(tmp_path / 'run')),
      lambda: trainer.load_data(config))
  assert final['step'] == 6
  with open(os.path.join(tmp_path, 'run', 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  assert [r['opt/calls'] for r in records if 'opt/calls' in r] == [
      1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_a_method_needing_an_argument_the_step_lacks_is_a_config_error(
    digits_config, tmp_path, monkeypatch):
  monkeypatch.setitem(method_hooks.UPDATE_ARGUMENTS, 'entropies',
                      'per-example prediction entropies')

  def needs_entropies(base, cfg):
    del cfg
    return base, method_hooks.MethodHooks(
        name='entropic', update_arguments=('entropies',)), None

  monkeypatch.setitem(optim.METHODS, 'entropic', needs_entropies)
  digits_config.optimizer.entropic = {'enabled': True}
  with pytest.raises(ConfigError, match=r"'entropies', which this train "
                     r'step does not give \(it gives: grad_fn\)'):
    experiment.build(digits_config, str(tmp_path))
  assert not os.listdir(tmp_path)
