r"""What SAM's cheaper variants cost: step time as a ratio to the base step.

  python -m bench.sam.efficient            # writes the BENCHMARKS.md section
  python -m bench.sam.efficient --steps=20 --repeats=2 --nowrite

Workloads: the digits CNN (`configs/digits.py:runlocal`) and the LM
(`configs/lm.py:runlocal`), each through the trainer's own compiled steps
(`train.training.aot.compile_steps`, as a run compiles them), over the same
pre-placed batches. Variants: the base optimizer alone; SAM (rho 0.05);
LookSAM's reuse with g+ every 2, 5 and 10 steps (the trainer compiles a
SAM and a one-gradient step and picks one per step on the host); AE-SAM's
switch at c = 0 (decided on the device, one compiled step with a
`lax.cond`). In each repeat every variant runs `--steps` steps in turn;
a variant's ratio is its time over the base's in the same repeat, and the
median over repeats is reported with the fraction of steps that computed
g+ (the ideal ratio of a variant that spends a fraction f of its steps on
SAM is about 1 + f when a SAM step costs two).

Then the per-chip cost a TPU and a GPU target would pay, from the
compile-only path of `launch.compile` (`train.jobs.compile_jobs`): the
roofline time of the digits job's SAM and one-gradient train steps, and
from them what each variant's mean step costs at its g+ fraction (an
estimate: the fractions are the CPU run's).
"""

import os
import platform
import statistics
import tempfile
import time

# Everything runs on the CPU; the accelerator targets are compile-only
# (their compilers, as in bench.sam.perturb_hbm, need JAX on the CPU).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import jax

from bench import report
from configs import digits
from configs import lm as lm_config
from geom import sam as sam_lib
from train.analysis import stats
from train.jobs import compile_jobs
from train.lm import trainer as lm_trainer
from train.training import aot
from train.training import host_devices
from train.training import input_pipeline
from train.vision import datasets
from train.vision import experiment as vision_experiment

_STEPS = flags.DEFINE_integer('steps', 60, 'Steps per variant and repeat '
                              '(a multiple of 10 keeps LookSAM whole).')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Alternating repeats.')
_WORKLOADS = flags.DEFINE_list('workloads', ['digits', 'lm'],
                               'Of: digits, lm.')
_TARGETS = flags.DEFINE_list('targets', ['v5e:2x2', 'h100:1x1x2'],
                             'Compile-only targets (empty: none).')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')
_CPU_DEVICES = flags.DEFINE_integer(
    'cpu_devices', None, 'Simulated CPU devices (default: the runlocal '
    "configs' 8, on a (4, 2) mesh; 1: one device, the per-chip cost "
    'without the simulated mesh\'s synchronisation; its own section).')

SECTION = 'sam_efficient'
RHO = 0.05
# name -> (SAM on, every, AE-SAM's switch on)
VARIANTS = {
    'base': (False, 1, False),
    'sam': (True, 1, False),
    'looksam_2': (True, 2, False),
    'looksam_5': (True, 5, False),
    'looksam_10': (True, 10, False),
    'aesam_c0': (True, 1, True),
}


def config_for(workload: str, variant: str):
  module, arg = ((digits, 'runlocal') if workload == 'digits'
                 else (lm_config, 'runlocal'))
  config = module.get_config(arg)
  config.unlock()
  enabled, every, ae = VARIANTS[variant]
  block = config.optimizer.sam
  block.enabled, block.rho, block.every = enabled, RHO, every
  block.ae.enabled = ae
  config.eval_every = 10**9
  if _CPU_DEVICES.value is not None and _CPU_DEVICES.value != (
      config.cpu_devices):
    config.cpu_devices = _CPU_DEVICES.value
    config.mesh.shape = (-1, 1)
  return config


def compiled_variant(workload: str, variant: str, steps: int):
  """(experiment, compiled steps, the batches on the devices)."""
  config = config_for(workload, variant)
  config.num_steps = max(config.num_steps, 10 * steps)
  with tempfile.TemporaryDirectory() as workdir:
    if workload == 'digits':
      exp = vision_experiment.build(config, workdir)
      train = datasets.load_split(config.dataset, 'train', config.data_dir)
    else:
      exp = lm_trainer.build(config, workdir)
      train = lm_trainer.load_data(config, workdir).train
  compiled = aot.compile_steps(exp, train)
  batches = input_pipeline.TrainBatches(train, config.batch_size,
                                        config.seed)
  placed = jax.block_until_ready(list(input_pipeline.to_devices(
      batches.iterate(0, steps + 1, indices_only=compiled.data_on_device),
      exp.batch_sharding)))
  return exp, compiled, placed


def _sam_steps(state) -> float:
  found = sam_lib.find_state(state.opt_state)
  if found is None or found.detector is None:
    return 0.0
  return float(found.detector.sam_steps)


