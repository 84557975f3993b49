"""SAM in the trainer: config, diagnostics in the logs, BatchNorm, m-sharpness, resume."""

import dataclasses
import json
import os
import signal
import threading
import time

import jax
import numpy as np
import optax
import pytest

from configs import digits
from configs import sam_block
from geom import hallucination
from geom import sam as sam_lib
from train.training import aot
from train.run import checkpointing
from train.training import input_pipeline
from train.training import optim
from train.training import sharding as sharding_lib
from train.training import steps
from train.errors import ConfigError, Preempted
from train.vision import datasets
from train.vision import experiment
from train.vision import trainer


def _sam_config(digits_config, **sam):
  config = digits_config
  config.optimizer.sam.enabled = True
  for key, value in sam.items():
    config.optimizer.sam[key] = value
  return config


def test_config_block_defaults_are_the_detectors():
  block = sam_block.sam_block().detector
  for field in dataclasses.fields(hallucination.DetectorConfig):
    assert block[field.name] == getattr(hallucination.DetectorConfig(),
                                        field.name)


def test_sam_run_logs_its_diagnostics_and_warm_start(tmp_path):
  # runlocal's MLP (Dense-BN-ReLU): the logs do not depend on the model,
  # and its run costs half the CNN's CPU (test accuracy 0.955 against
  # 0.978). The CNN's SAM steps are the one-step tests' below.
  config = _sam_config(digits.get_config('runlocal,model=mlp'), rho=0.1,
                       warmup_steps=25)
  config.optimizer.sam.detector.track_cosine = True
  final = trainer.train_and_evaluate(config, str(tmp_path))
  assert final['test_accuracy'] > 0.85
  records = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  train = [r for r in records if 'train_loss' in r]
  for key in ('opt/grad_norm', 'opt/perturbed_grad_norm', 'opt/hallucination',
              'opt/hallucination_steps', 'opt/sam_active', 'opt/grad_ratio',
              'opt/cosine', 'opt/rho'):
    assert all(key in r for r in train), key
  # Steps 10 and 20 are inside the 25-step warm-up; 30 and 40 are SAM.
  assert [r['opt/sam_active'] for r in train] == [0.0, 0.0, 1.0, 1.0]
  assert train[-1]['opt/rho'] == pytest.approx(0.1)
  assert train[-1]['opt/hallucination'] == 0.0
  events = os.listdir(tmp_path / 'tensorboard')
  assert events


def _one_step(config, workdir, batch_step=3):
  """(experiment, its state after one update from the initial state, the
  update's batch on the host).

  The update is the trainer's own train program (aot.train_programs, the
  split on the devices as compile_steps puts it there), compiled for the
  kind of step the method's host rule picks at step 0 only:
  aot.compile_steps would also compile the other kind, the eval step and
  the finiteness check, which no test here runs.
  """
  config.optimizer.warmup_steps = 0  # A learning rate of 0 would hide it all.
  exp = experiment.build(config, workdir)
  train_data = datasets.load_split('digits', 'train', None)
  assert input_pipeline.fits_on_devices(train_data,
                                        config.device_data_max_mb)
  resident = input_pipeline.put_replicated(
      train_data, sharding_lib.replicated(exp.mesh))
  state = exp.init_state()
  variants = exp.hooks.variants
  kind = None if variants is None else variants.choose(0, state.opt_state)
  train = aot.train_programs(exp, resident)[kind].lower().compile()
  batches = input_pipeline.TrainBatches(train_data, config.batch_size, 0)
  host = next(batches.iterate(batch_step, batch_step + 1, indices_only=True))
  state, _ = train(state, resident,
                   input_pipeline.to_global(host, exp.batch_sharding))
  return exp, jax.device_get(state), batches.local_batch(batch_step)


