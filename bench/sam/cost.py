r"""What SAM costs: step time and peak memory as ratios, in one process.

  python -m bench.sam.cost            # writes the BENCHMARKS.md section
  python -m bench.sam.cost --steps=50 --repeats=3 --nowrite

Model: an MLP 512-1024-1024-10 on a batch of 256 (float32, one CPU device),
base optimizer SGD with momentum 0.9. Each variant is one jitted step
(gradient, optimizer update, apply) timed over `--steps` steps; variants
alternate over `--repeats` repeats and the median of the per-repeat ratios
is reported. Peak memory is XLA's compiled memory analysis of the step
(arguments + outputs + temporaries - aliased buffers).

Ratios (goal in brackets):
- geom SAM step / base step (<= 2.0x: two gradients are the floor);
- geom SAM / optax.contrib.sam in opaque mode, time and peak memory (<= 1.0x);
- a warm-up step of geom SAM / a base step (<= 1.05x);
- geom SAM with the detector / without it (<= 1.02x);
and, for information, what tracking cos(g, g+) (off by default) costs.
geom SAM is the default: detector on, cosine off.
"""

import os
import platform
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import optax

from bench import report
from geom import hallucination
from geom import sam
from train.analysis import stats

_STEPS = flags.DEFINE_integer('steps', 100, 'Steps per timed run.')
_REPEATS = flags.DEFINE_integer('repeats', 7, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'sam_cost'
WIDTHS = (512, 1024, 1024, 10)
BATCH = 256
RHO = 0.05


def problem():
  keys = jax.random.split(jax.random.key(0), len(WIDTHS) + 1)
  params = {f'layer{i}': {
      'w': jax.random.normal(keys[i], (a, b)) / jnp.sqrt(a),
      'b': jnp.zeros((b,))} for i, (a, b) in enumerate(zip(WIDTHS[:-1],
                                                          WIDTHS[1:]))}
  x = jax.random.normal(keys[-1], (BATCH, WIDTHS[0]))
  y = jax.random.randint(keys[-2], (BATCH,), 0, WIDTHS[-1])

  def loss(p):
    h = x
    for i in range(len(WIDTHS) - 1):
      h = h @ p[f'layer{i}']['w'] + p[f'layer{i}']['b']
      if i < len(WIDTHS) - 2:
        h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

  return params, loss


def base():
  return optax.sgd(0.01, momentum=0.9)


def variants():
  """name -> (transformation, whether update gets grad_fn, its calling form)."""
  return {
      'base': (base(), None),
      'geom_sam': (sam.sam(base(), rho=RHO), 'params'),
      'geom_sam_no_detector': (sam.sam(base(), rho=RHO, detector=None),
                               'params'),
      'geom_sam_detector_with_cosine': (sam.sam(
          base(), rho=RHO,
          detector=hallucination.DetectorConfig(track_cosine=True)),
                                        'params'),
      'geom_sam_warmup': (sam.sam(base(), rho=RHO, warmup_steps=10**9),
                          'params'),
      'optax_sam': (optax.contrib.sam(
          base(), optax.chain(optax.contrib.normalize(), optax.sgd(RHO)),
          opaque_mode=True), 'params_index'),
  }


def compile_step(tx, grad_fn_form, params, loss):
  grad = jax.grad(loss)

  def step(p, s):
    extra = {}
    if grad_fn_form == 'params':
      extra['grad_fn'] = grad
    elif grad_fn_form == 'params_index':
      extra['grad_fn'] = lambda q, i: grad(q)
    u, s = tx.update(grad(p), s, p, **extra)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params,
                                                        state).compile()
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes
          + m.temp_size_in_bytes - m.alias_size_in_bytes)
  return compiled, state, peak


def time_steps(compiled, params, state, steps):
  params, state = jax.tree.map(jnp.copy, (params, state))
  params, state = jax.block_until_ready(compiled(params, state))  # Warm up.
  start = time.perf_counter()
  for _ in range(steps):
    params, state = compiled(params, state)
  jax.block_until_ready((params, state))
  return (time.perf_counter() - start) / steps


def main(argv):
  del argv
  params, loss = problem()
  compiled = {name: compile_step(tx, form, params, loss)
              for name, (tx, form) in variants().items()}
  times = {name: [] for name in compiled}
  for _ in range(_REPEATS.value):
    for name, (fn, state, _) in compiled.items():
      times[name].append(time_steps(fn, params, state, _STEPS.value))

  def ratio(a, b):
    return statistics.median(x / y for x, y in zip(times[a], times[b]))

  peak = {name: c[2] for name, c in compiled.items()}
  rows = [
      ('geom SAM step / base step', ratio('geom_sam', 'base'), '<= 2.0x'),
      ('geom SAM / optax.contrib.sam (time)', ratio('geom_sam', 'optax_sam'),
       '<= 1.0x'),
      ('geom SAM / optax.contrib.sam (peak memory)',
       peak['geom_sam'] / peak['optax_sam'], '<= 1.0x'),
      ('warm-up step of geom SAM / base step',
       ratio('geom_sam_warmup', 'base'), '<= 1.05x'),
      ('geom SAM with detector / without',
       ratio('geom_sam', 'geom_sam_no_detector'), '<= 1.02x'),
      ('detector tracking cos(g, g+) too / without detector (time)',
       ratio('geom_sam_detector_with_cosine', 'geom_sam_no_detector'), '-'),
      ('detector tracking cos(g, g+) too / without detector (peak memory)',
       peak['geom_sam_detector_with_cosine'] / peak['geom_sam_no_detector'],
       '-'),
  ]
  lines = [
      '## SAM cost',
      '',
      f'MLP {"-".join(map(str, WIDTHS))}, batch {BATCH}, float32, one CPU '
      f'device; base optimizer SGD momentum 0.9; rho {RHO}. Median of '
      f'{_REPEATS.value} alternating repeats of {_STEPS.value} jitted steps.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'jax {jax.__version__}.',
      '',
      stats.markdown_table(
          ['ratio', 'measured', 'goal'],
          [[name, f'**{value:.3f}x**', goal] for name, value, goal in rows],
          '---'),
      '',
      stats.markdown_table(
          ['variant', 'ms per step (median)', 'peak memory (MiB)'],
          [[name, f'{1e3 * statistics.median(times[name]):.2f}',
            f'{peak[name] / 2**20:.2f}'] for name in compiled], '---'),
      '',
      'Reproduce: `.venv/bin/python -m bench.sam.cost '
      f'--steps={_STEPS.value} --repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