def timed(exp, compiled, placed) -> tuple[float, float]:
  """(seconds for the steps after a warm-up one, fraction that took g+)."""
  state = exp.init_state()
  state, _ = compiled.train(state, placed[0], 0)
  state = jax.block_until_ready(state)
  before = _sam_steps(state)
  start = time.perf_counter()
  for i, batch in enumerate(placed[1:]):
    state, _ = compiled.train(state, batch, i + 1)
  jax.block_until_ready(state)
  elapsed = time.perf_counter() - start
  return elapsed, (_sam_steps(state) - before) / (len(placed) - 1)


def cpu_rows(workload: str, steps: int, repeats: int) -> list[list[str]]:
  built = {v: compiled_variant(workload, v, steps) for v in VARIANTS}
  times = {v: [] for v in VARIANTS}
  fractions = {v: [] for v in VARIANTS}
  for _ in range(repeats):
    for v, (exp, compiled, placed) in built.items():
      seconds, fraction = timed(exp, compiled, placed)
      times[v].append(seconds)
      fractions[v].append(fraction)
  rows = []
  for v in VARIANTS:
    ratios = [t / b for t, b in zip(times[v], times['base'])]
    rows.append([workload, v, f'{statistics.mean(fractions[v]):.2f}',
                 f'{1000 * statistics.median(times[v]) / steps:.2f}',
                 f'**{statistics.median(ratios):.3f}x**',
                 ', '.join(f'{r:.2f}' for r in ratios)])
  return rows, {v: statistics.mean(f) for v, f in fractions.items()}


def target_rows(target: str, fractions: dict[str, float]) -> list[list[str]]:
  """Roofline seconds per step on `target` for each variant, from the
  digits job's compiled SAM and one-gradient steps."""
  config = config_for('digits', 'sam')
  config.optimizer.sam.warmup_steps = 1  # Both kinds of step compiled.
  result = compile_jobs.run(config, target, 1, None, None)
  rows = {r['function']: r for r in result['rows']}
  full = rows['train_step (sam_step=True)']['roofline_seconds']
  plain = rows['train_step (sam_step=False)']['roofline_seconds']
  out = []
  for v, fraction in fractions.items():
    per_step = plain if v == 'base' else fraction * full + (
        1 - fraction) * plain
    out.append([target, v, f'{fraction:.2f}', f'{1e6 * per_step:.2f}',
                f'{per_step / plain:.3f}x'])
  return out


def main(argv):
  del argv
  default = digits.get_config('runlocal').cpu_devices
  devices = _CPU_DEVICES.value or default
  host_devices.configure_cpu_devices(devices)
  steps, repeats = _STEPS.value, _REPEATS.value
  rows, fractions = [], {}
  for workload in _WORKLOADS.value:
    workload_rows, workload_fractions = cpu_rows(workload, steps, repeats)
    rows += workload_rows
    if workload == 'digits':
      fractions = workload_fractions
  chip_rows = []
  for target in _TARGETS.value if fractions else ():
    chip_rows += target_rows(target, fractions)
  lines = [
      "## SAM's cheaper variants: step time" + (
          '' if devices == default else f' on {devices} CPU device(s)'),
      '',
      'Step time of each variant over the base optimizer\'s, the '
      "trainer's compiled steps run bare over pre-placed batches, all "
      'variants alternating in one process (median of per-repeat ratios); '
      '"g+ fraction": the steps that computed the second gradient. Goal '
      'for a cheap variant: <= 1.3x.',
      '',
      f'Setup: `configs/digits.py:runlocal` (CNN) and `configs/lm.py:'
      f'runlocal`, rho {RHO}, {steps} steps per variant and repeat, '
      f'{repeats} repeats.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'{jax.device_count()} simulated CPU devices, jax {jax.__version__}.',
      '',
      stats.markdown_table(
          ['workload', 'variant', 'g+ fraction', 'ms per step (median)',
           'step time / base', 'per-repeat ratios'], rows, '-' * 6),
      '',
  ]
  if chip_rows:
    lines += [
        'Per chip on accelerator targets (compile-only, `launch.compile`): '
        "the digits job's roofline time of its SAM step and of its "
        'one-gradient step, weighted by each variant\'s g+ fraction '
        'measured above on CPU (AE-SAM compiles one step with a '
        '`lax.cond`; its row, too, weights the two kinds of step rather '
        'than reading its own program\'s cost).',
        '',
        stats.markdown_table(
            ['target', 'variant', 'g+ fraction', 'roofline us per step',
             'per step / base'], chip_rows, '-' * 5),
        '',
    ]
  flags_used = (f'--steps={steps} --repeats={repeats}' + (
      '' if devices == default else
      f' --cpu_devices={devices} --targets={",".join(_TARGETS.value)}'))
  lines.append('Reproduce: `.venv/bin/python -m bench.sam.efficient '
               f'{flags_used}`.')
  report.publish(SECTION if devices == default
                 else f'{SECTION}_{devices}dev', lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