def test_batchnorm_statistics_come_from_the_clean_pass(tmp_path):
  # runlocal's MLP (Dense-BN-ReLU): its BatchNorm is the CNN's layer, and
  # its steps trace and compile in a fraction of the CNN's time.
  plain_cfg = digits.get_config('runlocal,model=mlp')
  _, plain, _ = _one_step(plain_cfg, str(tmp_path / 'a'))
  _, with_sam, _ = _one_step(
      _sam_config(digits.get_config('runlocal,model=mlp'), rho=0.5),
      str(tmp_path / 'b'))
  # Same statistics (from w, not w + e), different weights (g+ vs g).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-7),
               with_sam.batch_stats, plain.batch_stats)
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(with_sam.params), jax.tree.leaves(plain.params)))
  assert diff > 1e-4


def _m_sharpness_config(config_arg='runlocal,model=mlp', **sam):
  """SAM with m-sharpness at rho 0.5, without weight decay (the per-device
  loop below leaves it out; it is applied after the perturbation, so the
  fused kernel's comparison does not need it either). By default on
  runlocal's MLP (Dense-BN-ReLU): per-device BatchNorm statistics as the
  CNN's, at a fraction of its tracing."""
  config = _sam_config(digits.get_config(config_arg),
                       **{'rho': 0.5, 'm_sharpness': True, **sam})
  config.optimizer.weight_decay = 0.0
  return config


@pytest.fixture(scope='module')
def m_sharpness_step(tmp_path_factory):
  """`_one_step` of `_m_sharpness_config()` (unfused), computed once: the
  trainer step test_m_sharpness_step_matches_a_per_device_loop checks,
  and the unfused side of test_fused_perturbation_matches_the_unfused_step
  (each CNN step was 6-7 s of CPU, most of it tracing)."""
  config = _m_sharpness_config()
  return (config, *_one_step(config,
                             str(tmp_path_factory.mktemp('m_sharpness'))))


def test_m_sharpness_step_matches_a_per_device_loop(m_sharpness_step):
  config, exp, got, batch = m_sharpness_step
  init = jax.device_get(exp.init_state())
  model = exp.model
  data_shards = exp.mesh.shape['data']
  n = len(batch['label']) // data_shards

  def local_loss(params, stats, b):
    logits, new = model.apply({'params': params, 'batch_stats': stats},
                              b['image'], train=True, mutable=['batch_stats'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b['label']).mean(), new['batch_stats']

  # One compilation for every shard's two gradients (op by op: 50 s), one
  # for the perturbation, one for the update: op by op, each op of each
  # parameter's shape compiled apart (about 100 small compiles).
  grad = jax.jit(jax.grad(local_loss, has_aux=True))

  @jax.jit
  def perturb(params, g):
    e, _ = sam_lib.perturbation(g, params, 0.5)
    return sam_lib.perturbed_params(params, e)

  perturbed, new_stats = [], []
  for i in range(data_shards):
    b = jax.tree.map(lambda x, i=i: x[i * n:(i + 1) * n], batch)
    g, s = grad(init.params, init.batch_stats, b)
    perturbed.append(grad(perturb(init.params, g), init.batch_stats, b)[0])
    new_stats.append(s)
  mean = lambda trees: jax.tree.map(lambda *x: sum(x) / len(x), *trees)
  base_cfg = config.optimizer.copy_and_resolve_references()
  base_cfg.sam.enabled = False
  base = optim.create_optimizer(base_cfg, config.num_steps)

  @jax.jit
  def update(params, grads):
    updates, _ = base.update(grads, base.init(params), params)
    return optax.apply_updates(params, updates)

  want = update(init.params, jax.jit(mean)(perturbed))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4,
                                                       atol=2e-6),
               got.params, want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               got.batch_stats, mean(new_stats))


