r"""Trainer step throughput against a minimal hand-written jitted loop.

Both run the same model, optimizer, global batch and mesh in this process.
The minimal loop is the floor: one jitted step (loss, gradient, optax
update) per batch, over the very batches the trainer draws, placed on the
devices beforehand, with nothing else.
The trainer's loop adds what a real run needs: a new shuffled batch each
step prefetched to the devices, metrics (accuracy, gradient norm, learning
rate) with a host sync every `log_every` steps, the non-finite check, and
one checkpoint at the end. Evaluation is off (eval_every > num_steps) so
the number is about the step loop. Repeats alternate the two and report
the median ratio.

A third loop splits the gap in two: the trainer's own compiled step, run
bare over pre-placed batches (indices, when the data lives on the
devices). Against the minimal loop it measures what the step computes
beyond the minimal one (per-example metrics, the sampled gradient norm,
the on-device gather); the trainer against it measures the loop's
bookkeeping on the host (drawing and placing batches, choosing the step,
logging, the final save), which on CPU is not overlapped with the step:
XLA:CPU programs are dispatched synchronously here (`train/training/host_devices.py`).

  python -m bench.training.trainer_overhead            # writes BENCHMARKS.md section
  python -m bench.training.trainer_overhead --steps=100 --repeats=2 --nowrite
"""

import os
import platform
import statistics
import tempfile
import time

from absl import app
from absl import flags
import jax
import optax

from bench import report
from configs import digits
from train.training import aot
from train.training import host_devices
from train.training import input_pipeline
from train.training import loop
from train.run import resumable
from train.analysis import stats
from train.vision import datasets
from train.vision import experiment

_STEPS = flags.DEFINE_integer('steps', 300, 'Steps per timed run.')
_REPEATS = flags.DEFINE_integer('repeats', 9, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')
_CONFIG_ARG = flags.DEFINE_string('config_arg', '', 'Argument of configs/digits.py.')

SECTION = 'trainer_overhead'


def device_batches(exp, train_data, steps: int) -> list[dict[str, jax.Array]]:
  """The trainer's first `steps` batches, placed on the devices up front."""
  batches = input_pipeline.TrainBatches(train_data, exp.config.batch_size,
                                        exp.config.seed)
  placed = [input_pipeline.to_global(b, exp.batch_sharding)
            for b in batches.iterate(0, steps)]
  return jax.block_until_ready(placed)


def minimal_loop(exp, batches: list[dict[str, jax.Array]]) -> float:
  """Seconds for one bare jitted update per batch (batches already on device)."""
  model, tx = exp.model, exp.tx

  def step(state, batch):
    params, stats, opt_state = state

    def loss_fn(p):
      logits, upd = model.apply({'params': p, 'batch_stats': stats},
                                batch['image'], train=True,
                                mutable=['batch_stats'])
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits, batch['label']).mean()
      return loss, upd['batch_stats']

    grads, stats = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state

  s = exp.state_shardings
  shardings = (s.params, s.batch_stats, s.opt_state)
  jitted = jax.jit(step, in_shardings=(shardings, exp.batch_sharding),
                   out_shardings=shardings, donate_argnums=(0,))
  init = exp.init_state()
  state = (init.params, init.batch_stats, init.opt_state)
  state = jax.block_until_ready(jitted(state, batches[0]))  # Compile, warm up.
  start = time.perf_counter()
  for batch in batches:
    state = jitted(state, batch)
  jax.block_until_ready(state)
  return time.perf_counter() - start


def step_loop(exp, compiled, train_data, steps: int) -> float:
  """Seconds for the trainer's compiled step alone, batches pre-placed."""
  warm = exp.config.log_every
  batches = input_pipeline.TrainBatches(train_data, exp.config.batch_size,
                                        exp.config.seed)
  placed = jax.block_until_ready(list(input_pipeline.to_devices(
      batches.iterate(warm, warm + steps,
                      indices_only=compiled.data_on_device),
      exp.batch_sharding)))
  state = exp.init_state()
  state, _ = compiled.train(state, placed[0], 0)  # Warm up.
  state = jax.block_until_ready(state)
  start = time.perf_counter()
  for i, batch in enumerate(placed):
    state, _ = compiled.train(state, batch, i + 1)
  jax.block_until_ready(state)
  return time.perf_counter() - start


