r"""What test-time adaptation's loop and CONGA cost, as ratios in one process.

  python -m bench.training.tta_overhead            # writes the BENCHMARKS.md section
  python -m bench.training.tta_overhead --repeats=3 --nowrite

1. CONGA on a TENT step: the jitted TENT step (entropy gradient on the
   normalisation affines, Adam's direction) with `geom.conga.conga` as its
   rate against a fixed rate (`optax.scale_by_learning_rate`), batch 64 of
   28x28 images, the digits CNN (conv 32-64, hidden 128). Variants
   alternate over `--repeats` repeats of `--steps` steps; the median of the
   per-repeat time ratios. Goal: <= 1.03x.
2. The TTA loop against a minimal loop: `train.tta.adapt` over the
   mnist5k_corrupted stream (TENT, 15 corruptions at severity 5, batch 64:
   120 batches, a metrics record per batch and a checkpoint every 50, as
   configs/tta.py runs) against a minimal Python loop calling the same
   jitted step on the same batches already on the device, both timed past
   their first (compiling) batch. The loop's time is what it writes to
   `timing.json`. Throughput ratio, median over repeats. Goal: >= 0.95x.
"""

import os
import platform
import statistics
import tempfile
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import numpy as np
import optax

from bench import report
from configs import digits
from configs import tta
from geom import conga
from train.training import host_devices
from train.run import metrics
from train.analysis import stats
from train.tta import adapt
from train.tta import data as tta_data
from train.tta import methods
from train.tta import source as source_lib
from train.tta import streams
from train.vision import models
from train.vision import trainer

_STEPS = flags.DEFINE_integer('steps', 50, 'Steps per timed run (1).')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'tta_overhead'


def _step_ratio(steps: int, repeats: int) -> list[float]:
  model = models.CNN(num_classes=10)
  images = np.random.default_rng(0).integers(0, 256, (64, 28, 28, 1)
                                             ).astype(np.uint8)
  variables = nn.meta.unbox(model.init(jax.random.key(0), images,
                                       train=False))
  settings = methods.Settings('tent', 10)
  txs = {'fixed': optax.chain(optax.scale_by_adam(),
                              optax.scale_by_learning_rate(1e-3)),
         'conga': optax.chain(optax.scale_by_adam(),
                              conga.conga(1e-3, num_classes=10))}
  runs = {}
  for name, tx in txs.items():
    method = methods.make(settings, model, variables['params'],
                          variables['batch_stats'], tx)
    step = jax.jit(method.step)
    state = method.init()
    x = jax.device_put(images)
    jax.block_until_ready(step(state, x))
    runs[name] = (step, state, x)
  times = {name: [] for name in txs}
  for _ in range(repeats):
    for name, (step, state, x) in runs.items():
      start = time.perf_counter()
      for _ in range(steps):
        state, out = step(state, x)
      jax.block_until_ready((state, out))
      times[name].append(time.perf_counter() - start)
  return [c / f for c, f in zip(times['conga'], times['fixed'])]


def _loop_ratio(repeats: int) -> tuple[list[float], float]:
  root = tempfile.mkdtemp(prefix='tta_bench_')
  source_dir = os.path.join(root, 'source')
  trainer.train_and_evaluate(digits.get_config('runlocal,dataset=mnist5k'),
                             source_dir)
  config = tta.get_config('method=tent')
  config.source_workdir = source_dir
  ratios, loop_rate = [], 0.0
  for r in range(repeats):
    workdir = os.path.join(root, f'tta_{r}')
    adapt.adapt_and_evaluate(config, workdir)
    timing = metrics.read_json(os.path.join(workdir, adapt.TIMING))
    loop_rate = timing['batches_per_second']
    # The minimal loop: the same step on the same batches, on the device.
    source = source_lib.load(config)
    stream = tta_data.load(config)
    plan = streams.plan(config.protocol, stream.labels, config.batch_size,
                        config.seed, config.order)
    tx = adapt._tx(config, source.spec.num_classes, len(plan) // 15)  # pylint: disable=protected-access
    method = methods.make(methods.Settings('tent', source.spec.num_classes),
                          source.model, source.params, source.batch_stats,
                          tx)
    step = jax.jit(method.step)
    batches = [jax.device_put(stream.images_of(b)) for b in plan]
    initial = state = method.init()
    state, out = step(state, batches[0])
    jax.block_until_ready(out)
    start = time.perf_counter()
    for batch, images in zip(plan[1:], batches[1:]):
      if batch.reset:
        state = initial
      state, out = step(state, images)
    jax.block_until_ready((state, out))
    minimal_rate = (len(plan) - 1) / (time.perf_counter() - start)
    ratios.append(loop_rate / minimal_rate)
  return ratios, loop_rate


def main(argv):
  del argv
  host_devices.configure_cpu_devices(8)  # The source run's mesh.
  step_ratios = _step_ratio(_STEPS.value, _REPEATS.value)
  loop_ratios, loop_rate = _loop_ratio(max(3, _REPEATS.value // 2))
  lines = [
      '## Test-time adaptation: CONGA and the loop',
      '',
      f'One process, CPU ({platform.machine()}, {os.cpu_count()} cores), jax '
      f'{jax.__version__}; median over alternating repeats.',
      '',
      stats.markdown_table(['ratio', 'measured', 'goal'], [
          ['TENT step with CONGA / with a fixed rate (time)',
           f'**{statistics.median(step_ratios):.3f}x**', '<= 1.03x'],
          ['launch.tta loop / minimal jitted loop (throughput)',
           f'**{statistics.median(loop_ratios):.3f}x** ({loop_rate:.0f} '
           'batches/s)', '>= 0.95x']], '---'),
      '',
      f'Per repeat: CONGA {", ".join(f"{r:.3f}" for r in step_ratios)}; '
      f'loop {", ".join(f"{r:.3f}" for r in loop_ratios)}.',
      '',
      f'Reproduce: `python -m bench.training.tta_overhead --steps={_STEPS.value} '
      f'--repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
