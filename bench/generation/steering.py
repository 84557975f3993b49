r"""What steering costs in generation: tokens/s with steering / without, KV cache on.

  python -m bench.generation.steering          # writes the BENCHMARKS.md section
  python -m bench.generation.steering --repeats=3 --nowrite

Model: configs/lm.py's decoder (d_model 128, 4 blocks) for each of
`--tokenizers`: the byte vocabulary (256) and the subword one
(`tokenizer=sentencepiece`, 1024 pieces), randomly initialised (speed
depends on the vocabulary's size, not on the weights or the pieces), one
CPU device. Each variant is one jitted `lm_generate.generate` call in
'cached' mode (prefill of a 32-token prompt, then `--steps` greedy
decoding steps) on a batch of `--batch`; variants alternate over
`--repeats` repeats and the median of the per-repeat ratios is reported.
Steering is at block 2, on every generated token. Goal: >= 0.95x for
each steering method. For information, the reference's 'recompute' mode
(no cache, the prefix re-run each step) against the cached baseline.
"""

import os
import platform
import statistics

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp

from bench.generation import timing
from bench import report
from configs import lm as lm_config
from geom import steering as steering_lib
from train.analysis import stats
from train.lm import decoder as decoder_lm

_STEPS = flags.DEFINE_integer('steps', 128, 'Generated tokens per call.')
_BATCH = flags.DEFINE_integer('batch', 16, 'Sequences per call.')
_REPEATS = flags.DEFINE_integer('repeats', 7, 'Alternating repeats.')
_CALLS = flags.DEFINE_integer('calls', 3, 'Timed calls per repeat.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')
_TOKENIZERS = flags.DEFINE_list('tokenizers', ['byte', 'sentencepiece'],
                                "configs/lm.py's tokenizer argument.")

SECTION = 'steering_generation'
PROMPT = 32
LAYER = 'block_2'


def variants(direction):
  return {
      'no steering': (None, 'cached'),
      'addition': (steering_lib.Steering('addition', direction, alpha=0.5,
                                         coefficient=10.0), 'cached'),
      'addition + gate': (steering_lib.Steering(
          'addition', direction, alpha=0.5, coefficient=10.0, gate=True),
                          'cached'),
      'spherical (no gate)': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, gate=False), 'cached'),
      'spherical + gate': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, beta=0.0), 'cached'),
      'recompute mode, spherical + gate': (steering_lib.Steering(
          'spherical', direction, alpha=0.5, beta=0.0), 'recompute'),
  }


def measure(tokenizer: str):
  """(model, {variant: per-repeat seconds per call}) for one vocabulary."""
  config = lm_config.get_config(None if tokenizer == 'byte'
                                else f'tokenizer={tokenizer}')
  model = decoder_lm.DecoderLM(**config.model)
  params = nn.meta.unbox(model.init(jax.random.key(0),
                                    jnp.zeros((1, 8), jnp.int32))['params'])
  prompt = jax.random.randint(jax.random.key(1), (_BATCH.value, PROMPT), 3,
                              min(128, model.vocab_size))
  valid = jnp.ones(prompt.shape, bool)
  direction = jax.random.normal(jax.random.key(2), (model.d_model,))

  times = timing.time_variants(
      model, params, prompt, valid, variants(direction), LAYER,
      _STEPS.value, _REPEATS.value, _CALLS.value)
  return model, times


def main(argv):
  del argv
  tokens = _BATCH.value * _STEPS.value
  ratio_rows, speed_rows = [], []
  for tokenizer in _TOKENIZERS.value:
    model, times = measure(tokenizer)
    base = times['no steering']
    vocab = f'{tokenizer} ({model.vocab_size})'
    for name, (_, mode) in variants(jnp.ones(model.d_model)).items():
      speed_rows.append(
          [vocab, name, f'{tokens / statistics.median(times[name]):.0f}'])
      if name == 'no steering':
        continue
      ratio = statistics.median(b / t for b, t in zip(base, times[name]))
      goal = '>= 0.95x' if mode == 'cached' else '-'
      ratio_rows.append([vocab, name, f'**{ratio:.3f}x**', goal])
  lines = [
      '## Steering in generation',
      '',
      f'configs/lm.py decoder (d_model {model.d_model}, {model.num_layers} '
      f'blocks) with each vocabulary (byte: 256; sentencepiece: the subword '
      f'LM\'s 1024 pieces), batch {_BATCH.value}, {PROMPT}-token prompt, '
      f'{_STEPS.value} greedy steps, KV cache, steering at {LAYER}, one CPU '
      f'device. Median of {_REPEATS.value} alternating repeats of '
      f'{_CALLS.value} calls.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores, '
      f'jax {jax.__version__}.',
      '',
      stats.markdown_table(
          ['tokenizer (vocabulary)', 'tokens/s with steering / without',
           'measured', 'goal'], ratio_rows, '----'),
      '',
      stats.markdown_table(
          ['tokenizer (vocabulary)', 'variant', 'tokens/s (median)'],
          speed_rows, '---'),
      '',
      'Reproduce: `.venv/bin/python -m bench.generation.steering '
      f'--steps={_STEPS.value} --batch={_BATCH.value} '
      f'--repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