# Slow (two runs and a preemption). The default run covers its parts: the
# loop's bit-exact resume after SIGTERM or kill -9 (test_workdir_faults.py)
# and every SAM state, detector included, through an Orbax checkpoint and
# on bit for bit (test_battery.py::test_state_survives_a_checkpoint).
@pytest.mark.slow
def test_sam_state_resumes_bit_exactly_after_preemption(digits_config,
                                                        tmp_path):
  config = _sam_config(digits_config, rho=0.1, warmup_steps=5)
  config.checkpoint_every = 10
  trainer.train_and_evaluate(config, str(tmp_path / 'ref'))
  workdir = tmp_path / 'preempted'

  def preempt_after_first_checkpoint():
    deadline = time.monotonic() + 120
    while not (workdir / 'checkpoints' / '10').is_dir():
      if time.monotonic() > deadline:
        return
      time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=preempt_after_first_checkpoint, daemon=True).start()
  with pytest.raises(Preempted) as info:
    trainer.train_and_evaluate(config, str(workdir))
  assert 10 <= info.value.step < config.num_steps
  trainer.train_and_evaluate(config, str(workdir))

  def final(path):
    exp = experiment.build(config, str(path))
    with checkpointing.Checkpoints(str(path), every_steps=1, keep=9) as c:
      return jax.device_get(c.restore(config.num_steps,
                                      exp.abstract_state)[0])

  want, got = final(tmp_path / 'ref'), final(workdir)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  state = sam_lib.find_state(got.opt_state)
  assert int(state.count) == config.num_steps
  assert int(state.detector.sam_steps) == config.num_steps - 5


def test_m_sharpness_needs_the_batch_on_the_data_axis(digits_config,
                                                      tmp_path):
  config = _sam_config(digits_config, m_sharpness=True)
  config.logical_axis_rules = (('batch', ('data', 'model')),) + tuple(
      r for r in config.logical_axis_rules if r[0] != 'batch')
  with pytest.raises(ConfigError, match='optimizer.sam.m_sharpness'):
    experiment.build(config, str(tmp_path))


def test_diagnostics_metric_names_are_prefixed(digits_config, tmp_path):
  config = _sam_config(digits_config)
  exp = experiment.build(config, str(tmp_path))
  fn = steps.make_train_step(exp.model, exp.tx, exp.per_example,
                             log_every=10, hooks=exp.hooks)
  names = jax.eval_shape(fn, exp.abstract_state,
                         exp.abstract_batch(config.batch_size))[1]
  assert {'loss', 'correct', 'grad_norm', 'opt/hallucination',
          'opt/sam_active'} <= set(names)



# Slow (a CNN step in a cond, 70x slower on XLA:CPU). Covered by:
# test_method_hooks.py::test_host_choice_agrees_with_the_device_at_every_step
# (the host rule equals geom.sam's own choice, warm-up and window included),
# test_sam.py::test_sam_step_fixes_the_branch_at_trace_time (a fixed branch
# equals the free one) and
# test_warm_restart_runs_plain_steps_after_each_flag below (the loop runs
# the variant the rule picks).
@pytest.mark.slow
def test_host_chosen_branches_match_the_transformations_own_choice(
    digits_config, tmp_path):
  # The trainer compiles a SAM and a plain step and picks one on the host;
  # the result must be what geom.sam decides by itself inside one program.
  config = _sam_config(digits_config, rho=0.2, warmup_steps=2,
                       window_start=0, window_stop=4)
  config.optimizer.warmup_steps = 0
  exp = experiment.build(config, str(tmp_path))
  train_data = datasets.load_split('digits', 'train', None)
  compiled = aot.compile_steps(exp, train_data)
  assert set(compiled.variants) == {True, False}
  batches = input_pipeline.TrainBatches(train_data, config.batch_size, 0)
  one_program = jax.jit(steps.make_train_step(
      exp.model, exp.tx, exp.per_example, log_every=10, hooks=exp.hooks))
  state_a, state_b = exp.init_state(), exp.init_state()
  active = []
  for step in range(6):
    host = next(batches.iterate(step, step + 1,
                                indices_only=compiled.data_on_device))
    state_a, _ = compiled.train(
        state_a, input_pipeline.to_global(host, exp.batch_sharding), step)
    state_b, _ = one_program(state_b, input_pipeline.to_global(
        batches.local_batch(step), exp.batch_sharding))
    active.append(bool(sam_lib.find_state(state_a.opt_state).sam_active))
  assert active == [False, False, True, True, False, False]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               jax.device_get(state_a.params), jax.device_get(state_b.params))


