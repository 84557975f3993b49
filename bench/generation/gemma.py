r"""Gemma 3 270M generation on CPU: tokens/s, steered against unsteered, and
the KV cache against recomputation.

  python -m bench.generation.gemma            # writes the BENCHMARKS.md section
  python -m bench.generation.gemma --repeats=3 --nowrite

Model: the registry's Gemma 3 270M (train.lm.gemma_gguf, float32
parameters), one CPU device. Each variant is one jitted
`train.lm.generate.generate` call (prefill of a real `PROMPT` of about 16
tokens, then `--steps` greedy steps) on a batch of `--batch`; variants
alternate over `--repeats` repeats and the median of the per-repeat ratios
to the unsteered cached call is reported. Steering at block 6 on every
generated token (a random direction: speed does not depend on it). Goal:
>= 0.95x for each steering method, as for the in-project LMs
(`bench.generation.steering`).
"""

import os
import platform
import statistics

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from bench import report
from bench.generation import timing
from geom import steering as steering_lib
from train.analysis import stats
from train.lm import gemma
from train.lm import gemma_gguf

_STEPS = flags.DEFINE_integer('steps', 32, 'Generated tokens per call.')
_BATCH = flags.DEFINE_integer('batch', 4, 'Sequences per call.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'gemma_generation'
PROMPT = 'The history of the river valley begins with the first farmers who'
LAYER = 'block_6'


def variants(direction):
  return {
      'no steering': (None, 'cached'),
      'addition': (steering_lib.Steering('addition', direction, alpha=0.5,
                                         coefficient=50.0), 'cached'),
      'spherical (no gate)': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, gate=False), 'cached'),
      'spherical + gate': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, beta=0.0), 'cached'),
      'recompute mode, no steering': (None, 'recompute'),
  }


def main(argv):
  del argv
  loaded = gemma_gguf.load(gemma_gguf.registry_file())
  ids = loaded.tokenizer.encode_document(PROMPT)
  prompt = jnp.tile(jnp.asarray(ids)[None], (_BATCH.value, 1))
  valid = jnp.ones(prompt.shape, bool)
  model = gemma.Gemma3(loaded.shape, max_len=len(ids) + _STEPS.value)
  params = jax.device_put(loaded.params)
  direction = jax.random.normal(jax.random.key(2), (model.d_model,))
  times = timing.time_variants(
      model, params, prompt, valid, variants(direction), LAYER,
      _STEPS.value, _REPEATS.value, calls=1)
  tokens = _BATCH.value * _STEPS.value
  base = times['no steering']
  rows = []
  for name, (_, mode) in variants(direction).items():
    ratio = statistics.median(b / t for b, t in zip(base, times[name]))
    goal = ('-' if name == 'no steering' or mode == 'recompute'
            else '>= 0.95x')
    rows.append([name, mode,
                 f'{tokens / statistics.median(times[name]):.1f}',
                 '1 (baseline)' if name == 'no steering'
                 else f'**{ratio:.3f}x**', goal])
  lines = [
      '## Gemma 3 270M generation',
      '',
      f'The registry\'s Gemma 3 270M (float32 parameters from the Q4_K_M '
      f'file), batch {_BATCH.value}, a {len(ids)}-token prompt, '
      f'{_STEPS.value} greedy steps, steering at {LAYER}, one CPU device. '
      f'Median of {_REPEATS.value} alternating repeats.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'jax {jax.__version__}.',
      '',
      stats.markdown_table(
          ['variant', 'mode', 'tokens/s (median)',
           'tokens/s / unsteered cached', 'goal'], rows, '-----'),
      '',
      'Reproduce: `.venv/bin/python -m bench.generation.gemma '
      f'--steps={_STEPS.value} --batch={_BATCH.value} '
      f'--repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
