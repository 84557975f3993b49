r"""What steering costs in generation: tokens/s with steering / without, KV cache on.

  python -m bench.steering_generation          # writes the BENCHMARKS.md section
  python -m bench.steering_generation --repeats=3 --nowrite

Model: configs/lm.py's decoder (d_model 128, 4 blocks, byte vocabulary),
randomly initialised (speed does not depend on the weights), one CPU
device. Each variant is one jitted `lm_generate.generate` call in 'cached'
mode (prefill of a 32-byte prompt, then `--steps` greedy decoding steps)
on a batch of `--batch`; variants alternate over `--repeats` repeats and
the median of the per-repeat ratios is reported. Steering is at block 2,
on every generated token. Goal: >= 0.95x for each steering method. For
information, the reference's 'recompute' mode (no cache, the prefix
re-run each step) against the cached baseline.
"""

import os
import platform
import statistics
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp

from bench import report
from configs import lm as lm_config
from geom import steering as steering_lib
from train.lm import decoder as decoder_lm
from train.lm import generate as lm_generate

_STEPS = flags.DEFINE_integer('steps', 128, 'Generated tokens per call.')
_BATCH = flags.DEFINE_integer('batch', 16, 'Sequences per call.')
_REPEATS = flags.DEFINE_integer('repeats', 7, 'Alternating repeats.')
_CALLS = flags.DEFINE_integer('calls', 3, 'Timed calls per repeat.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'steering_generation'
PROMPT = 32
LAYER = 'block_2'


def variants(direction):
  return {
      'no steering': (None, 'cached'),
      'addition': (steering_lib.Steering('addition', direction, alpha=0.5,
                                         coefficient=10.0), 'cached'),
      'spherical (no gate)': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, gate=False), 'cached'),
      'spherical + gate': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, beta=0.0), 'cached'),
      'recompute mode, spherical + gate': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, beta=0.0), 'recompute'),
  }


def main(argv):
  del argv
  model = decoder_lm.DecoderLM(**lm_config.get_config().model)
  params = nn.meta.unbox(model.init(jax.random.key(0),
                                    jnp.zeros((1, 8), jnp.int32))['params'])
  prompt = jax.random.randint(jax.random.key(1), (_BATCH.value, PROMPT), 2,
                              128)
  valid = jnp.ones(prompt.shape, bool)
  direction = jax.random.normal(jax.random.key(2), (model.d_model,))

  compiled = {}
  for name, (steer, mode) in variants(direction).items():
    fn = jax.jit(lambda p, s, mode=mode: lm_generate.generate(
        model, p, prompt, valid, _STEPS.value, steering=s,
        layer_path=LAYER, mode=mode).tokens)
    jax.block_until_ready(fn(params, steer))  # Compile and warm up.
    compiled[name] = (fn, steer)

  times = {name: [] for name in compiled}
  for _ in range(_REPEATS.value):
    for name, (fn, steer) in compiled.items():
      start = time.perf_counter()
      for _ in range(_CALLS.value):
        jax.block_until_ready(fn(params, steer))
      times[name].append((time.perf_counter() - start) / _CALLS.value)

  tokens = _BATCH.value * _STEPS.value
  base = times['no steering']
  speed = lambda name: statistics.median(
      b / t for b, t in zip(base, times[name]))
  rows = [(name, speed(name),
           '>= 0.95x' if mode == 'cached' else '-')
          for name, (_, mode) in variants(direction).items()
          if name != 'no steering']
  lines = [
      '## Steering in generation',
      '',
      f'configs/lm.py decoder (d_model {model.d_model}, {model.num_layers} '
      f'blocks), batch {_BATCH.value}, {PROMPT}-byte prompt, {_STEPS.value} '
      f'greedy steps, KV cache, steering at {LAYER}, one CPU device. Median '
      f'of {_REPEATS.value} alternating repeats of {_CALLS.value} calls.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'jax {jax.__version__}.',
      '',
      '| tokens/s with steering / without | measured | goal |',
      '|---|---|---|',
      *[f'| {name} | **{value:.3f}x** | {goal} |' for name, value, goal in rows],
      '',
      '| variant | tokens/s (median) |',
      '|---|---|',
      *[f'| {name} | {tokens / statistics.median(times[name]):.0f} |'
        for name in compiled],
      '',
      'Reproduce: `.venv/bin/python -m bench.steering_generation '
      f'--steps={_STEPS.value} --batch={_BATCH.value} '
      f'--repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