def trainer_loop(exp, compiled, train_data, val_data, steps: int) -> float:
  """Seconds for `steps` updates of the trainer's own loop (after warm-up)."""
  config = exp.config.copy_and_resolve_references()
  config.checkpoint_every = 10**9
  with tempfile.TemporaryDirectory() as workdir:
    with resumable.open_run(config, workdir, check_config=lambda *_: None,
                            results_name='results.json') as run:
      # Warm-up: the first steps of a run, not timed.
      warm = exp.config.log_every
      run.finished(warm)
      run.restore(exp.abstract_state)
      state = loop.train_loop(exp, exp.init_state(), compiled, train_data,
                              val_data, run)
      jax.block_until_ready(state)
      run.total = warm + steps
      start = time.perf_counter()
      state = loop.train_loop(exp, state, compiled, train_data, val_data,
                              run)
      jax.block_until_ready(state)
      elapsed = time.perf_counter() - start
  return elapsed


def measure(exp, train_data, val_data, steps: int, repeats: int):
  """Alternates minimal loop and trainer; returns per-repeat seconds of each."""
  compiled = aot.compile_steps(exp, train_data)
  # The same batches the trainer will draw (its warm-up takes log_every
  # steps first, so offset them): identical compute, no loading cost.
  warm = exp.config.log_every
  batches = device_batches(exp, train_data, warm + steps)[warm:]
  minimal, step_only, ours = [], [], []
  for _ in range(repeats):
    minimal.append(minimal_loop(exp, batches))
    step_only.append(step_loop(exp, compiled, train_data, steps))
    ours.append(trainer_loop(exp, compiled, train_data, val_data, steps))
  return compiled.data_on_device, minimal, step_only, ours


def main(argv):
  del argv
  config = digits.get_config(_CONFIG_ARG.value or None)
  host_devices.configure_cpu_devices(config.cpu_devices)
  config.unlock()
  config.eval_every = 10**9
  train_data, val_data = (datasets.load_split(config.dataset, s,
                                              config.data_dir)
                          for s in ('train', 'validation'))
  steps, repeats = _STEPS.value, _REPEATS.value
  rows = []
  # The default (training split on the devices) and the host pipeline.
  for max_mb in (config.device_data_max_mb, 0):
    config.device_data_max_mb = max_mb
    with tempfile.TemporaryDirectory() as workdir:
      exp = experiment.build(config, workdir)
    on_device, minimal, step_only, ours = measure(exp, train_data, val_data,
                                                  steps, repeats)
    ratios = [m / t for m, t in zip(minimal, ours)]  # Throughput ratio.
    median = lambda a, b: statistics.median(x / y for x, y in zip(a, b))
    rows.append([
        'on the devices (default)' if on_device else 'host pipeline',
        f'{steps / statistics.median(minimal):.1f}',
        f'{steps / statistics.median(ours):.1f}',
        f'**{statistics.median(ratios):.3f}x**',
        f'{min(minimal) / min(ours):.3f}x',
        f'{median(minimal, step_only):.3f}x',
        f'{median(step_only, ours):.3f}x',
        ', '.join(f'{r:.3f}' for r in ratios)])
  lines = [
      '## Trainer overhead',
      '',
      'Trainer step throughput as a fraction of a minimal hand-written '
      'jitted loop: same model, optimizer, batches and mesh, one process. '
      'Goal: >= 0.95x. The two run in alternating repeats; the median of '
      'the per-repeat ratios is the headline, and the ratio of the best '
      'times of each (the least disturbed by other load on the machine) '
      'is shown beside it.',
      '',
      f'Setup: `configs/digits.py` ({config.model.name}, global batch '
      f'{config.batch_size}), mesh {dict(exp.mesh.shape)}, {steps} steps '
      f'per repeat, {repeats} repeats.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'{jax.device_count()} simulated CPU devices, jax {jax.__version__}.',
      '',
      stats.markdown_table(
          ['training data', 'minimal loop (steps/s, median)',
           'trainer (steps/s, median)', 'trainer / minimal (median)',
           'best / best', 'the step alone / minimal',
           'trainer / the step alone', 'per-repeat ratios'], rows,
          '-' * 8),
      '',
      'The two middle ratios split the gap (medians of per-repeat ratios; '
      'their product is near the headline): "the step alone" is the '
      "trainer's compiled step run bare over pre-placed batches, so "
      '"the step alone / minimal" is what the step computes beyond a '
      'minimal one (per-example metrics, the gradient norm on logging '
      'steps, the on-device gather of the batch) and "trainer / the step '
      "alone\" is the host-side bookkeeping of the loop, which XLA:CPU's "
      'synchronous dispatch does not overlap with the step.',
      '',
      'Reproduce: `make bench` or `.venv/bin/python -m bench.training.trainer_overhead '
      f'--steps={steps} --repeats={repeats}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