def _per_step_log(config, workdir):
  """Runs `config` logging every step; {metric: [value at step 1, 2, ...]}."""
  config.log_every = 1
  config.eval_every = config.checkpoint_every = config.num_steps
  trainer.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    train = [r for r in map(json.loads, f) if 'train_loss' in r]
  assert [r['step'] for r in train] == list(range(1, config.num_steps + 1))
  return {k: [r[k] for r in train] for k in train[0]}


def _restart_log(response, workdir):
  """The per-step log of an 8-step MLP run with m-sharpness, where the
  detector fires on every SAM step (|g+|/|g| stays far below 10, patience
  1) and each warm restart is 2 plain steps (the MLP compiles faster, and
  the choice does not depend on the model)."""
  config = _sam_config(digits.get_config('runlocal,model=mlp'), rho=0.5,
                       m_sharpness=True, warmup_steps=1, restart_steps=2,
                       response=response)
  config.optimizer.sam.detector.patience = 1
  config.optimizer.sam.detector.ratio_threshold = 10.0
  config.optimizer.warmup_steps = 0
  config.num_steps = 8
  return _per_step_log(config, workdir)


def test_warm_restart_runs_plain_steps_after_each_flag(tmp_path):
  # The loop picks the SAM or the plain program of each step on the host,
  # from the warm restart's cooldown in the state: update 0 is the
  # warm-up, then SAM at 1, 4 and 7, plain between. The variant that ran
  # sets sam_active (sam_step fixes the branch). The same run against the
  # flag response's, step by step: the slow test below.
  restart = _restart_log('warm_restart', str(tmp_path))
  assert restart['opt/sam_active'] == [0, 1, 0, 0, 1, 0, 0, 1]
  assert restart['opt/cooldown'] == [0, 2, 1, 0, 2, 1, 0, 2]
  assert restart['opt/hallucination_steps'] == [0, 1, 1, 1, 2, 2, 2, 3]


# Slow (two runs, 14 s): its warm-restart run is the test above's.
@pytest.mark.slow
def test_warm_restart_runs_plain_steps_exactly_after_each_flag(tmp_path):
  logs = {response: _restart_log(response, str(tmp_path / response))
          for response in ('warm_restart', 'flag')}
  restart, flag = logs['warm_restart'], logs['flag']
  # The variant that ran sets sam_active (sam_step fixes the branch).
  assert restart['opt/sam_active'] == [0, 1, 0, 0, 1, 0, 0, 1]
  assert restart['opt/cooldown'] == [0, 2, 1, 0, 2, 1, 0, 2]
  assert restart['opt/hallucination_steps'] == [0, 1, 1, 1, 2, 2, 2, 3]
  assert flag['opt/sam_active'] == [0] + [1] * 7
  # The loss logged at step k is at the weights after k - 1 updates: the
  # two runs agree until the first plain step of the restart (update 2)
  # and differ from the loss after it on.
  np.testing.assert_allclose(restart['train_loss'][:3],
                             flag['train_loss'][:3], rtol=1e-6)
  gaps = np.abs(np.subtract(restart['train_loss'], flag['train_loss']))
  assert np.all(gaps[3:] > 1e-4), gaps


@pytest.mark.parametrize('m_sharpness', [
    # Slow; the kernel in the trainer is covered by m_sharpness=True, and
    # fused = unfused without a per-device axis by test_kernels_sam_perturb.py
    # (test_equals_unfused_geom_sam_inside_jit).
    pytest.param(False, marks=pytest.mark.slow),
    True,
])
def test_fused_perturbation_matches_the_unfused_step(request, tmp_path,
                                                     m_sharpness):
  states = {}
  for fused in (False, True):
    if m_sharpness and not fused:  # The same config as test_m_sharpness_...
      states[fused] = request.getfixturevalue('m_sharpness_step')[2]
      continue
    # The slow case keeps the CNN (the MLP is the fixture's, for sharing).
    config = _m_sharpness_config(
        'runlocal,model=mlp' if m_sharpness else 'runlocal',
        m_sharpness=m_sharpness, fused=fused)
    _, states[fused], _ = _one_step(config, str(tmp_path / str(fused)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               states[True].params, states[False].params)
